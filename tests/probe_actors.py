"""Real actors with a knob only tests need: a generator whose engine steps take longer (as a large
model's would, so that requests are still running when new weights arrive), and a trainer that
changes chosen weights by a factor and publishes them (a policy visibly different from the last).
Imported by the actor processes (conftest puts tests/ on their PYTHONPATH)."""

import asyncio
import re
import time

import torch
from monarch.actor import endpoint

from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.trainer import TitanTrainer


class SlowStepGenerator(VLLMGenerator):
    """Each engine step takes at least 20 ms more."""

    def _step(self) -> None:
        time.sleep(0.02)
        super()._step()


class ScalingTrainer(TitanTrainer):
    @endpoint
    async def scale_and_publish(self, pattern: str, factor: float) -> int:
        """Multiply every parameter whose (torchtitan) name matches `pattern` by `factor`, publish; the new
        version."""
        await self._published()  # not under a publish still copying them
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if re.fullmatch(pattern, name):
                    param.mul_(factor)
        return await self._publish()


class WorkerHandoffGenerator(VLLMGenerator):
    """Loads every version the way a tensor-parallel replica does (vLLM's collective_rpc to its worker
    extension, which maps the reader's shared memory; the swap in a thread), with the one worker of
    tensor parallel size 1 here."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.through_workers = True


class SlowPublishTrainer(TitanTrainer):
    """Each publish starts half a second late (its first part waits first, as one queued behind other work
    would: the next call must still come after it), and its copy into the ring takes a second longer (as a
    large model's device-to-host copy would)."""

    async def _start_publish(self) -> int:
        await asyncio.sleep(0.5)
        return await super()._start_publish()

    def _write_ring(self, weights: dict, version: int) -> None:
        time.sleep(1.0)
        super()._write_ring(weights, version)
