"""Weight-ring stress: the trainer steps and publishes as fast as it can while generators keep pulling
(tests/test_weight_stress.py, and the stress phase of `meshrl bench weight-sync`).

Run with checksums on (`WeightSyncConfig(checksums=True)`): every version a generator loads is then
checked against the CRC32 the trainer wrote for it; a mismatch is refused and counted.
"""

import asyncio
import time

from actor_helpers import replay_buffer_on, staged
from monarch.actor import this_host

from meshrl.actors import first
from meshrl.train_step import each_rank
from meshrl.types import Episode


def _episodes() -> list[Episode]:
    """A fixed nonzero-advantage batch: each optimizer step then really changes the weights."""
    return [Episode(list(range(10 + i, 42 + i)), [False] * 8 + [True] * 24, [-1.0] * 32, 1.0 - 2 * i, 0, 0)
            for i in range(2)]


async def stress_ring(trainer, generators: list, seconds: float, ranks: int = 1) -> dict:
    """Versions published, the versions each generator loaded, torn reads retried, and torn reads the
    seqlock missed (caught by the checksum, so never loaded; what a reader without checksums would load).
    Every rank trains the same micro-batch each step, taken from a replay buffer as in a run."""
    buffer_procs = this_host().spawn_procs(per_host={"procs": 1}, name="stress_buffer")
    try:
        _, updates = await staged(replay_buffer_on(buffer_procs), _episodes(), trainer)
        return await _stress(trainer, generators, seconds, [updates[0][0]] * ranks)
    finally:
        await buffer_procs.stop()


async def _stress(trainer, generators: list, seconds: float, refs: list) -> dict:
    end = time.monotonic() + seconds
    published = 0

    async def train_and_publish():
        nonlocal published
        while time.monotonic() < end:
            await each_rank(trainer, "forward_backward", [[ref] for ref in refs])
            await trainer.optim_step.call()
            published = await first(trainer.publish_weights.call())

    async def pull(generator) -> list[int]:
        loaded = []
        while time.monotonic() < end:
            version = await generator.pull_weights.call_one()
            if loaded and version == loaded[-1]:
                await asyncio.sleep(0.01)  # nothing newer yet
            else:
                loaded.append(version)
        return loaded

    _, *loads = await asyncio.gather(train_and_publish(), *(pull(g) for g in generators))
    stats = [await g.weight_sync_stats.call_one() for g in generators]
    return {"versions_published": published, "versions_loaded": loads,
            "torn_reads_detected": sum(s["torn_reads"] for s in stats),
            "torn_reads_loaded": sum(s["corrupt_reads"] for s in stats)}
