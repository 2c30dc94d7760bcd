"""A pool of replicas of one role (generators, graders): each call goes to the least-loaded healthy
replica, and a replica that fails (its process killed, its endpoint raising) is stopped and replaced
on a fresh proc mesh while its calls are retried on the others.

The pool knows nothing of what the calls do: `call(fn)` runs `fn(replica)` and, if the replica
fails, runs it again on another. A call is therefore retried whole, so each piece of work (one
prompt's group) is done once by a healthy replica and never silently dropped. After `max_restarts`
replacements the pool gives up: the call raises `RoleFailed` with one clear line.
"""

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

from monarch.actor import Actor, endpoint

from meshrl.actors import in_rank_order, spawn
from meshrl.timeouts import Timeout, deadline

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RoleFailed(RuntimeError):
    """A role can no longer do its work (its replicas kept failing, or a single actor died)."""


class ProcessInfo(Actor):
    """Spawned beside each replica: tells the controller the host and the process id (for users and tests)."""

    @endpoint
    async def where(self) -> tuple[str, int]:
        return socket.gethostname(), os.getpid()


def describe(error: BaseException) -> str:
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


@dataclass
class Replica:
    index: int  # its position in the pool; a replacement takes the index of the one it replaces
    procs: object  # its proc mesh, to stop
    actor: object  # its actor mesh (one actor)
    host: str
    pid: int
    healthy: bool = True
    load: int = 0  # calls in flight
    policy_version: int = 0  # what it serves (generators)
    pulling: asyncio.Lock = field(default_factory=asyncio.Lock)
    busy_since: float | None = None
    busy_s: float = 0.0  # seconds with at least one call in flight


class ReplicaPool:
    def __init__(self, role: str, cls: type, make_args: Callable[[int], tuple], count: int, max_restarts: int,
                 setup: Callable[[Replica], Awaitable[None]] | None = None,
                 on_replaced: Callable[[], None] | None = None, host: Callable[[int], object] | None = None,
                 start_timeout: Timeout | None = None):
        """`count` replicas of `cls(*make_args(i))`, replica i on `host(i)` (a host mesh; default the
        controller's host); `setup` runs on every replica, replacements included, before it takes
        work (a generator attaches to the weight ring); a replica not started and set up within
        `start_timeout` counts as failed; `on_replaced` is called once a replacement serves (the
        controller rewrites processes.json)."""
        self.role, self.cls, self.make_args, self.count = role, cls, make_args, count
        self.max_restarts, self.setup, self.on_replaced = max_restarts, setup, on_replaced
        self.host, self.start_timeout = host or (lambda index: None), start_timeout
        self.replicas: list[Replica] = []
        self.restarts = 0
        self.retired_busy_s = 0.0  # busy seconds of replicas since replaced
        self.requeued = 0  # calls retried on another replica after theirs failed
        self.failed: RoleFailed | None = None
        self.changed = asyncio.Condition()  # a replica became healthy, or the pool gave up
        self.respawning: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.replicas = list(await asyncio.gather(*(self._spawn(i) for i in range(self.count))))

    def name(self, index: int) -> str:
        return f"{self.role}{index}" if self.count > 1 else self.role

    async def _spawn(self, index: int) -> Replica:
        name = self.name(index)
        procs, actor = spawn(name, self.cls, *self.make_args(index), host=self.host(index))
        try:
            async with deadline(self.start_timeout, name, "start"):
                [(host, pid)] = await processes(procs, name)
                replica = Replica(index, procs, actor, host, pid)
                if self.setup:
                    await self.setup(replica)
            return replica
        except BaseException:  # cancelled or failed while starting: leave no process behind
            await asyncio.shield(procs.stop())
            raise

    async def call(self, fn: Callable[[Replica], Awaitable[T]]) -> T:
        """`fn` on the least-loaded healthy replica; on another if that one fails."""
        while True:
            replica = await self._least_loaded()
            self._track(replica, +1)
            try:
                return await fn(replica)
            except RoleFailed:
                raise
            except Exception as e:  # CancelledError is not an Exception: a cancelled call is not retried
                self.requeued += 1
                await self._replace(replica, e)
            finally:
                self._track(replica, -1)

    def busy_seconds(self) -> float:
        """Seconds the replicas, all together, had at least one call in flight."""
        now = time.perf_counter()
        running = sum(now - r.busy_since for r in self.replicas if r.busy_since is not None)
        return self.retired_busy_s + running + sum(r.busy_s for r in self.replicas)

    def pids(self) -> dict[str, int]:
        return {self.name(r.index): r.pid for r in self.replicas}

    def hosts(self) -> dict[str, str]:
        return {self.name(r.index): r.host for r in self.replicas}

    async def stop(self) -> None:
        for task in list(self.respawning):
            task.cancel()
        await asyncio.gather(*self.respawning, return_exceptions=True)
        await asyncio.gather(*(r.procs.stop() for r in self.replicas), return_exceptions=True)

    def _track(self, replica: Replica, delta: int) -> None:
        replica.load += delta
        if replica.load == 1 and delta > 0:
            replica.busy_since = time.perf_counter()
        elif replica.load == 0 and replica.busy_since is not None:
            replica.busy_s += time.perf_counter() - replica.busy_since
            replica.busy_since = None

    async def _least_loaded(self) -> Replica:
        async with self.changed:
            await self.changed.wait_for(lambda: self.failed or any(r.healthy for r in self.replicas))
            if self.failed:
                raise self.failed
            return min((r for r in self.replicas if r.healthy), key=lambda r: r.load)

    async def _replace(self, replica: Replica, error: Exception) -> None:
        """Take a failed replica out of service and spawn its replacement in the background (once per
        failure, however many of its calls report it); its calls go on on the other replicas."""
        if not replica.healthy:
            return
        replica.healthy = False
        reason = describe(error)
        if self.restarts >= self.max_restarts:
            await self._give_up(f"{self.role} {replica.index} (pid {replica.pid}) failed after "
                                f"{self.restarts} replacements (max_restarts {self.max_restarts}): {reason}")
            raise self.failed
        self.restarts += 1
        logger.warning("%s %d (pid %d) failed (%s); replacing it", self.role, replica.index, replica.pid, reason)
        task = asyncio.create_task(self._respawn(replica))
        self.respawning.add(task)
        task.add_done_callback(self.respawning.discard)

    async def _respawn(self, replica: Replica) -> None:
        try:
            await replica.procs.stop()
        except Exception:  # a dead mesh may refuse to stop; its replacement does not depend on it
            pass
        try:
            fresh = await self._spawn(replica.index)
        except Exception as e:
            await self._give_up(f"{self.role} {replica.index} could not be replaced: {e}")
            return
        async with self.changed:
            self.retired_busy_s += replica.busy_s
            self.replicas[self.replicas.index(replica)] = fresh
            self.changed.notify_all()
        if self.on_replaced:
            self.on_replaced()

    async def _give_up(self, message: str) -> None:
        async with self.changed:
            self.failed = self.failed or RoleFailed(message)
            self.changed.notify_all()
