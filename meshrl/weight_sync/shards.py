"""Weights split by rows across trainer ranks, as FSDP2 shards them (dim 0, torch.chunk sizes):
which rows each rank holds, one weight ring per host that the host's ranks write their rows into,
and the reader that reads every host's ring and puts the newest version they all completed back
together in the layout vLLM loads. Nobody gathers the full model: each rank publishes its own rows,
and only readers reading rings on several hosts assemble.

The rings hold torchtitan's names and row order; `to_hf` (the model's state-dict adapter) turns the
assembled tensors into HF names and order after the read, because torchtitan's q/k rows map to HF's
within each head, across shard boundaries. One rank is the single-ring case.

What a reader hands on is its own copy, never a view of the trainer's memory: each ring's slot is
copied once into the reader's memory (over shared memory in a thread, off the event loop; over RDMA
into the network's landing buffer) and checked there, so what was checked is what gets loaded; from
rings on several hosts, the rows are then put together in full tensors (one copy more). Both lie in
shared memory (memfd) of the reader's process, which a tensor-parallel replica's workers map.
"""

import asyncio
import threading
from typing import Callable

import torch

from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync.ring import (Pieces, RingHandle, RingReader, SharedMemory, WeightRing, host_id, newest_together,
                                     pull_together)

Weights = list[tuple[str, torch.Tensor]]


def shard_rows(rows: int, rank: int, world: int, end_rank: int | None = None) -> tuple[int, int]:
    """The [start, end) rows of `rank` (or of ranks [rank, end_rank)): chunks of ceil(rows / world),
    the last short, any after it empty."""
    per = -(-rows // world)
    return min(rank * per, rows), min((end_rank or rank + 1) * per, rows)


def shard_layout(full: WeightLayout, rank: int, world: int, end_rank: int | None = None) -> WeightLayout:
    """The layout of `rank`'s (or ranks [rank, end_rank)'s) rows of every tensor of `full`."""
    shapes = {}
    for spec in full.specs:
        start, end = shard_rows(spec.shape[0], rank, world, end_rank)
        shapes[spec.name] = ((end - start, *spec.shape[1:]), spec.dtype)
    return WeightLayout.of(shapes)


def writer_pieces(full: WeightLayout, first: int, end: int, world: int) -> Pieces:
    """For each rank of [first, end): where its rows of each tensor lie in a ring holding all their rows."""
    pieces, full_rows = [[] for _ in range(first, end)], {spec.name: spec.shape[0] for spec in full.specs}
    for spec in shard_layout(full, first, world, end).specs:
        rows = full_rows[spec.name]
        row_bytes = spec.nbytes // spec.shape[0] if spec.shape[0] else 0
        base = shard_rows(rows, first, world)[0]
        for rank in range(first, end):
            start, stop = shard_rows(rows, rank, world)
            lo = spec.offset + (start - base) * row_bytes
            pieces[rank - first].append((spec.name, lo, lo + (stop - start) * row_bytes))
    return pieces


def same_host_run(hosts: list[str], rank: int) -> tuple[int, int]:
    """The ranks [first, end) around `rank` that are consecutive and on its host (`hosts`: each rank's)."""
    first, end = rank, rank + 1
    while first > 0 and hosts[first - 1] == hosts[rank]:
        first -= 1
    while end < len(hosts) and hosts[end] == hosts[rank]:
        end += 1
    return first, end


def host_ring(full: WeightLayout, rank: int, world: int, gather: Callable[[object], list], slots: int,
              chunk_mb: int, checksums: bool) -> WeightRing:
    """This rank's ring: one per run of consecutive ranks on one host, created by the first of them and
    written by each into its rows. `gather(x)` returns every rank's x in rank order (an all-gather)."""
    first, end = same_host_run(gather(host_id()), rank)
    layout = shard_layout(full, first, world, end)
    pieces = writer_pieces(full, first, end, world) if end - first > 1 else None
    ring = None
    if rank == first:
        ring = WeightRing(layout, slots, chunk_mb, checksums, pieces, (first, end), world)
    infos = gather(ring.attach_info() if ring else None)
    return ring or WeightRing(layout, slots, chunk_mb, checksums, pieces, (first, end), world, rank - first,
                              infos[first])


class ShardedReader:
    """Generator side: `read_latest` reads the newest version every host's ring holds complete, as full
    tensors under HF names in the reader's own memory; never a torn shard, never shards of different
    versions."""

    def __init__(self, handles: list[RingHandle | None], full: WeightLayout, to_hf: Callable[[dict], dict],
                 transport: str = "auto", max_attempts: int = 50):
        """`handles`: every trainer rank's `weight_ring()`, in rank order (None from a rank that writes into
        another rank's ring)."""
        handles = [h for h in handles if h is not None]
        if [r for h in handles for r in range(*h.ranks)] != list(range(handles[0].world)):
            raise ValueError(f"the rings hold ranks {[h.ranks for h in handles]}, not each of {handles[0].world} once")
        self.readers = [RingReader(h, shard_layout(full, h.ranks[0], h.world, h.ranks[1]), transport) for h in handles]
        self.full, self.to_hf, self.max_attempts = full, to_hf, max_attempts
        self.transport = self.readers[0].transport
        self.assembled: SharedMemory | None = None  # the full tensors, with several rings
        self.assembling = threading.Lock()
        self.reported_bytes = 0  # `bytes_read` at the last `take_trainer_bytes`

    def memory(self) -> list[SharedMemory]:
        """The shared memory that what `read_latest` returns lies in (besides any tensor `to_hf` made anew):
        each ring's copy, and the assembled tensors'. A tensor-parallel replica's workers map it
        (meshrl/weight_sync/handoff.py)."""
        return [r.copy for r in self.readers] + ([self.assembled] if self.assembled is not None else [])

    @property
    def torn_reads(self) -> int:
        return sum(r.torn_reads for r in self.readers)

    @property
    def corrupt_reads(self) -> int:
        return sum(r.corrupt_reads for r in self.readers)

    @property
    def bytes_read(self) -> int:
        """Payload bytes copied out of the rings so far, torn copies included (their headers not counted)."""
        return sum(r.bytes_read for r in self.readers)

    def take_trainer_bytes(self) -> int:
        """Bytes read from the rings since the last call: the trainer's, when these are the trainer's rings
        (a relay's reader says otherwise: meshrl/weight_sync/relay.py)."""
        now = self.bytes_read
        taken, self.reported_bytes = now - self.reported_bytes, now
        return taken

    async def newest(self) -> int:
        """The newest version every rank's ring holds complete (headers only: cheap to ask often); -1: none."""
        return await newest_together(self.readers)

    async def read_latest(self, newer_than: int = -1) -> tuple[int, Weights] | None:
        """(version, HF-named full tensors) of the newest version newer than `newer_than`, read whole into this
        reader's own memory and checked, or None if there is none. The tensors are valid until the next read.
        Nothing here runs long on the event loop, and cancelling it (a timeout) leaves nothing running
        that could write anywhere but this reader's own buffers."""
        latest = await pull_together(self.readers, newer_than, self.max_attempts)
        if latest is None:
            return None
        version, shards = latest
        return version, await asyncio.to_thread(self._hf, shards)

    async def load_latest(self, load: Callable[[int, Weights], None], newer_than: int = -1) -> int | None:
        """Call `load(version, weights)` once with the newest version newer than `newer_than` (`read_latest`)
        and return that version; None if there is none."""
        latest = await self.read_latest(newer_than)
        if latest is None:
            return None
        load(*latest)
        return latest[0]

    def _hf(self, shards: list[Weights]) -> Weights:
        """Every ring's rows of each tensor as one full tensor under its HF name."""
        if len(shards) == 1:
            return list(self.to_hf(dict(shards[0])).items())
        with self.assembling:  # one thread at a time writes the full tensors
            if self.assembled is None:
                self.assembled = SharedMemory.create(self.full.nbytes)
            full = dict(self.full.unpack(self.assembled.tensor[:self.full.nbytes]))
            for reader, shard in zip(self.readers, shards):
                (first, end), world = reader.handle.ranks, reader.handle.world
                for name, tensor in shard:
                    start, stop = shard_rows(full[name].shape[0], first, world, end)
                    full[name][start:stop].copy_(tensor)
            return list(self.to_hf(full).items())
