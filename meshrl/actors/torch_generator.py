"""A second generator: sampling with the trainer's own torchtitan model (`--generator.impl torch`), no vLLM.

The model is the one the trainer trains (meshrl/models/model.py's `load_policy`: any family the trainer
supports, LoRA included), and meshrl/actors/torch_engine.py steps it: a KV cache in each attention layer,
every request in flight decoded together, joining requests' prompts prefilled in chunks, its own prefix
cache (a later turn finds its conversation's KV on the replica that made the earlier one: sticky routing
pays here too). It starts in seconds (no engine start, no KV pre-allocation beyond its slots) and runs
wherever torch does: a GPU machine without vLLM, or the CPU. What every generator does (the contract,
continuous batching, held completions, versions loaded between engine steps) is
meshrl/actors/generator_base.py's; here the engine takes requests and loads versions.

Versions come from the same rings as vLLM's, read under torchtitan's names (no HF mapping): each tensor is
copied into the model's parameter in place; with LoRA only the adapter crosses, into the adapter's
parameters. The logprobs are those of the distribution each token was sampled from (after the temperature
and any top-p), as vLLM's processed logprobs.

`generator.exact`: the weights are held in float32, as the trainer's master weights (published in float32),
and when a request finishes each of its completions is re-scored by meshrl/exact.py's `sequence_logprobs`,
the trainer's own computation one sequence at a time under its autocast rule (the trainer runs the same with
`trainer.per_sequence`): the behaviour logprobs then equal the trainer's recomputation bit for bit. The
tokens are sampled from the cached decoding's logits, which differ from the re-scoring's by rounding only.
"""

import json
import logging
import os
import time
from pathlib import Path

import torch

from meshrl.actors import pin_cpus
from meshrl.actors.engine import vllm_dtype
from meshrl.actors.generator_base import GeneratorActor
from meshrl.actors.generator_config import GeneratorConfig
from meshrl.actors.torch_engine import TorchEngine
from meshrl.exact import sequence_logprobs
from meshrl.models.lora import LoraConfig
from meshrl.models.model import load_policy
from meshrl.types import Prompt, Sampling
from meshrl.weight_sync import WeightSyncConfig, published_weights

logger = logging.getLogger(__name__)
MAX_SLOTS = 256  # sequences decoded at once at most (vLLM's default max_num_seqs)


def stop_token_ids(checkpoint: Path) -> set[int]:
    """The end-of-sequence tokens a checkpoint names (generation_config.json's, and config.json's), as vLLM
    stops at."""
    ids = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(checkpoint) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids


def cast(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """`model`'s floating-point parameters and buffers in `dtype` (RoPE's complex cache stays complex: `Module.to`
    would cast it to a real dtype, its imaginary part lost)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(dtype)


class TorchGenerator(GeneratorActor):
    ENGINE = "torch"

    def __init__(self, config: GeneratorConfig, weight_sync: WeightSyncConfig, checkpoint: str,
                 lora: LoraConfig | None = None):
        """`lora` (the trainer's, when it trains an adapter): the base with the trainer's adapter, as it trains."""
        super().__init__(config, weight_sync)
        from tokenizers import Tokenizer

        if config.devices:  # this replica's GPU (meshrl/runtime/gpu_plan.py), before anything starts CUDA
            os.environ["CUDA_VISIBLE_DEVICES"] = config.devices.split(",")[0]
        if config.cpus:
            pin_cpus(config.cpus, config.num_threads)
        else:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device("cuda" if config.devices else "cpu")  # the GPU plan gave it one, or none
        start = time.perf_counter()
        self.model, self.hf = load_policy(Path(checkpoint), lora=lora if lora and lora.rank else None)
        self.checkpoint, self.lora = checkpoint, bool(lora and lora.rank)
        dtype = vllm_dtype(config.dtype)  # bfloat16 | float32, as vLLM's would be here
        self.exact = config.exact
        # exact: the trainer's float32 master weights under its autocast rule; else the weights in the dtype
        self.autocast = config.exact and dtype == "bfloat16"
        cast(self.model, torch.float32 if config.exact else getattr(torch, dtype))
        self.model.to(self.device).eval()
        self.params = self.model.state_dict(keep_vars=True)
        # what the trainer's ranks publish, under torchtitan's names (no mapping: they are this model's)
        self.layout, _ = published_weights(Path(checkpoint), weight_sync.dtype, lora)
        self.to_hf = lambda tensors: tensors
        self.engine = TorchEngine(self.model, slots=self._slots(config), max_model_len=config.max_model_len,
                                  prefill_chunk=config.prefill_tokens,
                                  tokenizer=Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json")),
                                  stop_token_ids=stop_token_ids(Path(checkpoint)), seed=config.seed,
                                  bf16_autocast=self.autocast)
        self.temperatures: dict[str, float] = {}  # exact: each running request's, for its re-scoring
        self.cached: dict[str, int] = {}  # prompt tokens each running request took from the prefix cache
        logger.info("torch generator: %s on %s in %.1f s", checkpoint, self.device, time.perf_counter() - start)

    def _slots(self, config: GeneratorConfig) -> int:
        """Sequences decoded at once: as many as `generator.kv_cache_gib` of KV cache holds at max_model_len."""
        attention = [layer.attention for layer in self.model.layers.values() if hasattr(layer, "attention")]
        if not attention or not hasattr(attention[0], "n_kv_heads"):
            return MAX_SLOTS  # no cache to size (the transformers backend recomputes)
        element = torch.finfo(next(self.model.parameters()).dtype).bits // 8
        per_slot = 2 * len(attention) * attention[0].n_kv_heads * attention[0].head_dim * element * config.max_model_len
        return max(1, min(MAX_SLOTS, int(config.kv_cache_gib * 2**30 // per_slot)))

    def _add(self, request_id: str, prompt: Prompt, s: Sampling, seed: int | None) -> None:
        self.engine.add(request_id, prompt.token_ids, n=s.n, temperature=s.temperature, max_tokens=s.max_tokens,
                        top_p=s.top_p, stop=list(s.stop), seed=seed, salt=self.policy_version)
        self.temperatures[request_id] = s.temperature
        self.cached[request_id] = 0

    def _unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def _step(self) -> None:
        for out in self.engine.step():
            self.cached[out.request_id] = max(self.cached.get(out.request_id, 0), out.cached_tokens or 0)
            self._took(out.request_id, out.index, out.token_ids, out.logprobs, out.text, out.finish_reason)
            if out.finished:
                if self.exact:
                    self._rescore(out.request_id)
                self.temperatures.pop(out.request_id, None)
                self._ended(out.request_id, self.cached.pop(out.request_id, 0))

    def _rescore(self, request_id: str) -> None:
        """generator.exact: each completion's logprobs as the trainer computes them, under the weights that
        sampled it (weight_update drain: no load while it ran)."""
        request = self.running.get(request_id)
        if request is None:
            return
        for seq in request.sequences:
            if seq.token_ids:
                seq.logprobs = sequence_logprobs(self.model, request.prompt.token_ids + seq.token_ids,
                                                 len(request.prompt.token_ids), self.temperatures[request_id],
                                                 self.autocast)

    def _reset_cache(self, running: bool) -> bool:
        """Entries of older versions are never matched (each request's salt is its version); `recompute`: the
        running sequences' prefixes computed again under the new weights before their next token."""
        if running:
            self.engine.recompute_running()
        self.engine.reset_prefix_cache()
        return True

    @torch.no_grad()
    def reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Each published tensor into the model's parameter of its name, in place (a tied LM head once, as the
        embedding it is)."""
        for name, tensor in weights:
            target = self.params.get(name)
            if target is None:
                raise KeyError(f"the published tensor {name} is not a parameter of this model")
            target.copy_(tensor)

    def _policy(self, served: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
        return None if self.lora else self.hf.to_hf(dict(served))  # torchtitan's names, as the model's

    def _sleep(self) -> None:
        self.engine.sleep(offload=self.device.type == "cuda")

    def _wake_engine(self) -> None:
        self.engine.wake()
