"""Trainer ranks' rows in weight rings, in one process: which rows each rank holds (FSDP2's Shard(0)),
rings of one rank each (ranks on different hosts) or one ring the ranks of a host share, and a reader
that hands on full tensors only from rows of one version, never a mix."""

import asyncio
import threading

import pytest
import torch

from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync.ring import CorruptWeightsError, WeightRing
from meshrl.weight_sync.shards import ShardedReader, host_ring, same_host_run, shard_layout, shard_rows, writer_pieces


@pytest.mark.parametrize("rows, world", [(9, 2), (5, 4), (3, 4), (576, 3), (1, 2)])
def test_shard_rows_are_torch_chunks_with_empty_ones_after(rows, world):
    chunks = torch.arange(rows).chunk(world)  # what FSDP2 holds on each rank
    for rank in range(world):
        start, end = shard_rows(rows, rank, world)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, end)) == expected


def full_weights(version: int) -> dict[str, torch.Tensor]:
    base = torch.arange(5 * 4, dtype=torch.float32).view(5, 4)
    return {"w": base + 100 * version, "b": torch.arange(3.0) + 100 * version, "one": torch.tensor([float(version)])}


LAYOUT = WeightLayout.of_tensors(full_weights(0))


def rank_rings(world: int, shared: bool, **options) -> list[WeightRing]:
    """Each rank's ring object: its own ring (`shared` False, as on hosts of their own), or one ring that
    rank 0 created and the others write their rows into (one host)."""
    if not shared:
        return [WeightRing(shard_layout(LAYOUT, rank, world), ranks=(rank, rank + 1), world=world, **options)
                for rank in range(world)]
    pieces = writer_pieces(LAYOUT, 0, world, world)
    first = WeightRing(LAYOUT, pieces=pieces, ranks=(0, world), world=world, **options)
    return [first] + [WeightRing(LAYOUT, pieces=pieces, ranks=(0, world), world=world, writer=rank,
                                 attach_to=first.attach_info(), **options) for rank in range(1, world)]


def publish(rings, version: int, ranks=None) -> None:
    """Each rank (or only `ranks`) publishes its rows of `version`."""
    full = full_weights(version)
    for rank, ring in enumerate(rings):
        if ranks is None or rank in ranks:
            shard = {k: v[slice(*shard_rows(v.shape[0], rank, len(rings)))] for k, v in full.items()}
            ring.publish(shard, version)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("transport", ["shm", "rdma"])
def test_the_reader_assembles_the_newest_version_every_rank_completed(transport, shared):
    rings = rank_rings(2, shared, slots=2, chunk_mb=1)
    if not shared:
        shapes = [{spec.name: spec.shape for spec in ring.layout.specs} for ring in rings]
        assert shapes == [{"w": (3, 4), "b": (2,), "one": (1,)},
                          {"w": (2, 4), "b": (1,), "one": (0,)}]  # a one-row tensor: rank 1 holds none of it
    renamed = ShardedReader([r.handle() for r in rings], LAYOUT, lambda d: {f"hf.{k}": v for k, v in d.items()},
                            transport)
    assert pull(renamed) is None

    publish(rings, 1)
    version, tensors = pull(renamed)
    assert version == 1 and sorted(tensors) == ["hf.b", "hf.one", "hf.w"]
    for name, tensor in tensors.items():
        assert torch.equal(tensor, full_weights(1)[name.removeprefix("hf.")])

    # rank 0 has published version 2, rank 1 not yet: the reader keeps to version 1 whole
    publish(rings, 2, ranks=[0])
    assert pull(renamed, newer_than=0)[0] == 1
    assert pull(renamed, newer_than=1) is None
    publish(rings, 2, ranks=[1])
    version, tensors = pull(renamed, newer_than=1)
    assert version == 2 and all(torch.equal(t, full_weights(2)[n.removeprefix("hf.")]) for n, t in tensors.items())
    assert renamed.torn_reads == renamed.corrupt_reads == 0


def pull(reader, newer_than=-1):
    """(version, copies of the tensors the reader handed over), or None."""
    got = {}
    version = asyncio.run(reader.load_latest(lambda _, weights: got.update({n: t.clone() for n, t in weights}),
                                             newer_than))
    return None if version is None else (version, got)


@pytest.mark.parametrize("ranks, shared", [(1, False), (2, False), (2, True), (3, True)])
def test_shared_memory_is_copied_and_copied_again_if_overwritten_meanwhile(ranks, shared):
    rings = rank_rings(ranks, shared, slots=2, checksums=True)
    reader = ShardedReader([r.handle() for r in rings], LAYOUT, lambda d: d, "shm")
    publish(rings, 1)
    laps = []
    for ring_reader in reader.readers:
        async def lapped(slot, begins, cancel, read_payload=ring_reader.read_payload):
            whole = await read_payload(slot, begins, cancel)
            if not laps:  # the trainer laps the rings while the first copy is in flight
                laps.append(True)
                publish(rings, 2)
                publish(rings, 3)  # into the slots being copied
            return whole
        ring_reader.read_payload = lapped
    seen = []
    load = lambda version, weights: seen.append((version, {n: t.clone() for n, t in weights}))  # noqa: E731
    assert asyncio.run(reader.load_latest(load)) == 3
    assert len(seen) == 1 and reader.torn_reads == len(reader.readers) and reader.corrupt_reads == 0
    assert all(torch.equal(t, full_weights(3)[n]) for n, t in seen[0][1].items())
    # what is handed on is the reader's own copy, never a view of the trainer's memory
    handed = []
    assert asyncio.run(reader.load_latest(lambda _, weights: handed.extend(weights))) == 3
    for ring_reader in reader.readers:
        ring = ring_reader.memory.tensor
        assert not any(ring.data_ptr() <= t.data_ptr() < ring.data_ptr() + ring.numel() for _, t in handed)


def test_a_shared_ring_is_complete_only_when_every_rank_wrote_the_version_and_checks_each_ranks_sum():
    rings = rank_rings(2, shared=True, slots=2, checksums=True)
    reader = ShardedReader([r.handle() for r in rings], LAYOUT, lambda d: d, "shm", max_attempts=3)
    assert [r.handle() is None for r in rings] == [False, True]  # rank 1 writes into rank 0's ring
    publish(rings, 1)
    publish(rings, 2)
    publish(rings, 3, ranks=[0])  # slot 1: rank 0 has written version 3, rank 1 still holds version 1
    assert pull(reader)[0] == 2
    publish(rings, 3, ranks=[1])
    assert pull(reader)[0] == 3
    _, lo, _ = next(p for p in writer_pieces(LAYOUT, 0, 2, 2)[1] if p[0] == "w")
    rings[0].payloads[1][lo] ^= 0xFF  # a byte of rank 1's rows changes behind its checksum's back
    with pytest.raises(CorruptWeightsError, match="version 3"):
        pull(reader)
    assert reader.corrupt_reads == 3


@pytest.mark.parametrize("hosts, rank, run", [(["a"], 0, (0, 1)), (["a", "a"], 1, (0, 2)),
                                              (["a", "a", "b", "b"], 2, (2, 4)), (["a", "b", "a"], 2, (2, 3))])
def test_ranks_share_a_ring_with_the_consecutive_ranks_on_their_host(hosts, rank, run):
    assert same_host_run(hosts, rank) == run


def test_host_ring_on_one_host_gives_one_ring_every_rank_writes():
    world, barrier, gathered, rings = 3, threading.Barrier(3, timeout=60), [], [None] * 3

    def gather(rank):
        def all_gather(value):  # each rank's value, as torch.distributed's all_gather_object returns them
            gathered.append((rank, value))
            barrier.wait()
            values = [v for _, v in sorted(gathered[-world:], key=lambda item: item[0])]
            barrier.wait()
            return values
        return all_gather

    errors = []

    def make(rank):
        try:
            rings[rank] = host_ring(LAYOUT, rank, world, gather(rank), slots=2, chunk_mb=1, checksums=True)
        except BaseException as e:  # the others would wait at the barrier for it forever
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=make, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert [r.handle() is not None for r in rings] == [True, False, False] and rings[0].handle().ranks == (0, 3)
    publish(rings, 1)
    version, tensors = pull(ShardedReader([r.handle() for r in rings], LAYOUT, lambda d: d, "shm"))
    assert version == 1 and all(torch.equal(t, full_weights(1)[n]) for n, t in tensors.items())
