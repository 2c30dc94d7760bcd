"""Monarch's actor handles, faked for the fake actors of tests/support/simulation.py, with Monarch's order of work.

Monarch 0.7 delivers one actor's messages in arrival order, one at a time: a plain `@endpoint` runs
to its end before the actor takes the next message, so calls to it queue. A `concurrent_endpoint`
is only started (as a task of the actor's loop) and the actor goes on to its next message, so such
calls overlap each other and the plain calls that arrive after them; a concurrent call that arrives
while a plain one runs waits for it, like any message. Calls to different actors overlap.
tests/test_monarch_rules.py pins these rules on real actors, and that each fake marks the same
endpoints `concurrent` as the real actor of its role.

A caller that stops waiting (a timeout, a cancelled group) does not stop the actor's work, as in
Monarch: the call goes on and holds the actor's turn until it ends.
"""

import asyncio
import functools
import time
from collections import Counter

from monarch._src.actor.endpoint import EndpointProperty
from monarch.actor import ActorError

ACTOR_CPU: Counter = Counter()  # CPU seconds each fake actor class spent in its own endpoints' code


class Timed:
    """An endpoint's coroutine, each of its steps timed in thread CPU into ACTOR_CPU[key]: the fake
    actors run in the caller's process, and the controller's benchmark tells their CPU from its own."""

    def __init__(self, coroutine, key: str):
        self.coroutine, self.key = coroutine, key

    def __await__(self):
        steps, value, error = self.coroutine.__await__(), None, None
        while True:
            start = time.thread_time()
            try:
                out = steps.throw(error) if error is not None else steps.send(value)
            except StopIteration as done:
                return done.value
            finally:
                ACTOR_CPU[self.key] += time.thread_time() - start
            try:
                value, error = (yield out), None
            except GeneratorExit:  # dropped while suspended: the endpoint's coroutine is closed too
                steps.close()
                raise
            except BaseException as e:  # a cancellation or error thrown into the awaiting task: passed on
                value, error = None, e


def concurrent(method):
    """Marks a fake actor's endpoint as Monarch's `concurrent_endpoint` would."""
    method.concurrent = True
    return method


class Mailbox:
    """One fake actor's queue of messages: plain calls one at a time, in arrival order."""

    def __init__(self):
        self.turn = asyncio.Lock()  # FIFO: waiters are woken in the order they came
        self.waiting = 0  # calls delivered and not yet started

    async def deliver(self, call, is_concurrent: bool):
        if is_concurrent and not self.waiting and not self.turn.locked():  # nothing ahead of it: started now
            work = asyncio.ensure_future(call())
        else:
            self.waiting += 1  # from delivery on: a call delivered in the same tick queues behind it
            work = asyncio.ensure_future(self._in_turn(call, is_concurrent))
        return await asyncio.shield(work)  # the actor's work, whatever becomes of the caller

    async def _in_turn(self, call, is_concurrent: bool):
        try:
            await self.turn.acquire()
        finally:
            self.waiting -= 1
        try:
            if not is_concurrent:
                return await call()
            work = asyncio.ensure_future(call())  # started; the next message may be taken
        finally:
            self.turn.release()
        return await work


def mailbox(actor) -> Mailbox:
    box = actor.__dict__.get("_mailbox")
    if box is None:
        box = actor.__dict__["_mailbox"] = Mailbox()
    return box


class FakeValueMesh:
    """What awaiting `mesh.endpoint.call()` gives: every rank's answer."""

    def __init__(self, values: list):
        self.values = values

    def items(self):
        return [({"procs": r}, v) for r, v in enumerate(self.values)]


class FakeEndpoint:
    def __init__(self, mesh: "FakeMesh", name: str):
        self.mesh, self.name = mesh, name

    async def call_one(self, *args, **kwargs):
        [actor] = self.mesh.actors
        return await self._on(actor, *args, **kwargs)

    def call(self, *args, **kwargs):
        async def every_rank():
            return FakeValueMesh(list(await asyncio.gather(*(self._on(a, *args, **kwargs) for a in self.mesh.actors))))
        return every_rank()

    async def _on(self, actor, *args, **kwargs):
        await self.mesh.script.point(self.name, actor, args)
        method, is_concurrent = endpoint_of(actor, self.name)
        try:
            return await mailbox(actor).deliver(lambda: Timed(method(*args, **kwargs), type(actor).__name__),
                                                is_concurrent)
        except Exception as e:  # an endpoint's own error reaches the caller as Monarch's ActorError
            raise ActorError(e) from None


def endpoint_of(actor, name: str):
    """(the method, whether concurrent) of a fake actor's endpoint `name`, or of a real Monarch actor's
    (an `@endpoint` or `concurrent_endpoint` of an Actor subclass run in process: the real replay buffer)."""
    prop = getattr(type(actor), name)
    if isinstance(prop, EndpointProperty):
        is_concurrent = getattr(prop._method, "_monarch_concurrent_endpoint_wrapper", False)
        # a concurrent endpoint's method is Monarch's wrapper (it answers on a port): the body it wraps
        method = prop._method.__wrapped__ if is_concurrent else prop._method
        return functools.partial(method, actor), is_concurrent
    method = getattr(actor, name)
    return method, getattr(method, "concurrent", False)


class FakeMesh:
    """Monarch's actor-mesh handle over plain objects, one per rank: `mesh.endpoint.call_one()`,
    `mesh.endpoint.call()`, `mesh.slice(procs=r)`; `script.point(endpoint, actor)` sees each call
    as it is made (tests/support/simulation.py's Script)."""

    def __init__(self, actors: list, script):
        self.actors, self.script = actors, script

    def __getattr__(self, name: str) -> FakeEndpoint:
        return FakeEndpoint(self, name)

    @property
    def sizes(self) -> dict[str, int]:
        return {"procs": len(self.actors)}

    def slice(self, procs: int) -> "FakeMesh":
        return FakeMesh([self.actors[procs]], self.script)


class FakeProcs:
    def __init__(self):
        self.stopped = False

    async def stop(self) -> None:
        self.stopped = True
