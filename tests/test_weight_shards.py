"""One weight ring per trainer rank, in one process: which rows each rank holds (FSDP2's Shard(0)),
and a reader that assembles full tensors only from shards of one version, never a mix."""

import asyncio

import pytest
import torch

from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync.ring import WeightRing
from meshrl.weight_sync.shards import ShardedReader, shard_layout, shard_rows


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


def publish(rings, version: int, ranks=None) -> None:
    """Each rank (or only `ranks`) publishes its rows of `version`."""
    full = full_weights(version)
    for rank, ring in enumerate(rings):
        if ranks is None or rank in ranks:
            shard = {k: v[slice(*shard_rows(v.shape[0], rank, len(rings)))] for k, v in full.items()}
            ring.publish(shard, version)


@pytest.mark.parametrize("transport", ["shm", "rdma"])
def test_the_reader_assembles_the_newest_version_every_rank_completed(transport):
    rings = [WeightRing(shard_layout(LAYOUT, rank, 2), slots=2, chunk_mb=1) for rank in range(2)]
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


@pytest.mark.parametrize("ranks", [1, 2])
def test_shared_memory_is_loaded_in_place_and_loaded_again_if_overwritten_meanwhile(ranks):
    rings = [WeightRing(shard_layout(LAYOUT, rank, ranks), slots=2, checksums=True) for rank in range(ranks)]
    reader = ShardedReader([r.handle() for r in rings], LAYOUT, lambda d: d, "shm")
    publish(rings, 1)
    seen = []

    def load(version, weights):  # the trainer laps the ring while the first load reads it
        seen.append({n: t.clone() for n, t in weights})
        if len(seen) == 1:
            publish(rings, 2)
            publish(rings, 3)  # into the slot being read

    assert asyncio.run(reader.load_latest(load)) == 3
    assert len(seen) == 2 and reader.torn_reads == ranks and reader.corrupt_reads == 0
    assert all(torch.equal(t, full_weights(3)[n]) for n, t in seen[-1].items())
    if ranks == 1:  # nothing copied before the load: it read the ring's own memory (as this reader maps it)
        asyncio.run(reader.load_latest(lambda _, weights: seen.append(weights)))
        ring = reader.readers[0].memory.tensor
        assert all(ring.data_ptr() <= t.data_ptr() < ring.data_ptr() + ring.numel() for _, t in seen[-1])
