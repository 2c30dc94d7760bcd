"""The replica pool on real Monarch actors: least-loaded routing, a failing replica replaced and its
work redone elsewhere, and one clear error once the restarts are used up."""

import asyncio

import monarch.actor
import pytest
from monarch.actor import Actor, endpoint

from meshrl.replicas import ReplicaPool, RoleFailed


class Echo(Actor):
    """A stand-in role: answers with its own replica name, and fails when asked to."""

    def __init__(self, name: str):
        self.name = name

    @endpoint
    async def echo(self, value: int, fail: bool = False, delay: float = 0.0) -> tuple[str, int]:
        await asyncio.sleep(delay)
        if fail:
            raise RuntimeError(f"{self.name} was told to fail")
        return self.name, value


@pytest.fixture(autouse=True)
def keep_the_client_alive():
    monarch.actor.unhandled_fault_hook = lambda failure: None


def test_calls_spread_over_replicas_and_a_failed_one_is_replaced():
    async def run():
        spawned = []

        def args(i):
            spawned.append(i)
            return (f"echo{i}#{spawned.count(i)}",)

        pool = ReplicaPool("echo", Echo, args, count=2, max_restarts=1)
        await pool.start()
        try:
            assert set(pool.pids()) == {"echo0", "echo1"} and len(set(pool.pids().values())) == 2
            # four concurrent calls: the least-loaded routing gives each replica two
            answers = await asyncio.gather(*(pool.call(lambda r, v=v: r.actor.echo.call_one(v, delay=0.3))
                                             for v in range(4)))
            assert [v for _, v in answers] == [0, 1, 2, 3]
            assert sorted(name for name, _ in answers) == ["echo0#1", "echo0#1", "echo1#1", "echo1#1"]

            # the first try fails on its replica; the call is redone on the other one
            tries = []

            async def flaky(replica):
                tries.append(replica.index)
                return await replica.actor.echo.call_one(7, fail=len(tries) == 1)

            name, value = await pool.call(flaky)
            assert value == 7 and tries[1] != tries[0] and name == f"echo{tries[1]}#1"
            assert pool.restarts == 1 and pool.requeued == 1
            await asyncio.wait_for(asyncio.gather(*pool.respawning), 60)
            assert sorted(spawned) == sorted([0, 1, tries[0]])  # the failed index came back on a fresh mesh
            assert all(r.healthy for r in pool.replicas)
            fresh = pool.replicas[tries[0]]
            assert (await fresh.actor.echo.call_one(1))[0] == f"echo{tries[0]}#2"

            # with the restarts used up, the next failure is one clear error
            with pytest.raises(RoleFailed, match=r"echo \d \(pid \d+\) failed after 1 replacements "
                                                 r"\(max_restarts 1\): .*was told to fail"):
                await pool.call(lambda r: r.actor.echo.call_one(0, fail=True))
        finally:
            await pool.stop()

    asyncio.run(run())
