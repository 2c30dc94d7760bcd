"""A pool of replicas of one role (generators, graders): each call goes to the least-loaded healthy
replica, and a replica that fails is stopped and replaced on a fresh proc mesh while its calls are
retried on the others.

Failures by kind. A replica fails when its process died (Monarch's SupervisionError), a call to it
timed out (CallTimeout), or it says its engine is broken (an endpoint raising `ReplicaBroken`): it is
replaced and the call redone whole elsewhere, so each piece of work (one prompt's group) is done once
by a healthy replica and never silently dropped. Any other error an endpoint raises is the call's own
(vLLM rejecting a request, a tokenizer or environment error): the replica serves on and the caller
gets `CallFailed`, with one line saying why. After `max_restarts` replacements the pool gives up: the
call raises `RoleFailed` with one clear line.
"""

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import Actor, ActorError, endpoint

from meshrl.actors import in_rank_order, spawn
from meshrl.actors.roles import ReplicaBroken
from meshrl.timeouts import CallTimeout, Timeout, bounded, deadline

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RoleFailed(RuntimeError):
    """A role can no longer do its work (its replicas kept failing, or a single actor died)."""


class CallFailed(RuntimeError):
    """An endpoint raised an error of the call's own: the replica is fine, the work is not."""


class ProcessInfo(Actor):
    """Spawned beside each replica: tells the controller the host and the process id (for users and tests)."""

    @endpoint
    async def where(self) -> tuple[str, int]:
        return socket.gethostname(), os.getpid()


def error_line(error: BaseException) -> str:
    """One line for an actor call's failure: which call, and the last line of why (a remote
    traceback's exception, or "the process ... failed: Killed(sig=9)")."""
    text = str(error).split("Stack backtrace:")[0]  # Monarch's Rust errors append their frames
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    first = lines[0].split(", The actor ")[0]
    return first if len(lines) == 1 else f"{first.rstrip(':')}: {lines[-1]}"


async def processes(procs, name: str) -> list[tuple[str, int]]:
    """(host name, process id) of each process of a proc mesh, in rank order."""
    return await in_rank_order(procs.spawn(f"{name}_info", ProcessInfo).where.call())


@dataclass(eq=False)  # a replica is itself: a replacement at the same index is another
class Replica:
    index: int  # its position in the pool; a replacement takes the index of the one it replaces
    procs: object  # its proc mesh, to stop
    actor: object  # its actor mesh (one actor)
    host: str
    pid: int
    healthy: bool = True
    load: int = 0  # calls in flight
    calls: asyncio.Lock = field(default_factory=asyncio.Lock)  # the tracer's, for actors that serve one call at a time
    busy_since: float | None = None
    busy_s: float = 0.0  # seconds with at least one call in flight


def replica_name(role: str, index: int, count: int) -> str:
    """ "generator0", "generator1", ...; "generator" when there is one."""
    return f"{role}{index}" if count > 1 else role


def monarch_replicas(name: Callable[[int], str], cls: type, make_args: Callable[[int], tuple],
                     host: Callable[[int], object] | None = None,
                     setup: Callable[[Replica], Awaitable[None]] | None = None,
                     start_timeout: Timeout | None = None) -> Callable[[int], Awaitable[Replica]]:
    """How a pool starts replica i of `cls(*make_args(i))`: on a proc mesh of its own on `host(i)` (a
    host mesh of one host; default the controller's), then `setup` (a generator attaches to the
    weight ring), all within `start_timeout`; nothing left running if it fails or is cancelled."""

    async def start(index: int) -> Replica:
        procs, actor = spawn(name(index), cls, *make_args(index), host=host(index) if host else None)
        try:
            async with deadline(start_timeout, name(index), "start"):
                [(where, pid)] = await processes(procs, name(index))
                replica = Replica(index, procs, actor, where, pid)
                if setup:
                    await setup(replica)
            return replica
        except BaseException:
            await asyncio.shield(bounded(procs.stop(), start_timeout, f"stopping {name(index)}"))
            raise

    return start


class ReplicaPool:
    def __init__(self, role: str, start: Callable[[int], Awaitable[Replica]], count: int, max_restarts: int,
                 on_change: Callable[[], None] | None = None, stop_timeout: Timeout | None = None):
        """`count` replicas, replica i started by `start(i)` (`monarch_replicas`, or a test's fakes),
        replacements too; `on_change` is called when a replica leaves service and when its replacement
        serves (the run rewrites processes.json); stopping a replica's mesh is bounded by `stop_timeout`."""
        self.role, self.start_replica, self.count = role, start, count
        self.max_restarts, self.on_change, self.stop_timeout = max_restarts, on_change, stop_timeout
        self.replicas: list[Replica] = []
        self.restarts = 0
        self.retired_busy_s = 0.0  # busy seconds of replicas since replaced
        self.retried = 0  # calls redone on another replica after theirs failed
        self.failed: RoleFailed | None = None
        self.changed = asyncio.Condition()  # a replica became healthy, or the pool gave up
        self.respawning: set[asyncio.Task] = set()
        self.cursor = 0  # where the next search for the least-loaded replica starts

    async def start(self) -> None:
        self.replicas = list(await asyncio.gather(*(self.start_replica(i) for i in range(self.count))))

    def name(self, index: int) -> str:
        return replica_name(self.role, index, self.count)

    async def call(self, fn: Callable[[Replica], Awaitable[T]]) -> T:
        """`fn` on the least-loaded healthy replica; on another if that one fails. CallFailed if `fn`'s
        call raised an error of its own."""
        while True:
            replica = await self._least_loaded()
            self._track(replica, +1)
            try:
                return await fn(replica)
            except ActorError as e:
                if not isinstance(e.exception, ReplicaBroken):
                    raise CallFailed(error_line(e)) from None
                reason = e
            except (SupervisionError, CallTimeout) as e:  # CancelledError is not retried
                reason = e
            finally:
                self._track(replica, -1)
            self.retried += 1
            await self._replace(replica, reason)

    def busy_seconds(self) -> float:
        """Seconds the replicas, all together, had at least one call in flight."""
        now = time.perf_counter()
        running = sum(now - r.busy_since for r in self.replicas if r.busy_since is not None)
        return self.retired_busy_s + running + sum(r.busy_s for r in self.replicas)

    def pids(self) -> dict[str, int]:
        """The serving replicas' pids (a failed one's replacement appears once it serves)."""
        return {self.name(r.index): r.pid for r in self.replicas if r.healthy}

    def hosts(self) -> dict[str, str]:
        return {self.name(r.index): r.host for r in self.replicas if r.healthy}

    async def stop(self) -> None:
        for task in list(self.respawning):
            task.cancel()
        await asyncio.gather(*self.respawning, return_exceptions=True)
        await asyncio.gather(*(bounded(r.procs.stop(), self.stop_timeout, f"stopping {self.name(r.index)}")
                               for r in self.replicas), return_exceptions=True)

    def _track(self, replica: Replica, delta: int) -> None:
        replica.load += delta
        if replica.load == 1 and delta > 0:
            replica.busy_since = time.perf_counter()
        elif replica.load == 0 and replica.busy_since is not None:
            replica.busy_s += time.perf_counter() - replica.busy_since
            replica.busy_since = None

    async def _least_loaded(self) -> Replica:
        """The healthy replica with the fewest calls in flight; ties go round-robin, and the search
        stops at the first idle one (a pool of hundreds is searched in a few steps while any is idle)."""
        if self.failed or not any(r.healthy for r in self.replicas):
            async with self.changed:
                await self.changed.wait_for(lambda: self.failed or any(r.healthy for r in self.replicas))
            if self.failed:
                raise self.failed
        best, at, count = None, 0, len(self.replicas)
        for k in range(count):
            r = self.replicas[(self.cursor + k) % count]
            if r.healthy and (best is None or r.load < best.load):
                best, at = r, self.cursor + k
                if r.load == 0:
                    break
        self.cursor = (at + 1) % count
        return best

    async def _replace(self, replica: Replica, error: BaseException) -> None:
        """Take a failed replica out of service and start its replacement in the background (once per
        failure, however many of its calls report it); its calls go on on the other replicas."""
        if not replica.healthy:
            return
        replica.healthy = False
        reason = error_line(error)
        if self.restarts >= self.max_restarts:
            await self._give_up(f"{self.role} {replica.index} (pid {replica.pid}) failed after "
                                f"{self.restarts} replacements (max_restarts {self.max_restarts}): {reason}")
            raise self.failed
        self.restarts += 1
        logger.warning("%s %d (pid %d) failed (%s); replacing it", self.role, replica.index, replica.pid, reason)
        if self.on_change:
            self.on_change()
        task = asyncio.create_task(self._respawn(replica))
        self.respawning.add(task)
        task.add_done_callback(self.respawning.discard)

    async def _respawn(self, replica: Replica) -> None:
        try:  # a dead mesh may refuse to stop, or never answer; its replacement does not depend on it
            await bounded(replica.procs.stop(), self.stop_timeout, f"stopping the failed {self.name(replica.index)}")
        except Exception:
            pass
        try:
            fresh = await self.start_replica(replica.index)
        except Exception as e:
            await self._give_up(f"{self.role} {replica.index} could not be replaced: {error_line(e)}")
            return
        async with self.changed:
            self.retired_busy_s += replica.busy_s
            self.replicas[self.replicas.index(replica)] = fresh
            self.changed.notify_all()
        if self.on_change:
            self.on_change()

    async def _give_up(self, message: str) -> None:
        async with self.changed:
            self.failed = self.failed or RoleFailed(message)
            self.changed.notify_all()
