"""Weights split by rows across trainer ranks, as FSDP2 shards them (dim 0, torch.chunk sizes):
which rows each rank holds, and the reader that reads every rank's ring and puts the newest version
they all completed back together in the layout vLLM loads. Nobody gathers the full model: each rank
publishes its own shard, and only the readers assemble.

The rings hold torchtitan's names and row order; `to_hf` (the model's state-dict adapter) turns the
assembled tensors into HF names and order after the read, because torchtitan's q/k rows map to HF's
within each head, across shard boundaries. One rank is the single-ring case.
"""

from collections import defaultdict
from typing import Callable

import torch

from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync.ring import RingHandle, RingReader, newest_together, pull_together


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
    """Generator side: `pull_latest` returns the newest version every rank's ring holds complete, as
    full tensors under HF names; never a torn shard, never shards of different versions."""

    def __init__(self, handles: list[RingHandle], full: WeightLayout, to_hf: Callable[[dict], dict],
                 transport: str = "auto", max_attempts: int = 50):
        world = len(handles)
        self.readers = [RingReader(h, shard_layout(full, rank, world), transport, max_attempts)
                        for rank, h in enumerate(handles)]
        self.to_hf, self.max_attempts = to_hf, max_attempts
        self.transport = self.readers[0].transport

    @property
    def torn_reads(self) -> int:
        return sum(r.torn_reads for r in self.readers)

    @property
    def corrupt_reads(self) -> int:
        return sum(r.corrupt_reads for r in self.readers)

    async def newest(self) -> int:
        """The newest version every rank's ring holds complete (headers only: cheap to ask often); -1: none."""
        return await newest_together(self.readers)

    async def pull_latest(self, newer_than: int = -1) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        latest = await pull_together(self.readers, newer_than, self.max_attempts)
        if latest is None:
            return None
        version, shards = latest
        parts = defaultdict(list)
        for shard in shards:
            for name, tensor in shard:
                parts[name].append(tensor)
        full = {name: ts[0] if len(ts) == 1 else torch.cat(ts) for name, ts in parts.items()}
        return version, list(self.to_hf(full).items())
