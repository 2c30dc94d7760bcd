"""The `generator.engine` section: how vLLM runs on the device it is given (CUDA graphs, sleep mode).
Each setting is `auto` by default, resolved per device by one pure function
(meshrl/actors/engine.py: engine_settings), so that a GPU run gets a GPU's engine and the CPU keeps
the eager, in-process engine it has always run."""

from dataclasses import dataclass

SWITCH = ("auto", "on", "off")


@dataclass
class EngineConfig:
    """vLLM's engine options that differ between a GPU and the CPU (the GPU plan fills in `auto`s that
    depend on the placement: meshrl/runtime/gpu_plan.py)."""

    cuda_graphs: str = "auto"  # capture CUDA graphs of the decoding steps (vLLM's enforce_eager off): auto (on a GPU; eager on the CPU) | on (GPU only) | off
    sleep: str = "auto"  # vLLM's sleep mode: the engine frees its KV cache (and moves its weights to host memory) while a synchronous step trains on the GPU it shares; auto (on where the GPU plan puts the generator on a GPU with trainer or reference ranks and controller.max_policy_age is 0) | on (GPU only) | off

    def check(self) -> None:
        for name in ("cuda_graphs", "sleep"):
            if getattr(self, name) not in SWITCH:
                raise ValueError(f"unknown generator.engine.{name} {getattr(self, name)!r}; known: {', '.join(SWITCH)}")
