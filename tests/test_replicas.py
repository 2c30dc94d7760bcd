"""The replica pool on real Monarch actors: least-loaded routing, and failures by kind: an endpoint's
own error fails the call and leaves the replica serving; a process that dies, or a replica that says
it is broken, is replaced and its work redone elsewhere; one clear error once the restarts are used up;
a replica's start is bounded by its own timeout."""

import asyncio
import os
import time

import monarch.actor
import pytest
from monarch.actor import Actor, endpoint

from meshrl.actors.replicas import CallFailed, Replica, ReplicaPool, RestartBudget, RoleFailed, monarch_replicas
from meshrl.actors.roles import ReplicaBroken
from meshrl.actors.timeouts import CallTimeout, Timeouts
from meshrl.configs.named import load_config


class Echo(Actor):
    """A stand-in role: answers with its own replica name; fails as it is told to."""

    def __init__(self, name: str):
        self.name = name

    @endpoint
    async def echo(self, value: int, fail: str = "", delay: float = 0.0) -> tuple[str, int]:
        await asyncio.sleep(delay)
        if fail == "raise":
            raise ValueError(f"{self.name} cannot echo {value}")
        if fail == "broken":
            raise ReplicaBroken(f"{self.name}'s engine failed")
        if fail == "die":
            os._exit(1)
        if fail == "config":  # what any process of this configuration reports
            raise ReplicaBroken("vLLM's engine failed: RuntimeError('Unsupported CPU attention configuration')")
        return self.name, value


class SlowStart(Actor):
    """A stand-in generator whose start (vLLM loading a model) takes `seconds`."""

    def __init__(self, seconds: float):
        time.sleep(seconds)

    @endpoint
    async def ping(self) -> str:
        return "ready"


@pytest.fixture(autouse=True)
def keep_the_client_alive():
    monarch.actor.unhandled_fault_hook = lambda failure: None


@pytest.mark.processes
def test_calls_spread_over_replicas_and_failures_are_handled_by_kind():
    async def run():
        spawned = []

        def args(i):
            spawned.append(i)
            return (f"echo{i}#{spawned.count(i)}",)

        pool = ReplicaPool("echo", None, count=2, max_restarts=2)
        pool.start_replica = monarch_replicas(pool.name, Echo, args)
        await pool.start()
        try:
            assert set(pool.pids()) == {"echo0", "echo1"} and len(set(pool.pids().values())) == 2
            # four concurrent calls: the least-loaded routing gives each replica two
            answers = await asyncio.gather(*(pool.call(lambda r, v=v: r.actor.echo.call_one(v, delay=0.3))
                                             for v in range(4)))
            assert [v for _, v in answers] == [0, 1, 2, 3]
            assert sorted(name for name, _ in answers) == ["echo0#1", "echo0#1", "echo1#1", "echo1#1"]

            # the call's own error: it fails, the replica serves on
            with pytest.raises(CallFailed, match="ValueError: echo.#1 cannot echo 5"):
                await pool.call(lambda r: r.actor.echo.call_one(5, fail="raise"))
            assert pool.restarts == 0 and pool.retried == 0 and sorted(spawned) == [0, 1]

            # the process dies on the first try, the replica is broken on the second: each time the
            # call is redone on the other replica, and the failed one comes back on a fresh mesh
            for how in ("die", "broken"):
                tries = []

                async def flaky(replica):
                    tries.append(replica.index)
                    return await replica.actor.echo.call_one(7, fail=how if len(tries) == 1 else "")

                name, value = await pool.call(flaky)
                assert value == 7 and tries[1] != tries[0] and name.startswith(f"echo{tries[1]}#")
                await asyncio.wait_for(asyncio.gather(*pool.respawning), 60)
                assert spawned.count(tries[0]) >= 2 and all(r.healthy for r in pool.replicas)
            assert pool.restarts == 2 and pool.retried == 2

            # failing again and again right after their starts, the replicas are in a crash loop: one clear
            # error once a slot has failed more than max_restarts times in a row (each slot has 1 or 2 so far)
            with pytest.raises(RoleFailed, match=r"echo \d \(pid \d+\) failed 3 times in a row, each within 300 s "
                                                 r"of its start \(max_restarts 2, .*\): .*engine failed"):
                for _ in range(4):
                    await pool.call(lambda r: r.actor.echo.call_one(0, fail="broken"))
                    await asyncio.wait_for(asyncio.gather(*pool.respawning), 60)
            assert pool.restarts <= 4
        finally:
            await pool.stop()

    asyncio.run(run())


@pytest.mark.processes
def test_a_replacement_failing_its_first_call_as_its_predecessor_did_is_a_configuration_fault():
    """A fresh process that fails the same way on its first call is the configuration, not a death: the
    pool stops after one replacement per replica, with one line, instead of using up max_restarts."""
    async def run():
        spawned = []
        pool = ReplicaPool("echo", None, count=1, max_restarts=5)
        pool.start_replica = monarch_replicas(pool.name, Echo, lambda i: (spawned.append(i) or f"echo{i}",))
        await pool.start()
        try:
            with pytest.raises(RoleFailed, match=r"echo 0 \(pid \d+\), a fresh replacement, failed its first call with "
                                                 r"the error its predecessor reported.*Unsupported CPU attention"):
                await pool.call(lambda r: r.actor.echo.call_one(0, fail="config"))
            assert spawned == [0, 0] and pool.restarts == 1
        finally:
            await pool.stop()

    asyncio.run(run())


def test_the_restart_budget_counts_failures_soon_after_a_start_and_forgets_a_slot_that_served_a_while():
    now = [0.0]
    budget = RestartBudget(max_restarts=2, window_s=60, clock=lambda: now[0])
    budget.start("a"), budget.start("b")
    now[0] = 10
    assert budget.failed("a")  # 10 s after its start: 1 in a row
    budget.start("a")
    now[0] = 20
    assert budget.failed("a")  # 2 in a row
    budget.start("a")
    assert budget.failed("b")  # another slot has its own streak
    now[0] = 30
    assert not budget.failed("a")  # a third failure within 60 s of its start: a crash loop
    budget.start("a")
    now[0] = 100  # 70 s of service: the next failure starts afresh, and so do the ones after it
    assert budget.failed("a") and budget.streak["a"] == 1


def test_sticky_routing_keeps_a_group_on_its_replica_until_load_or_a_replacement_moves_it():
    """The pool's rule for a group's later turns (no actors: replicas that are only bookkeeping)."""
    async def run():
        async def start(index: int) -> Replica:
            return Replica(index, procs=None, actor=None, host="fake", pid=1000 + index)

        async def where(replica: Replica) -> Replica:
            return replica

        pool = ReplicaPool("generator", start, count=3, max_restarts=3, sticky_slack=1)
        await pool.start()
        r0, r1, _ = pool.replicas
        assert await pool.call(where) is r0  # no preference: the least loaded (all idle: the first)
        assert await pool.call(where, prefer=r1) is r1  # kept, though others are as idle
        r1.load = 1
        assert await pool.call(where, prefer=r1) is r1  # one call busier than the least loaded: within the slack
        r1.load = 2
        moved = await pool.call(where, prefer=r1)  # two busier: the group moves to the least loaded
        assert moved is not r1 and moved.load == 0
        r1.load = 0
        r1.healthy = False  # failed, its replacement not serving yet
        assert await pool.call(where, prefer=r1) is not r1
        pool.replicas[1] = replacement = await start(1)  # a replacement is another replica: the group moves on
        assert await pool.call(where, prefer=r1) is not r1 and replacement is not r1
        assert (pool.kept, pool.moved) == (2, 3)

        plain = ReplicaPool("generator", start, count=2, max_restarts=3)  # least_loaded routing
        await plain.start()
        assert await plain.call(where, prefer=plain.replicas[1]) is plain.replicas[0]
        assert (plain.kept, plain.moved) == (0, 0)

    asyncio.run(run())


@pytest.mark.processes
def test_a_replicas_start_is_bounded_by_start_timeout_s_not_timeout_s():
    """A start longer than one group's generator.timeout_s serves; a start that stalls ends as a timeout
    of generator.start_timeout_s, naming it, with nothing left running."""
    def starter(seconds: float, *overrides: str):
        timeouts = Timeouts.of(load_config("smoke", ["--generator.timeout_s", "1", *overrides]))
        # the first call (a generator's attach_weights) waits for the constructor
        return monarch_replicas(lambda i: "generator", SlowStart, lambda i: (seconds,),
                                setup=lambda replica: replica.actor.ping.call_one(), start_timeout=timeouts.start)

    async def run():
        pool = ReplicaPool("generator", starter(3.0), count=1, max_restarts=0)
        await pool.start()
        try:
            assert await pool.call(lambda r: r.actor.ping.call_one()) == "ready" and pool.restarts == 0
        finally:
            await pool.stop()
        with pytest.raises(CallTimeout, match=r"generator did not answer its start call within 5 s "
                                              r"\(generator.start_timeout_s\)"):
            await starter(600.0, "--generator.start_timeout_s", "5")(0)

    asyncio.run(run())
