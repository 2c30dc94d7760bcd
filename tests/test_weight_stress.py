"""The weight ring under load: real trainer and two real vLLM generators, checksums on; one of them loads
slowly, as a large model does, so the trainer laps the ring while it loads, and it keeps up anyway; the
other's first copies out of the ring are slowed until the trainer rewrites their slot under them, so
torn reads happen, and each one is caught (by the seqlock, never loaded).

`make test` runs it for a few seconds; `pytest tests/test_weight_stress.py --stress-seconds 30`
runs the full 30-second version.
"""

import asyncio
import time

import pytest
from monarch.actor import ActorError, endpoint

from meshrl.actors import in_rank_order, spawn, spawn_ranks
from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.generator_config import GeneratorConfig
from meshrl.actors.roles import ReplicaBroken
from meshrl.actors.trainer import TitanTrainer
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.models.model import ChatTokenizer
from meshrl.types import Prompt, Sampling
from meshrl.weight_sync import WeightSyncConfig
from meshrl.weight_sync.ring import complete_versions
from support.weight_stress import stress_ring

pytestmark = pytest.mark.processes

SLOW_LOAD_MAX_S = 5.0  # at most, for the trainer to complete two more versions during a slow load


TEARS = 2  # copies held past two publishes: fewer than ShardedReader's max_attempts in a row
TEAR_WAIT_S = 60.0  # at most, for the trainer to complete two more versions while a copy is held


class TearingGenerator(VLLMGenerator):
    """Its first TEARS copies out of the ring (a thread each) wait, before they copy, until the trainer has
    completed two more versions: in a 2-slot ring the slot being read has been rewritten by then, however
    fast this machine publishes (a fixed pause of 1.5 s saw no tear when the first publishes took longer),
    which the reader must see and count as a torn read."""

    def __init__(self, *args):
        super().__init__(*args)
        from meshrl.weight_sync import ring

        copy, slowed = ring.RingReader._copy, []

        def slow_copy(reader, slot, begins, cancel):
            if len(slowed) < TEARS:
                slowed.append(slot)
                newest = lambda: max(complete_versions(reader.header_now()), default=-1)  # noqa: E731
                held, until = newest(), time.monotonic() + TEAR_WAIT_S
                while newest() < held + 2 and time.monotonic() < until:
                    time.sleep(0.01)
            return copy(reader, slot, begins, cancel)

        ring.RingReader._copy = slow_copy  # this actor's process only


class SlowLoadGenerator(VLLMGenerator):
    """vLLM's load of each version lasts until the trainer has completed two more versions (at most
    SLOW_LOAD_MAX_S; on the event loop as the real load runs): slower than two publishes however fast this
    machine publishes (a fixed 0.8 s was not, with a CPU-bound process beside the suite: 13 versions in 12 s)."""

    def reload(self, weights) -> None:
        before, until = self._newest_in_ring(), time.monotonic() + SLOW_LOAD_MAX_S
        while self._newest_in_ring() < before + 2 and time.monotonic() < until:
            time.sleep(0.01)
        super().reload(weights)
        self.overtaken = [*getattr(self, "overtaken", []), self._newest_in_ring() - before]

    def _newest_in_ring(self) -> int:
        [reader] = self.ring.readers  # one host, one ring: its ranks share it
        return max(complete_versions(reader.header_now()), default=-1)

    @endpoint
    async def overtaken_by(self) -> list[int]:
        """Per load: the versions the trainer completed while vLLM loaded (2 or more: the ring's slot holding
        the version loaded was rewritten meanwhile, which tore a load straight out of the ring)."""
        return getattr(self, "overtaken", [])


@pytest.mark.parametrize("ranks", [2])
def test_generators_load_only_whole_versions_while_the_trainer_publishes_flat_out(tiny_checkpoint, stress_seconds,
                                                                                   ranks):
    """With 2 ranks each rank publishes its shard into its own ring, and a generator loads a version
    only when it has read every rank's shard of it, untorn: a mix of versions fails the checksums. (One
    rank, one ring: the same reader over a list of one, which every 1-rank run uses; `-k` with a
    parametrization of [1] runs it here too.)"""
    async def run():
        sync = WeightSyncConfig(checksums=True)  # every load is checked against the trainer's CRC32
        procs, generators = [], []
        for i, cls in enumerate([TearingGenerator, SlowLoadGenerator]):
            p, g = spawn(f"generator{i}", cls, GeneratorConfig(weight_update="drain", num_threads=1), sync,
                         str(tiny_checkpoint))
            procs.append(p)
            generators.append(g)
        # fp32: bf16 matmuls are ~8x slower on CPUs without bf16 instructions, and the ring wants many versions
        config = TrainerConfig(lr=1e-3, num_threads=1, ranks=ranks, bf16_autocast=False)
        p, trainer = await spawn_ranks("trainer", TitanTrainer, ranks, config, sync, str(tiny_checkpoint))
        procs.append(p)
        try:
            rings = await in_rank_order(trainer.weight_ring.call())
            assert len(rings) == ranks
            for g in generators:
                assert await g.attach_weights.call_one(rings) == "shm"
            seconds = stress_seconds * ranks  # a 2-rank step costs ~2x here (gloo, 4 processes on 2 cores)
            stats = await stress_ring(trainer, generators, seconds, ranks)
            print(f"stress {seconds:.0f} s, {ranks} ranks: {stats['versions_published']} versions published, "
                  f"{[len(v) for v in stats['versions_loaded']]} loaded, {stats['torn_reads_detected']} torn reads")

            # the slowed copies were torn, each seen by the seqlock; none slipped past it to the checksum
            assert stats["torn_reads_detected"] >= TEARS and stats["torn_reads_loaded"] == 0
            published = stats["versions_published"]
            assert published >= 5
            for loaded in stats["versions_loaded"]:
                assert len(loaded) >= 3 and loaded == sorted(set(loaded))  # only ever newer versions
            # the slow loader kept up: the trainer lapped the ring during its loads, and every load completed
            overtaken = await generators[1].overtaken_by.call_one()
            print(f"versions the trainer completed during each slow load: {overtaken}")
            assert max(overtaken) >= 2
            # after the storm each generator serves the trainer's final version
            prompt = Prompt(0, ChatTokenizer(tiny_checkpoint).encode_chat("What is 2 + 2?"))
            for g in generators:
                assert await g.pull_weights.call_one() == published
                [completion] = (await g.generate.call_one([prompt], sampling=Sampling(temperature=1.0,
                                                                                       max_tokens=8))).completions
                assert completion.policy_version == published
            # a call for a version the rings do not hold fails as a replica fault (the pool replaces the replica)
            with pytest.raises(ActorError) as failed:
                await generators[0].generate.call_one([prompt], min_version=published + 1)
            assert isinstance(failed.value.exception, ReplicaBroken), failed.value
            assert f"version {published + 1} or newer" in str(failed.value.exception)
        finally:
            for p in procs:
                await p.stop()

    asyncio.run(run())
