"""The weight ring in device memory (meshrl/weight_sync/device_ring.py) on the CPU's stand-in for GPU memory (a
memfd per segment, opened by another process through its pid and fd as a CUDA IPC handle opens a GPU's): the
host ring's versions, slots and seqlock, segments cut between tensors, loads in place that a writer overtakes
done again, checksums that catch what the seqlock cannot, a reader or a writer dying mid-copy, and the rule
that places the ring per placement."""

import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from meshrl.runtime.gpu_plan import plan_gpus
from meshrl.runtime.jobs import RolePlacement
from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync.device_ring import (DeviceRing, DeviceRingReader, device_ring_for, remote_handles,
                                            ring_memory, segments, span)
from meshrl.weight_sync.ring import CorruptWeightsError, TornReadsError, word_sum
from meshrl.weight_sync.shards import shard_rows, writer_pieces

SHAPES = {"embed": ((10, 8), torch.bfloat16), "norm": ((8,), torch.float32), "wq": ((12, 8), torch.bfloat16),
          "wv": ((5, 8), torch.bfloat16), "head": ((7, 8), torch.float32)}
FULL = WeightLayout.of(SHAPES)


def weights(version: int) -> dict[str, torch.Tensor]:
    """Every element the version (exact in bf16 up to 256): a load mixing versions shows as mixed values."""
    return {name: torch.full(shape, float(version), dtype=dtype) for name, (shape, dtype) in SHAPES.items()}


def rows_of(full: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    return {name: t[slice(*shard_rows(t.shape[0], rank, world))] for name, t in full.items()}


def make_rings(world: int, slots: int = 2, checksums: bool = False) -> list[DeviceRing]:
    """`world` writers of one host's ring, made together (their constructor is collective) in threads."""
    shared, barrier, rings = [None] * world, threading.Barrier(world), [None] * world

    def gather_for(k):
        def gather(x):
            shared[k] = x
            barrier.wait()
            out = list(shared)
            barrier.wait()
            return out
        return gather

    def make(k):
        rings[k] = DeviceRing(FULL, slots, checksums, writer_pieces(FULL, 0, world, world), (0, world), world, k,
                              torch.device("cpu"), gather_for(k))

    threads = [threading.Thread(target=make, args=(k,)) for k in range(world)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return rings


def publish(rings: list[DeviceRing], version: int, writers=None) -> None:
    for k in writers if writers is not None else range(len(rings)):
        rings[k].publish(rows_of(weights(version), k, len(rings)), version)


def whole_version(tensors) -> int | None:
    found = {value for _, t in tensors for value in t.float().unique().tolist()}
    return int(found.pop()) if len(found) == 1 else None


def load_with(reader: DeviceRingReader, newer_than: int = -1, during=None):
    """Load the newest version as an engine would (copying what it is handed), `during(attempt)` run inside
    each load; returns (version, what the last load copied)."""
    copied, attempts = [], []

    async def load(version, tensors):
        attempts.append(version)
        copied[:] = [(name, t.clone()) for name, t in tensors]
        if during:
            during(len(attempts))

    version = asyncio.run(reader.load_latest(load, newer_than))
    return version, dict(copied), attempts


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_segments_are_cut_between_tensors_so_each_tensor_lies_whole_in_one(world):
    bounds = segments(FULL, world)
    assert len(bounds) == world and bounds[0][0] == 0 and bounds[-1][1] == FULL.nbytes
    assert all(a <= b == c for (a, b), (c, _) in zip(bounds, bounds[1:]))  # contiguous, in order
    for spec in FULL.specs:
        assert sum(a <= spec.offset and spec.offset + spec.nbytes <= b for a, b in bounds if a < b) == 1
    if world > len(FULL.specs):
        assert sum(a == b for a, b in bounds) >= world - len(FULL.specs)  # more writers than tensors: empty ones
    views = [torch.zeros(b - a, dtype=torch.uint8) for a, b in bounds]
    for cut in {b for _, b in bounds if 0 < b < FULL.nbytes}:
        with pytest.raises(ValueError, match="cross a segment"):
            span(bounds, views, cut - 8, cut + 8)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_reader_loads_the_newest_version_every_writer_completed(world):
    rings = make_rings(world, slots=3)
    reader = DeviceRingReader(rings[0].handle(), FULL, lambda d: d)
    assert [r.handle() is None for r in rings] == [False] + [True] * (world - 1)
    assert asyncio.run(reader.newest()) == -1 and load_with(reader)[0] is None
    publish(rings, 1)
    publish(rings, 2, writers=range(world - 1))  # the last writer has not written version 2 yet
    version, copied, _ = load_with(reader)
    assert version == 1 and all(torch.equal(copied[n], t) for n, t in weights(1).items())
    publish(rings, 2, writers=[world - 1])
    publish(rings, 3)
    version, copied, _ = load_with(reader, newer_than=1)
    assert version == 3 and all(torch.equal(copied[n], t) for n, t in weights(3).items())
    assert load_with(reader, newer_than=3)[0] is None
    assert reader.torn_reads == reader.corrupt_reads == 0


def test_each_writer_holds_its_segment_of_every_slot_and_writes_only_its_rows():
    """Two writers: segment k is writer k's own memory; each writer's rows of every tensor land in whichever
    segment holds the tensor, and nothing else of the slot changes."""
    rings = make_rings(2)
    assert rings[0].mine.tensor.numel() == 2 * (rings[0].bounds[0][1] - rings[0].bounds[0][0])
    publish(rings, 1)
    rings[0].publish(rows_of(weights(9), 0, 2), 3)  # writer 0 alone, slot 1
    reader = DeviceRingReader(rings[0].handle(), FULL, lambda d: d)
    for name, t in reader.weights(1):
        lo, hi = shard_rows(t.shape[0], 0, 2)
        assert (t[lo:hi] == 9).all() and (t[hi:] == 1).all(), name
    assert load_with(reader)[0] is None  # version 3 in slot 1 lacks writer 1's rows, and version 1 is gone


def test_a_load_the_trainer_overtakes_is_done_again_with_the_newest_version():
    """Load in place, then check: the trainer lapping the ring during the first load (versions 2 and 3, the
    second into the slot being loaded) tears it; it is counted and version 3 is loaded whole instead."""
    rings = make_rings(2)
    publish(rings, 1)
    reader = DeviceRingReader(rings[0].handle(), FULL, lambda d: d)

    def lap(attempt):
        if attempt == 1:
            publish(rings, 2)
            publish(rings, 3)  # slot 1: the one version 1 was loaded from

    version, copied, attempts = load_with(reader, during=lap)
    assert attempts == [1, 3] and version == 3 and reader.torn_reads == 1
    assert whole_version(copied.items()) == 3


def test_a_writer_beginning_on_the_slot_mid_load_tears_it_even_before_it_ends():
    rings = make_rings(1)
    publish(rings, 1)
    reader = DeviceRingReader(rings[0].handle(), FULL, lambda d: d)

    def begin_only(attempt):
        if attempt == 1:
            rings[0].rows[1, 0, 0] = 99  # begin of slot 1 moved: a publish of version 3 started

    with pytest.raises(TornReadsError):  # slot 1 stays half-written: never complete again, no other version
        load_with(reader, during=lambda a: begin_only(a) if a == 1 else None)
    assert reader.torn_reads == 1


def test_a_reader_gives_up_when_every_load_is_torn():
    rings = make_rings(1)
    publish(rings, 1)
    reader = DeviceRingReader(rings[0].handle(), FULL, lambda d: d, max_attempts=4)
    version = [1]

    def lap(_):
        publish(rings, version[0] + 1)
        publish(rings, version[0] + 2)
        version[0] += 2

    with pytest.raises(TornReadsError, match="weight_sync.slots"):
        load_with(reader, during=lap)
    assert reader.torn_reads == 4


def test_checksums_catch_a_payload_changed_behind_the_seqlock():
    """Bytes of a complete slot changed without a writer's begin (stores seen out of order, or corrupt memory):
    the seqlock passes it, each writer's checksum does not; a version whose sums match loads."""
    rings = make_rings(2, checksums=True)
    publish(rings, 1)
    reader = DeviceRingReader(rings[0].handle(), FULL, lambda d: d, max_attempts=3)
    assert load_with(reader)[0] == 1 and reader.corrupt_reads == 0
    rings[1].slot_views[1][-1][0] ^= 1  # a byte of the last segment of slot 1
    with pytest.raises(CorruptWeightsError):
        load_with(reader)
    assert reader.corrupt_reads == 3
    publish(rings, 2)
    assert load_with(reader, newer_than=1)[0] == 2


@pytest.mark.parametrize("start", [0, 1, 2, 3])
def test_cudas_checksum_sums_the_words_of_a_piece_at_any_alignment(start):
    """The checksum a CUDA ring computes on the device (run here on CPU tensors): the 32-bit words from the first
    aligned one, and the bytes around them, equal to the sum taken in Python; one byte changed changes it."""
    data = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(start))
    piece = data[start:start + 41]
    raw = bytes(piece.tolist())
    head = -piece.data_ptr() % 4
    body = (len(raw) - head) // 4 * 4
    words = sum(int.from_bytes(raw[i:i + 4], "little", signed=True) for i in range(head, head + body, 4))
    assert word_sum(piece) == words + sum(raw[:head]) + 257 * sum(raw[head + body:])
    before = word_sum(piece)
    piece[5] ^= 1
    assert word_sum(piece) != before


def test_ring_memory_auto_is_device_only_where_every_generator_opens_it_by_ipc():
    assert ring_memory("auto", True, 1, True, "auto") == "device"
    assert ring_memory("auto", False, 1, True, "auto") == "host"  # the trainer on the CPU
    assert ring_memory("auto", True, 2, True, "auto") == "host"  # the trainer's ranks on two hosts
    assert ring_memory("auto", True, 1, False, "auto") == "host"  # generators on other hosts
    assert ring_memory("auto", True, 1, True, "on") == "host"  # a relay republishes a host ring
    assert ring_memory("auto", True, 1, True, "auto", lora=True) == "host"  # an adapter: the host ring is enough
    assert ring_memory("host", True, 1, True, "auto") == "host"
    for placement in ((False, 1, True, "auto"), (True, 2, False, "on")):  # asked: the CPU's stand-in, or RDMA
        assert ring_memory("device", *placement) == "device"
    with pytest.raises(ValueError, match="weight_sync.memory 'gpu'; known: auto, host, device"):
        ring_memory("gpu", True, 1, True, "auto")


def _config(memory="auto", **job):
    from meshrl.configs.named import load_config

    config = load_config("smoke", [f"--weight_sync.memory={memory}"])
    for key, value in job.items():
        setattr(config.job, key, value)
    return config


@pytest.mark.parametrize("placement, gpus, expected", [
    ({"generator": RolePlacement("", 1, 1), "trainer": RolePlacement("", 1, 2)}, 4, "device"),
    ({"generator": RolePlacement("", 1, 1), "trainer": RolePlacement("", 1, 2)}, 0, ""),  # no GPUs: auto, as given
    ({"generator": RolePlacement("gen", 1, 1), "trainer": RolePlacement("train", 1, 2)}, 4, "host"),
    ({"generator": RolePlacement("", 2, 1), "trainer": RolePlacement("", 2, 1)}, 4, "host"),
])
def test_the_gpu_plan_places_the_ring_per_placement_and_writes_it_into_the_config(placement, gpus, expected):
    config = _config()
    config.trainer.ranks = placement["trainer"].procs_per_host * placement["trainer"].hosts
    plan = plan_gpus(config, placement, gpus)
    assert plan.weight_memory == expected and plan.apply(config).weight_sync.memory == (expected or "auto")
    assert any("CUDA IPC" in line for line in plan.describe()) == (expected == "device")


@pytest.mark.parametrize("checksums", [False, True])
def test_readers_on_other_hosts_read_a_device_ring_over_rdma_whole_and_checked(checksums):
    """A reader on another host cannot open the segments by IPC: it reads the same ring through Monarch RDMA
    buffers over each writer's segment (chunks that follow the segments) and its header, as a host ring's
    remote readers do (the same seqlock and reader): the newest version every writer completed, whole; with
    checksums, a byte changed behind the seqlock is refused."""
    from meshrl.weight_sync.shards import ShardedReader

    rings = make_rings(2, checksums=checksums)
    remote = rings[0].handle().remote
    assert remote is not None and [c.size() for c in remote.chunks[0]] == [b - a for a, b in rings[0].bounds if b > a]
    reader = ShardedReader(remote_handles([rings[0].handle(), None]), FULL, lambda d: d, "auto")
    assert reader.transport == "rdma"  # never mapped as a host ring's memory
    publish(rings, 1)
    publish(rings, 2, writers=[0])
    version, tensors = asyncio.run(reader.read_latest())
    assert version == 1 and all(torch.equal(dict(tensors)[n], t) for n, t in weights(1).items())
    publish(rings, 2, writers=[1])
    version, tensors = asyncio.run(reader.read_latest(newer_than=1))
    assert version == 2 and whole_version(tensors) == 2
    if checksums:
        rings[1].slot_views[0][-1][0] ^= 1  # slot 0 holds version 2
        with pytest.raises(CorruptWeightsError):
            asyncio.run(ShardedReader(remote_handles([rings[0].handle()]), FULL, lambda d: d, "rdma",
                                      max_attempts=2).read_latest())


def test_a_generator_opens_a_device_ring_by_ipc_on_its_host_and_over_rdma_elsewhere():
    from meshrl.weight_sync.relay import open_reader
    from meshrl.weight_sync.shards import ShardedReader

    rings = make_rings(2)
    handle = rings[0].handle()
    assert isinstance(open_reader([handle, None], FULL, lambda d: d), DeviceRingReader)
    handle.host = "another boot id/net:1/pid:1"  # as a generator on another host sees it
    reader = open_reader([handle, None], FULL, lambda d: d)
    assert isinstance(reader, ShardedReader) and reader.transport == "rdma"


def test_a_device_ring_that_rdma_cannot_register_is_one_clear_error_for_remote_readers():
    rings = make_rings(1)
    handle = rings[0].handle()
    handle.remote = None  # as where Monarch refuses to register the GPU's memory
    with pytest.raises(RuntimeError, match="cannot be read over RDMA .* use weight_sync.memory host"):
        remote_handles([handle])


# -- processes: a reader or a writer dying mid-copy

READER = """
import asyncio, pickle, sys, time
from meshrl.weight_sync.device_ring import DeviceRingReader
handle, full = pickle.load(open(sys.argv[1], "rb"))
reader = DeviceRingReader(handle, full, lambda d: d)
async def load(version, tensors):
    for name, t in tensors:
        t.clone()
        print("LOADING", version, flush=True)
        time.sleep(60)  # killed here, mid-copy
asyncio.run(reader.load_latest(load))
"""


@pytest.mark.processes
def test_a_reader_killed_mid_load_leaves_the_ring_whole_for_the_next(tmp_path):
    rings = make_rings(2)
    publish(rings, 1)
    path = tmp_path / "handle.pkl"
    path.write_bytes(pickle.dumps((rings[0].handle(), FULL)))
    reader = subprocess.Popen([sys.executable, "-c", READER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().split() == ["LOADING", "1"]
        reader.send_signal(signal.SIGKILL)
        assert reader.wait(timeout=30) == -signal.SIGKILL
    finally:
        reader.kill()
    publish(rings, 2)
    publish(rings, 3)
    version, copied, _ = load_with(DeviceRingReader(rings[0].handle(), FULL, lambda d: d))
    assert version == 3 and whole_version(copied.items()) == 3


WRITER = """
import os, pickle, signal, sys, torch
from meshrl.weight_sync.device_ring import DeviceRing
from meshrl.weight_sync.ring import BEGIN
full = pickle.load(open(sys.argv[1], "rb"))
ring = DeviceRing(full, 2, True, None, (0, 1), 1, 0, torch.device("cpu"), lambda x: [x])
values = lambda v: {s.name: torch.full(s.shape, float(v), dtype=s.dtype) for s in full.specs}
ring.publish(values(1), 1)
pickle.dump(ring.handle(), open(sys.argv[2], "wb"))
print("PUBLISHED", flush=True)
sys.stdin.readline()  # the reader has opened the ring
half = full.specs[len(full.specs) // 2]
first = ring.where(0, half.offset, 0)
ring.rows[0, 0, BEGIN] = 2  # version 2 begins in slot 0; half its bytes land, then the process dies
first.copy_(torch.full_like(first, 2))
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.processes
def test_a_writer_killed_mid_copy_leaves_its_last_whole_version_readable_and_never_the_torn_one(tmp_path):
    layout, handle_path = tmp_path / "layout.pkl", tmp_path / "handle.pkl"
    layout.write_bytes(pickle.dumps(FULL))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(layout), str(handle_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "PUBLISHED"
        reader = DeviceRingReader(pickle.loads(handle_path.read_bytes()), FULL, lambda d: d)
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.wait(timeout=30) == -signal.SIGKILL
    finally:
        writer.kill()
    assert not os.path.exists(f"/proc/{writer.pid}")  # gone; its memory lives on in the reader's mappings
    header = reader.header_now()
    assert header[0][0][0] != header[0][0][1]  # slot 0: begun, never ended
    deadline = time.monotonic() + 5
    version, copied, _ = load_with(reader)
    assert time.monotonic() < deadline
    assert version == 1 and whole_version(copied.items()) == 1 and reader.torn_reads == 0


def test_device_ring_for_gives_each_host_run_of_ranks_one_ring():
    """Two ranks on one host: one ring, rank 0 its handle's holder, both writers of it (a gather of each rank's
    host first, then of the writers' regions: as `all_gather` over the ranks would give)."""
    world, shared, barrier, rings = 2, {}, threading.Barrier(2), [None, None]

    def gather_for(k):
        def gather(x):
            shared[k] = x
            barrier.wait()
            out = [shared[i] for i in range(world)]
            barrier.wait()
            return out
        return gather

    def make(k):
        rings[k] = device_ring_for(FULL, k, world, gather_for(k), 2, False, torch.device("cpu"))

    threads = [threading.Thread(target=make, args=(k,)) for k in range(world)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert rings[0].handle().ranks == (0, 2) and rings[1].handle() is None
    publish(rings, 1)
    version, copied, _ = load_with(DeviceRingReader(rings[0].handle(), FULL, lambda d: d))
    assert version == 1 and all(torch.equal(copied[n], t) for n, t in weights(1).items())


@pytest.mark.processes
def test_a_run_on_two_ranks_loads_each_version_in_place_bit_for_bit(tmp_path):
    """The whole loop with the ring in (stand-in) device memory: the tiny Qwen3 trained on 2 ranks, each the
    writer of its segment; the generator loads every version straight from the ring, and what vLLM holds
    after each load equals the same version saved whole and loaded from its file (weight_sync.verify)."""
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "qwen3_smoke", "--run-dir",
                             str(run_dir), "--trainer.ranks", "2", "--trainer.num_threads", "1",
                             "--generator.num_threads", "1", "--weight_sync.memory", "device",
                             "--weight_sync.verify", "true", "--weight_sync.checksums", "true"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    placement = json.loads((run_dir / "placement.json").read_text())
    assert placement["generator"]["weight_transport"] == "device_standin"
    checks = [json.loads(line) for line in (run_dir / "weights" / "verified.jsonl").read_text().splitlines()]
    assert [c["version"] for c in checks] == [1, 2] and all(c["identical"] and c["tensors"] > 10 for c in checks)
    # loaded in place: nothing read apart from the load, which the step rows report
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["weight_transfer_s"] == 0 for r in rows) and any(r["weight_load_s"] > 0 for r in rows)
    assert all(r["weight_publish_s"] > 0 for r in rows[1:])
