"""The versioned weight ring, in one process: both transports, torn-read detection, checksums, and the
seqlock's memory ordering (fences where they belong; checksums where no fence can be issued; a write
seen out of order detected and never handed on).

Real Monarch RDMABuffers (TCP fallback here) and real shared memory; the writer and the reader
only share a process so a test can interleave them deterministically.
"""

import asyncio

import pytest
import torch

from meshrl.weight_sync import LayoutError, WeightLayout, ordering
from meshrl.weight_sync import ring as ring_module
from meshrl.weight_sync.ring import (BEGIN, CHECKSUM, END, VERSION, CorruptWeightsError, RingReader, TornReadsError,
                                     WeightRing, checksum, pull_together)


def weights(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((3000,), value, dtype=torch.bfloat16), "b": torch.full((7, 5), -value)}


LAYOUT = WeightLayout.of_tensors(weights(0.0))


def pull(reader, newer_than=-1, attempts=50):
    """What a run's reader does (ShardedReader.read_latest), with one ring: (version, its weights) or None."""
    latest = asyncio.run(pull_together([reader], newer_than, attempts))
    return None if latest is None else (latest[0], latest[1][0])


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

    async def read_while_the_trainer_overwrites(slot, begins, cancel):
        whole = await read_payload(slot, begins, cancel)
        if ring.publishes == 1:  # the trainer laps the ring while the first read is in flight
            ring.publish(weights(2.0), version=2)
            ring.publish(weights(3.0), version=3)  # into the slot being read
        return whole

    reader.read_payload = read_while_the_trainer_overwrites
    got = pull(reader)
    assert reader.torn_reads == 1
    assert got[0] == 3 and values(got) == {"a": 3.0, "b": -3.0}


def test_reader_gives_up_when_every_read_is_torn():
    ring = WeightRing(LAYOUT, slots=2)
    reader = RingReader(ring.handle(), LAYOUT, "shm")
    ring.publish(weights(1.0), version=1)
    read_payload = reader.read_payload

    async def always_overwritten(slot, begins, cancel):
        whole = await read_payload(slot, begins, cancel)
        ring.publish(weights(0.0), version=ring.publishes + 1)
        ring.publish(weights(0.0), version=ring.publishes + 1)
        return whole

    reader.read_payload = always_overwritten
    with pytest.raises(TornReadsError, match="use more weight_sync.slots"):
        pull(reader, attempts=3)
    assert reader.torn_reads == 3


def test_checksums_refuse_a_corrupted_payload():
    ring = WeightRing(LAYOUT, checksums=True)
    ring.publish(weights(1.0), version=1)
    ring.payloads[1][100] ^= 0xFF  # corrupt the published bytes behind the header's back
    reader = RingReader(ring.handle(), LAYOUT, "shm")
    with pytest.raises(CorruptWeightsError, match="version 1"):
        pull(reader, attempts=3)
    assert reader.corrupt_reads == 3 and reader.torn_reads == 0


def test_bad_ring_settings_and_layouts_are_clear_errors():
    with pytest.raises(ValueError, match="at least 2 slots"):
        WeightRing(LAYOUT, slots=1)
    with pytest.raises(ValueError, match="weight_sync.transport"):
        RingReader(WeightRing(LAYOUT).handle(), LAYOUT, "carrier-pigeon")
    other = WeightLayout.of_tensors({**weights(0.0), "b": torch.zeros(5, 7)})
    with pytest.raises(LayoutError, match=r"b is torch.float32\[7, 5\], expected torch.float32\[5, 7\]"):
        RingReader(WeightRing(LAYOUT).handle(), other)


def test_fences_separate_begin_payload_and_end_in_the_writer_and_header_payload_header_in_the_reader(monkeypatch):
    """What each fence separates, seen at the fence: the writer's begin before the payload, the payload,
    version and checksum before the end; the reader's header loads before its copy, the copy before the
    header is read again."""
    ring = WeightRing(LAYOUT, slots=2, checksums=True)
    ring.publish(weights(1.0), version=1)
    seen = []

    def at_fence():
        row = ring.header[0, 0].tolist()
        a = LAYOUT.unpack(ring.payloads[0])[0][1]
        seen.append((row[BEGIN], row[END], row[VERSION], row[CHECKSUM] != 0, a.float().unique().tolist()))

    monkeypatch.setattr(ring_module, "fence", at_fence)
    ring.publish(weights(2.0), version=2)  # the writer's k is 2, into slot 0
    assert seen == [(2, 0, 0, False, [0.0]),  # begin is out, nothing of the payload yet
                    (2, 0, 2, True, [2.0])]  # the payload, version and checksum are out, end not yet

    reader = RingReader(ring.handle(), LAYOUT, "shm")
    order = []
    monkeypatch.setattr(ring_module, "fence", lambda: order.append("fence"))
    read_header, copy = reader.read_header, reader._copy

    async def header():
        order.append("header")
        return await read_header()

    def copied(*args):
        order.append("copy")
        return copy(*args)

    reader.read_header, reader._copy = header, copied
    assert pull(reader)[0] == 2
    # one chunk: the header (fenced), the copy (fenced on entry and after its chunk), the header again (fenced)
    assert order == ["header", "fence", "copy", "fence", "fence", "header", "fence"]


def test_the_fence_is_a_real_one_where_libatomic_is_found():
    if not ordering.has_fence():
        pytest.skip("no libatomic here: the ring relies on x86 ordering or on checksums")
    assert ordering.ordering() == "fences"
    ordering.fence()  # atomic_thread_fence(memory_order_seq_cst): lock or (x86-64) / dmb ish (aarch64)


def test_checksums_are_on_wherever_the_seqlock_cannot_be_ordered(monkeypatch):
    monkeypatch.setattr(ordering, "_FENCE", None)
    monkeypatch.setattr(ordering.platform, "machine", lambda: "aarch64")
    assert ordering.ordering() == "checksums"
    forced = WeightRing(LAYOUT, checksums=False)
    assert forced.checksums and forced.handle().checksums
    unchecked = WeightRing(LAYOUT, checksums=False)
    unchecked.handle().checksums = False  # as if written where the order is enforced, read where it is not
    with pytest.raises(RuntimeError, match="weight_sync.checksums=true"):
        RingReader(unchecked.handle(), LAYOUT, "shm")
    monkeypatch.setattr(ordering.platform, "machine", lambda: "x86_64")
    assert ordering.ordering() == "tso" and not WeightRing(LAYOUT).checksums


def publish_out_of_order(ring: WeightRing, values: dict, version: int, landed: float) -> callable:
    """What a reader on a CPU that does not order stores can see in the middle of a publish: the slot's end
    marker, version and checksum already visible, only the first `landed` share of its payload. Returns
    what lands the rest."""
    slot, new = version % ring.slots, torch.empty(LAYOUT.nbytes, dtype=torch.uint8)
    LAYOUT.pack(values, new)
    ring.publishes += 1
    row = ring.header[slot, 0]
    row[BEGIN], row[VERSION], row[CHECKSUM], row[END] = ring.publishes, version, checksum(new), ring.publishes
    cut = int(new.numel() * landed)
    ring.payloads[slot][:cut].copy_(new[:cut])
    return lambda: ring.payloads[slot][cut:].copy_(new[cut:])


@pytest.mark.parametrize("transport", ["shm", "rdma"])
def test_a_torn_write_is_detected_and_never_handed_on_when_checked(transport):
    ring = WeightRing(LAYOUT, slots=2, checksums=True)
    ring.publish(weights(1.0), version=1)
    ring.publish(weights(2.0), version=2)
    land = publish_out_of_order(ring, weights(3.0), version=3, landed=0.5)  # into slot 1, over version 1
    reader = RingReader(ring.handle(), LAYOUT, transport)
    handed = []

    def load(got):
        handed.append(values(got))
        return got

    # its stores never land: refused every time, reported, nothing handed on
    with pytest.raises(CorruptWeightsError, match="version 3"):
        load(pull(reader, attempts=3))
    assert handed == [] and reader.corrupt_reads == 3 and reader.torn_reads == 0

    # they land while the reader looks again: version 3, whole
    read_payload = reader.read_payload

    async def landing_meanwhile(slot, begins, cancel):
        if reader.corrupt_reads == 4:  # refused once more, then the rest of the payload lands
            land()
        return await read_payload(slot, begins, cancel)

    reader.read_payload = landing_meanwhile
    load(pull(reader, attempts=3))
    assert handed == [{"a": 3.0, "b": -3.0}] and reader.corrupt_reads == 4


def test_without_checks_the_same_torn_write_would_be_handed_on():
    """Why checksums are on where the order is not enforced: the seqlock alone passes this slot."""
    ring = WeightRing(LAYOUT, slots=2, checksums=False)
    ring.publish(weights(1.0), version=1)
    ring.publish(weights(2.0), version=2)
    publish_out_of_order(ring, weights(3.0), version=3, landed=0.5)
    version, tensors = pull(RingReader(ring.handle(), LAYOUT, "shm"))
    a = dict(tensors)["a"].float()
    assert version == 3 and set(a.unique().tolist()) == {1.0, 3.0}  # half of version 3, half of version 1
