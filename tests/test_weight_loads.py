"""Loads that cannot livelock nor outlive their timeout, on a real weight ring in shared memory (a
publisher thread in this process, a reader mapping the ring as a generator on the trainer's host does):
a loader far slower than the trainer's publishes still completes every load, with whole versions; a
shared-memory read runs off the event loop; and a read that times out never reaches the loader and
stops copying."""

import asyncio
import threading
import time

import pytest
import torch

from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync import ring as ring_module
from meshrl.weight_sync.ring import WeightRing
from meshrl.weight_sync.shards import ShardedReader


def weights(version: int) -> dict[str, torch.Tensor]:
    """5 MiB in two tensors, every element the version (exact in float32): a torn read shows as mixed values."""
    return {"w": torch.full((256, 1024), float(version)), "v": torch.full((1024, 1024), float(version))}


LAYOUT = WeightLayout.of_tensors(weights(0))


def whole_version(tensors) -> int | None:
    """The version every element of every tensor holds, or None if they differ (torn)."""
    found = {value for _, t in tensors for value in t.float().unique().tolist()}
    return int(found.pop()) if len(found) == 1 else None


class Publisher(threading.Thread):
    """Publishes versions 1, 2, ... flat out, each a fresh set of tensors as a trainer's step gives."""

    def __init__(self, ring: WeightRing):
        super().__init__(daemon=True)
        self.ring, self.version, self.stop = ring, 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.ring.publish(weights(self.version + 1), self.version + 1)
            self.version += 1


@pytest.mark.parametrize("checksums", [False, True])
def test_a_slow_loader_completes_every_load_while_a_publisher_laps_the_ring(checksums):
    """A load straight out of the ring (as before) was torn whenever the trainer lapped the ring while it
    loaded, and retried until it gave up; a load of the reader's own copy is never torn, and only the copy
    (a memcpy) races the trainer."""
    ring = WeightRing(LAYOUT, slots=2, checksums=checksums)
    reader = ShardedReader([ring.handle()], LAYOUT, lambda d: d, "shm")
    publisher = Publisher(ring)
    loaded, lapped = [], []

    def slow_load(version, tensors):
        published = publisher.version
        time.sleep(0.05)  # vLLM loading a large model
        assert whole_version(tensors) == version  # checked after the wait: no writer touched it meanwhile
        loaded.append(version)
        lapped.append(publisher.version - published)

    async def loads():
        while len(loaded) < 10:
            if await reader.load_latest(slow_load, newer_than=loaded[-1] if loaded else -1) is None:
                await asyncio.sleep(0.001)  # nothing newer yet: the publisher's thread did not get a core

    publisher.start()
    try:
        while publisher.version < 2:
            time.sleep(0.001)
        asyncio.run(loads())
    finally:
        publisher.stop.set()
        publisher.join()
    assert len(loaded) == 10 and loaded == sorted(set(loaded))
    print(f"versions published during each load: {lapped}; copies overtaken: {reader.torn_reads}")
    assert sum(n >= 2 for n in lapped) >= 8, lapped  # the trainer rewrote the slot being loaded during the loads
    assert reader.corrupt_reads == 0


def slow_chunks(monkeypatch, seconds: float) -> list[float]:
    """Copies of 4 KiB chunks, each followed by `seconds` of waiting (at its fence); returns when each ended."""
    ended = []

    def slow_fence():
        if threading.current_thread() is not threading.main_thread():  # the copy's thread
            time.sleep(seconds)
            ended.append(time.monotonic())

    monkeypatch.setattr(ring_module, "_COPY_CHUNK", 4096)
    monkeypatch.setattr(ring_module, "fence", slow_fence)
    return ended


def test_a_shared_memory_read_runs_off_the_event_loop(monkeypatch):
    ring = WeightRing(LAYOUT, slots=2)
    ring.publish(weights(1), 1)
    reader = ShardedReader([ring.handle()], LAYOUT, lambda d: d, "shm")
    chunks = slow_chunks(monkeypatch, 0.0002)

    async def read_while_ticking():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        ticker = asyncio.create_task(tick())
        start = time.monotonic()
        version, tensors = await reader.read_latest()
        seconds = time.monotonic() - start
        ticker.cancel()
        return version, whole_version(tensors), ticks, seconds

    version, whole, ticks, seconds = asyncio.run(read_while_ticking())
    assert (version, whole) == (1, 1) and len(chunks) == -(-LAYOUT.nbytes // 4096) + 1  # a fence on entry too
    assert ticks >= seconds / 0.005 / 3, (ticks, seconds)  # the event loop ran all along


def test_a_read_that_times_out_never_reaches_the_loader_and_stops_copying(monkeypatch):
    ring = WeightRing(LAYOUT, slots=2, checksums=True)
    ring.publish(weights(1), 1)
    reader = ShardedReader([ring.handle()], LAYOUT, lambda d: d, "shm")
    chunks = slow_chunks(monkeypatch, 0.01)  # 1280 chunks: 13 s to copy the version
    loaded = []

    async def load_within(seconds):
        return await asyncio.wait_for(reader.load_latest(lambda v, t: loaded.append(v)), seconds)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(load_within(0.2))
    timed_out = time.monotonic()
    assert reader.readers[0].copying.acquire(timeout=1.0)  # the abandoned copy ended at its next chunk
    reader.readers[0].copying.release()
    assert loaded == [] and 5 <= len(chunks) < 100 and chunks[-1] - timed_out < 0.1

    monkeypatch.setattr(ring_module, "fence", lambda: None)  # the reader reads again, whole, at full speed
    assert asyncio.run(load_within(10.0)) == 1 and loaded == [1]
