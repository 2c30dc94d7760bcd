"""Faults injected into the real generator and trainer: a call that never answers, as a hung weight
transfer or a stuck collective would, and a loss that turns NaN. Imported by the actor processes
(conftest puts tests/ on their PYTHONPATH)."""

import asyncio
import os
from pathlib import Path

import torch
from monarch.actor import endpoint

from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.trainer import TitanTrainer


class StallingPullGenerator(VLLMGenerator):
    """The first replica's first weight pull of the run hangs; its replacement pulls normally (a marker
    file in $MESHRL_TEST_STALL_DIR says the stall has happened)."""

    async def _load(self) -> None:
        marker = Path(os.environ["MESHRL_TEST_STALL_DIR"]) / "pull-stalled"
        if not marker.exists() and self.ring is not None and await self.ring.newest() > self.policy_version:
            marker.touch()
            self.ring.load_latest = stall  # this replica's reads never finish
        await VLLMGenerator._load(self)


async def stall(*args, **kwargs):
    await asyncio.sleep(3600)


class StallingTrainer(TitanTrainer):
    """The first trainer's second optimizer step never answers; a restarted trainer's do (a marker file
    in $MESHRL_TEST_STALL_DIR says the stall has happened)."""

    @endpoint
    async def optim_step(self, skip: bool = False) -> dict:
        self.stall_count = getattr(self, "stall_count", 0) + 1
        marker = Path(os.environ["MESHRL_TEST_STALL_DIR"]) / "trainer-stalled"
        if self.stall_count == 2 and not marker.exists():
            marker.touch()
            await asyncio.sleep(3600)
        return await TitanTrainer.optim_step._method(self, skip)


class NaNTrainer(TitanTrainer):
    """From its second micro-batch on, every advantage is NaN (bad data), so the loss and the gradients are."""

    def _train_on(self, batch) -> dict:
        self.batches = getattr(self, "batches", 0) + 1
        if self.batches >= 2:
            batch.advantages = torch.full_like(batch.advantages, float("nan"))
        return super()._train_on(batch)


class SlowSaveTrainer(TitanTrainer):
    """Writing its state for a checkpoint takes a minute."""

    @endpoint
    async def save_state(self, path: str) -> None:
        await asyncio.sleep(60)
        return await TitanTrainer.save_state._method(self, path)


class MarkingGenerator(VLLMGenerator):
    """Writes the file its worker's MESHRL_TEST_MARKER names as it starts: evidence that it ran."""

    def __init__(self, *args, **kwargs):
        Path(os.environ["MESHRL_TEST_MARKER"]).write_text("spawned")
        super().__init__(*args, **kwargs)


class DyingTrainer(TitanTrainer):
    """The first trainer's process dies in its optimizer step from version 2 to 3; the trainer started in its
    place (a marker file in $MESHRL_TEST_STALL_DIR says the death has happened) never answers its first
    forward_backward, so the restart that brings it back never ends."""

    @endpoint
    async def optim_step(self, skip: bool = False) -> dict:
        marker = Path(os.environ["MESHRL_TEST_STALL_DIR"]) / "trainer-died"
        if self.policy_version == 2 and not marker.exists():
            marker.touch()
            os._exit(1)
        return await TitanTrainer.optim_step._method(self, skip)

    @endpoint
    async def forward_backward(self, refs) -> list[dict]:
        if (Path(os.environ["MESHRL_TEST_STALL_DIR"]) / "trainer-died").exists():
            await asyncio.sleep(3600)
        return await TitanTrainer.forward_backward._method(self, refs)
