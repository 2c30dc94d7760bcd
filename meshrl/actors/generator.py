"""The vLLM generator: vLLM in process, producing Completions with per-token logprobs and, for every token,
the policy version it was sampled from. The logprobs are those of the distribution each token was
sampled from (vLLM's processed logprobs: after the temperature), which is what the trainer scores
the same tokens under. What every generator does (the contract, continuous batching, held completions,
loading versions as `generator.weight_update` says) is meshrl/actors/generator_base.py's; here vLLM's engine
takes the requests, is stepped, loads each version in place and resets its prefix cache. New requests never
share prefix-cache blocks with requests of another version (a per-version `cache_salt`).

With `generator.tensor_parallel_size` > 1 vLLM runs a worker process per GPU of the replica (its GPUs
come from meshrl/runtime/gpu_plan.py): each worker then maps the shared memory the version was read into
and loads its own part of every tensor (meshrl/weight_sync/handoff.py; no file), the swap running in a
thread while the engine takes no step and admits no request, so the replica's other calls are answered
meanwhile.
"""

import logging

import torch

from meshrl.actors.adapters import MergedAdapter, ServedAdapter, lora_options, serves_adapters
from meshrl.actors.engine import start_vllm
from meshrl.actors.generator_base import GeneratorActor
from meshrl.actors.generator_config import GeneratorConfig
from meshrl.models.lora import LoraConfig
from meshrl.types import Prompt, Sampling
from meshrl.weight_sync import WeightSyncConfig, published_weights
from meshrl.weight_sync.handoff import Handoff
from meshrl.weight_sync.verify import Verifier

logger = logging.getLogger(__name__)
HANDOFF_WORKER = "meshrl.weight_sync.handoff.SharedWeightsWorker"  # mixed into vLLM's workers: `hand_to_workers`


class VLLMGenerator(GeneratorActor):
    ENGINE = "vLLM"

    def __init__(self, config: GeneratorConfig, weight_sync: WeightSyncConfig, checkpoint: str,
                 lora: LoraConfig | None = None):
        """`lora` (the trainer's, when it trains an adapter): vLLM serves the base with the trainer's adapter,
        loaded in place at each version (meshrl/actors/adapters.py)."""
        super().__init__(config, weight_sync)
        # processed logprobs: those of the distribution each token was sampled from (after the temperature),
        # which the trainer's logprobs of logits / temperature are compared with
        # the run plans each replica's GPUs (meshrl/runtime/gpu_plan.py): none on a CPU-only host
        served = bool(lora and lora.rank and serves_adapters(lora, on_gpu=bool(config.devices)))
        self.llm = start_vllm(checkpoint, dtype=config.dtype, max_model_len=config.max_model_len,
                              memory_fraction=config.memory_fraction, seed=config.seed, num_threads=config.num_threads,
                              cpus=config.cpus, kv_cache_gib=config.kv_cache_gib, devices=config.devices,
                              tensor_parallel_size=config.tensor_parallel_size, engine=config.engine,
                              logprobs_mode="processed_logprobs", worker_extension_cls=HANDOFF_WORKER,
                              **(lora_options(lora) if served else {}))
        # what the trainer's ranks publish, together
        self.layout, self.to_hf = published_weights(checkpoint, weight_sync.dtype, lora)
        self.checkpoint = checkpoint
        self.adapter: ServedAdapter | MergedAdapter | None = None
        if served:
            self.adapter = ServedAdapter(self.llm.llm_engine, lora, self.to_hf, checkpoint, self.layout)
        elif lora and lora.rank:
            self.adapter = MergedAdapter(lora, self.to_hf, checkpoint, self.layout.specs[0].dtype)
        # versions reach vLLM's workers in processes of their own through shared memory (tensor parallelism)
        self.through_workers = config.tensor_parallel_size > 1
        self.handoff = Handoff()
        self.verifier = Verifier(weight_sync.disk_dir, self.reload, self._vllm_model) if weight_sync.verify else None
        self.engine = self.llm.llm_engine

    def _add(self, request_id: str, prompt: Prompt, s: Sampling, seed: int | None) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens,
                                logprobs=0, output_kind=RequestOutputKind.DELTA, stop=s.stop or None,
                                include_stop_str_in_output=True, seed=seed)
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt.token_ids,
                                                         cache_salt=f"v{self.policy_version}"), params,
                                lora_request=self.adapter.request if isinstance(self.adapter, ServedAdapter) else None)

    def _unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _step(self) -> None:
        """One engine step's new tokens, each sampled under the version served now."""
        for output in self.engine.step():
            request = self.running.get(output.request_id)
            if request is None:
                continue
            for out in output.outputs:
                logprobs = [step[token].logprob for step, token in zip(out.logprobs or [], out.token_ids)]
                self._took(output.request_id, out.index, out.token_ids, logprobs, out.text, out.finish_reason)
            if output.finished or all(seq.finish_reason for seq in request.sequences):
                self._ended(output.request_id, output.num_cached_tokens or 0)  # vLLM's prefix cache served these

    def _reset_cache(self, running: bool) -> bool:
        return self.engine.reset_prefix_cache(reset_running_requests=running)

    def _loads_here(self) -> bool:
        return not self.through_workers or isinstance(self.adapter, ServedAdapter)

    def reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors into vLLM in place: handed to its one worker in this process, or with
        tensor parallelism (workers in processes of their own) through the shared memory they lie in, which
        each worker maps, loading its own part of every tensor (`hand_to_workers`)."""
        if isinstance(self.adapter, ServedAdapter):
            return self.adapter.load(weights)
        if self.adapter:  # merged: the adapted layers' full weights
            weights = self.adapter.merge(weights)
        if self.through_workers:
            self.hand_to_workers(weights)
        else:
            self.engine.model_executor.driver_worker.worker.reload_weights(weights_iterator=iter(weights))

    def _policy(self, served: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
        return None if self.adapter else dict(served)  # the rings' tensors are HF-named (`to_hf`)

    def _vllm_model(self) -> torch.nn.Module:
        return self.engine.model_executor.driver_worker.worker.model_runner.get_model()

    def hand_to_workers(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Every worker loads `weights` from this process's shared memory (the reader's copy; tensors the
        adapter made anew, copied once into a spill buffer), through vLLM's `collective_rpc`: it returns
        once all have loaded."""
        message = self.handoff.message(weights, self.ring.memory())
        self.llm.collective_rpc("meshrl_load_shared", kwargs=message)

    def _sleep(self) -> None:
        self.llm.sleep(level=1)  # the KV cache freed, the weights moved to host memory

    def _wake_engine(self) -> None:
        self.llm.wake_up()

    def _attached(self) -> None:
        served, published = self.engine.model_config.dtype, self.layout.specs[0].dtype
        if served != published:
            logger.warning("versions are published in %s but vLLM serves %s here: the served policy is a rounded "
                           "copy of the trained one (weight_sync.dtype)", published, served)
