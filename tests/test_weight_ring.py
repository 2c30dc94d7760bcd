"""The versioned weight ring, in one process: both transports, torn-read detection, checksums.

Real Monarch RDMABuffers (TCP fallback here) and real shared memory; the writer and the reader
only share a process so a test can interleave them deterministically.
"""

import asyncio

import pytest
import torch

from meshrl.weight_sync import LayoutError, WeightLayout
from meshrl.weight_sync.ring import CorruptWeightsError, RingReader, TornReadsError, WeightRing


def weights(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((3000,), value, dtype=torch.bfloat16), "b": torch.full((7, 5), -value)}


LAYOUT = WeightLayout.of_tensors(weights(0.0))


def pull(reader, newer_than=-1):
    return asyncio.run(reader.pull_latest(newer_than))


def values(pulled) -> dict[str, float]:
    version, tensors = pulled
    return {name: t.float().unique().item() for name, t in tensors}


@pytest.mark.parametrize("transport", ["shm", "rdma"])
def test_reader_gets_the_newest_complete_version(transport):
    ring = WeightRing(LAYOUT, slots=3, chunk_mb=1)
    reader = RingReader(ring.handle(), LAYOUT, transport)
    assert reader.transport == transport
    assert pull(reader) is None  # nothing published yet
    ring.publish(weights(1.0), version=1)
    ring.publish(weights(2.0), version=2)
    got = pull(reader)
    assert got[0] == 2 and values(got) == {"a": 2.0, "b": -2.0}
    assert pull(reader, newer_than=2) is None
    for v in range(3, 8):  # wraps around the three slots
        ring.publish(weights(float(v)), version=v)
    got = pull(reader, newer_than=2)
    assert got[0] == 7 and values(got) == {"a": 7.0, "b": -7.0}
    assert reader.torn_reads == 0


def test_rdma_reads_a_slot_in_concurrent_chunks():
    layout = WeightLayout.of_tensors({"w": torch.arange(3 << 19, dtype=torch.float32)})  # 6 MiB
    ring = WeightRing(layout, chunk_mb=1)
    assert len(ring.handle().chunks[0]) == 6
    ring.publish({"w": torch.arange(3 << 19, dtype=torch.float32)}, version=1)
    version, tensors = pull(RingReader(ring.handle(), layout, "rdma"))
    assert version == 1 and torch.equal(tensors[0][1], torch.arange(3 << 19, dtype=torch.float32))


def test_auto_transport_is_shared_memory_on_the_trainers_host():
    assert RingReader(WeightRing(LAYOUT).handle(), LAYOUT).transport == "shm"


@pytest.mark.parametrize("transport", ["shm", "rdma"])
def test_a_slot_overwritten_during_the_read_is_detected_and_retried(transport):
    ring = WeightRing(LAYOUT, slots=2, checksums=True)
    reader = RingReader(ring.handle(), LAYOUT, transport)
    ring.publish(weights(1.0), version=1)
    read_payload = reader.read_payload

    async def read_while_the_trainer_overwrites(slot):
        await read_payload(slot)
        if ring.publishes == 1:  # the trainer laps the ring while the first read is in flight
            ring.publish(weights(2.0), version=2)
            ring.publish(weights(3.0), version=3)  # into the slot being read

    reader.read_payload = read_while_the_trainer_overwrites
    got = pull(reader)
    assert reader.torn_reads == 1
    assert got[0] == 3 and values(got) == {"a": 3.0, "b": -3.0}


def test_reader_gives_up_when_every_read_is_torn():
    ring = WeightRing(LAYOUT, slots=2)
    reader = RingReader(ring.handle(), LAYOUT, "shm", max_attempts=3)
    ring.publish(weights(1.0), version=1)
    read_payload = reader.read_payload

    async def always_overwritten(slot):
        await read_payload(slot)
        ring.publish(weights(0.0), version=ring.publishes + 1)
        ring.publish(weights(0.0), version=ring.publishes + 1)

    reader.read_payload = always_overwritten
    with pytest.raises(TornReadsError, match="use more weight_sync.slots"):
        pull(reader)
    assert reader.torn_reads == 3


def test_checksums_refuse_a_corrupted_payload():
    ring = WeightRing(LAYOUT, checksums=True)
    ring.publish(weights(1.0), version=1)
    ring.payloads[1][100] ^= 0xFF  # corrupt the published bytes behind the header's back
    reader = RingReader(ring.handle(), LAYOUT, "shm", max_attempts=3)
    with pytest.raises(CorruptWeightsError, match="version 1"):
        pull(reader)
    assert reader.corrupt_reads == 3 and reader.torn_reads == 0


def test_bad_ring_settings_and_layouts_are_clear_errors():
    with pytest.raises(ValueError, match="at least 2 slots"):
        WeightRing(LAYOUT, slots=1)
    with pytest.raises(ValueError, match="weight_sync.transport"):
        RingReader(WeightRing(LAYOUT).handle(), LAYOUT, "carrier-pigeon")
    other = WeightLayout.of_tensors({**weights(0.0), "b": torch.zeros(5, 7)})
    with pytest.raises(LayoutError, match=r"b is torch.float32\[7, 5\], expected torch.float32\[5, 7\]"):
        RingReader(WeightRing(LAYOUT).handle(), other)
