"""Weights split by rows across trainer ranks, as FSDP2 shards them (dim 0, torch.chunk sizes):
which rows each rank holds, and the reader that reads every rank's ring and puts the newest version
they all completed back together in the layout vLLM loads. Nobody gathers the full model: each rank
publishes its own shard, and only the readers assemble.

The rings hold torchtitan's names and row order; `to_hf` (the model's state-dict adapter) turns the
assembled tensors into HF names and order after the read, because torchtitan's q/k rows map to HF's
within each head, across shard boundaries. One rank is the single-ring case.

What a reader hands on is copied as few times as the transport allows: over shared memory with one
rank, not at all before the generator's own load copies it out of the trainer's ring; with several
ranks, once, each shard straight into its rows of the full tensors; over RDMA, once more, from the
network's landing buffer.
"""

from typing import Callable

import torch

from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync.ring import RingHandle, RingReader, newest_together, pull_together, use_in_place

Weights = list[tuple[str, torch.Tensor]]


def shard_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The [start, end) rows of `rank`: chunks of ceil(rows / world), the last short, any after it empty."""
    per = -(-rows // world)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def shard_layout(full: WeightLayout, rank: int, world: int) -> WeightLayout:
    """The layout of `rank`'s shard of every tensor of `full`."""
    shapes = {}
    for spec in full.specs:
        start, end = shard_rows(spec.shape[0], rank, world)
        shapes[spec.name] = ((end - start, *spec.shape[1:]), spec.dtype)
    return WeightLayout.of(shapes)


class ShardedReader:
    """Generator side: `load_latest` hands the newest version every rank's ring holds complete to a
    loader, as full tensors under HF names; never a torn shard, never shards of different versions."""

    def __init__(self, handles: list[RingHandle], full: WeightLayout, to_hf: Callable[[dict], dict],
                 transport: str = "auto", max_attempts: int = 50):
        world = len(handles)
        self.readers = [RingReader(h, shard_layout(full, rank, world), transport, max_attempts)
                        for rank, h in enumerate(handles)]
        self.full, self.to_hf, self.max_attempts = full, to_hf, max_attempts
        self.transport = self.readers[0].transport
        self.assembled: torch.Tensor | None = None  # the full tensors, with several ranks

    @property
    def torn_reads(self) -> int:
        return sum(r.torn_reads for r in self.readers)

    @property
    def corrupt_reads(self) -> int:
        return sum(r.corrupt_reads for r in self.readers)

    async def newest(self) -> int:
        """The newest version every rank's ring holds complete (headers only: cheap to ask often); -1: none."""
        return await newest_together(self.readers)

    async def load_latest(self, load: Callable[[int, Weights], None], newer_than: int = -1) -> int | None:
        """Call `load(version, weights)` with the newest version newer than `newer_than` (HF-named tensors,
        valid only during the call: they may be views of the trainer's memory) and return that version;
        None if there is none. Over shared memory `load` may be called again, when a version was
        overwritten while it read: only the last call's tensors are whole, and no other coroutine runs
        between the calls."""
        if self.transport == "shm":
            return use_in_place(self.readers, newer_than, self.max_attempts,
                                lambda version, shards: load(version, self._hf(shards)))
        latest = await pull_together(self.readers, newer_than, self.max_attempts)
        if latest is None:
            return None
        version, shards = latest
        load(version, self._hf(shards))
        return version

    def _hf(self, shards: list[Weights]) -> Weights:
        """Every rank's shard of each tensor as one full tensor under its HF name."""
        if len(shards) == 1:
            return list(self.to_hf(dict(shards[0])).items())
        if self.assembled is None:
            self.assembled = torch.empty(self.full.nbytes, dtype=torch.uint8)
        full = dict(self.full.unpack(self.assembled))
        for rank, shard in enumerate(shards):
            for name, tensor in shard:
                start, end = shard_rows(full[name].shape[0], rank, len(shards))
                full[name][start:end].copy_(tensor)
        return list(self.to_hf(full).items())
