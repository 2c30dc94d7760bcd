"""Monarch's order of work, pinned on real actors, and the fakes held to it.

Monarch 0.7 runs one actor's plain `@endpoint` calls one at a time, in arrival order; its
`concurrent_endpoint` calls as tasks that overlap; calls to different actors overlap. The overlap
the system claims (a publish beside the next step's training, groups batched by a generator) rests on
these rules, and the controller's tests rest on fakes that follow them (tests/support/fake_monarch.py): each
scenario runs on both, and every fake marks `concurrent` exactly the endpoints its real actor does.
A change in Monarch's behaviour fails here first. Times are the actors' own."""

import asyncio
import inspect

import pytest
from monarch.actor import this_host
from rule_actors import Sleeper, sleep_timed

from meshrl.actors import roles
from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.torch_generator import TorchGenerator
from meshrl.actors.grader import TaskGrader
from meshrl.actors.trainer import TitanTrainer
from support.fake_monarch import FakeMesh, concurrent
from support.simulation import FakeGenerator, FakeGrader, FakeTrainer

LONG = 0.6  # seconds a first call takes; the second is sent 0.1 s after it


class FakeSleeper:
    """Sleeper's fake: the same two endpoints."""

    async def plain(self, seconds: float) -> tuple[float, float]:
        return await sleep_timed(seconds)

    @concurrent
    async def together(self, seconds: float) -> tuple[float, float]:
        return await sleep_timed(seconds)


class NoScript:
    async def point(self, endpoint: str, actor, args: tuple = ()) -> None:
        pass


async def two_calls(first, second) -> tuple[tuple[float, float], tuple[float, float]]:
    """`first` (LONG seconds) and, 0.1 s after it was sent, `second` (none): each one's (start, end)."""
    a = asyncio.ensure_future(first.call_one(LONG))
    await asyncio.sleep(0.1)
    b = asyncio.ensure_future(second.call_one(0.0))
    return await a, await b


SCENARIOS = {  # (first endpoint, second endpoint, the second on another actor, does the second wait?)
    "plain after plain, one actor: queued": ("plain", "plain", False, True),
    "concurrent beside concurrent: overlap": ("together", "together", False, False),
    "plain while a concurrent call runs: overlap": ("together", "plain", False, False),
    "concurrent while a plain call runs: queued": ("plain", "together", False, True),
    "plain on two actors: overlap": ("plain", "plain", True, False),
}


@pytest.fixture(scope="module")
def real_actors():
    procs = this_host().spawn_procs(per_host={"procs": 1})
    yield procs.spawn("first", Sleeper), procs.spawn("second", Sleeper)
    procs.stop().get()


def check(scenario: str, actors) -> None:
    first, second, other, waits = SCENARIOS[scenario]
    a, b = actors
    (start1, end1), (start2, _) = asyncio.run(two_calls(getattr(a, first), getattr(b if other else a, second)))
    assert start2 > start1
    assert (start2 >= end1 - 0.01) == waits, (start1, end1, start2)


@pytest.mark.processes
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_monarch_runs_calls_so(real_actors, scenario):
    check(scenario, real_actors)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_fakes_run_calls_as_monarch_does(scenario):
    check(scenario, (FakeMesh([FakeSleeper()], NoScript()), FakeMesh([FakeSleeper()], NoScript())))


def concurrent_endpoints(real) -> set[str]:
    """The endpoints of a real actor class whose calls overlap the messages after them: Monarch's concurrent
    endpoints, and plain ones that answer later on an explicit response port (the trainer's publish_weights:
    its first part in its turn, the answer from a task). The fake's `concurrent` stands for both."""
    return {name for name, value in inspect.getmembers(real)
            if getattr(getattr(value, "_method", None), "_monarch_concurrent_endpoint_wrapper", False)
            or getattr(value, "_explicit_response_port", False)}


@pytest.mark.parametrize("fake, real, role", [(FakeGenerator, VLLMGenerator, roles.Generator),
                                              (FakeGenerator, TorchGenerator, roles.Generator),
                                              (FakeTrainer, TitanTrainer, roles.Trainer),
                                              (FakeGrader, TaskGrader, roles.Grader)])
def test_each_fake_runs_concurrently_what_its_real_actor_does(fake, real, role):
    endpoints = {name for name, _ in inspect.getmembers(role, inspect.isfunction) if not name.startswith("_")}
    fakes = {name for name in endpoints if getattr(getattr(fake, name, None), "concurrent", False)}
    assert fakes == concurrent_endpoints(real) & endpoints
    assert concurrent_endpoints(Sleeper) == {"together"}  # the check itself sees Monarch's mark


def test_a_fake_actor_keeps_arrival_order_for_calls_sent_in_the_same_tick():
    # a concurrent call sent right behind a plain one (no await between) waits for it, as in Monarch
    log = []

    class Actor:
        async def plain(self):
            log.append("plain start")
            await asyncio.sleep(0.05)
            log.append("plain end")

        @concurrent
        async def together(self):
            log.append("together")

    async def both():
        mesh = FakeMesh([Actor()], NoScript())
        await asyncio.gather(mesh.plain.call_one(), mesh.together.call_one())

    asyncio.run(both())
    assert log == ["plain start", "plain end", "together"]
