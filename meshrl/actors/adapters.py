"""A LoRA adapter served by vLLM: the trainer's adapter, loaded in place at each version, or merged into
the base weights the replica holds (`trainer.lora.serving`).

vLLM keeps adapters by id. `add_lora` with `load_inplace` reads the adapter's directory again and
replaces the loaded adapter, so requests already running go on under the new one from their next
engine step (an in-flight update, as for full weights). The requests themselves name the adapter
without `load_inplace`: vLLM would read it again at every step otherwise. A replica serves the adapter
from its start: before the first version, a zero adapter (the base exactly), so that no request runs on
the base alone when the first version arrives.

On the CPU, vLLM's LoRA kernels generate about 5 times slower than the base alone (SmolLM2, the demo,
2026-11-25): there a replica merges each version into its copy of the adapted layers' base weights
(W + scaling B A, 7 matrices a layer) and reloads those as full weights, generating at the base's speed.
Only the adapter crosses the ring either way.
"""

import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from meshrl.models.lora import PEFT_PREFIX, VLLM_RANKS, LoraConfig, adapter_config, merged, save_adapter

ADAPTER_ID = 1


def lora_options(lora: LoraConfig) -> dict:
    """vLLM's engine arguments for serving one adapter of `lora`'s rank."""
    return {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1,
            "max_lora_rank": min(r for r in VLLM_RANKS if r >= lora.rank)}


class ServedAdapter:
    """The adapter a replica serves: its files in shared memory, and the request that names it."""

    def __init__(self, engine, lora: LoraConfig, to_hf, checkpoint: str, layout):
        from vllm.lora.request import LoRARequest

        self.engine = engine
        self.dir = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None,
                                         prefix="meshrl-adapter-"))
        weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.config = adapter_config(lora, to_hf.target_modules(), checkpoint)
        self.request = LoRARequest("policy", ADAPTER_ID, str(self.dir))
        self.reload = LoRARequest("policy", ADAPTER_ID, str(self.dir), load_inplace=True)
        zeros = {spec.name: torch.zeros(spec.shape, dtype=spec.dtype) for spec in layout.specs}
        self.load(list(to_hf(zeros).items()))

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """The adapter's PEFT-named tensors in place of the one served."""
        save_adapter(dict(weights), self.config, self.dir)
        if not self.engine.add_lora(self.reload):
            raise RuntimeError("vLLM did not load the adapter")


def serves_adapters(lora: LoraConfig, on_gpu: bool) -> bool:
    """Whether a replica serves `lora` through vLLM's LoRA (else merged into its base weights)."""
    return lora.serving == "adapter" or (lora.serving == "auto" and on_gpu)


class MergedAdapter:
    """The adapter merged into the base weights the replica holds: each version's adapted layers as full
    weights, W + scaling B A, in the dtype versions are published in."""

    def __init__(self, lora: LoraConfig, to_hf, checkpoint: str, dtype: torch.dtype):
        from safetensors import safe_open

        wanted = {name.removeprefix(PEFT_PREFIX) + ".weight" for name in to_hf.hf_name.values()}
        self.base = {}  # the adapted layers' weights only, read as such: not the whole checkpoint
        for path in sorted(Path(checkpoint).glob("*.safetensors")):
            with safe_open(path, framework="pt") as f:
                self.base.update({name: f.get_tensor(name) for name in f.keys() if name in wanted})
        self.scaling, self.dtype = lora.scaling, dtype

    def merge(self, weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The adapter's PEFT-named tensors -> the adapted layers' merged HF weights."""
        return list(merged(self.base, dict(weights), self.scaling, self.dtype).items())
