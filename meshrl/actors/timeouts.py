"""Timeouts for the actor calls the controller makes: a call that does not answer in time is handled
as its actor having died, never as a hang. A generator or grader replica that times out is replaced
like a crashed one (its group redone elsewhere); the trainer, the reference or the replay buffer
timing out is restarted (meshrl/restarts.py), and past its restart budget ends the run with one line
naming the call. Each role's config sets its own limit (`generator.timeout_s`,
`weight_sync.timeout_s` for weight pulls and relays, `trainer.timeout_s`, ...). Calls made while stopping are
bounded too (`controller.stop_timeout_s`): past it the stop goes on without them.

A user's stop (Ctrl-C, SIGTERM) ends the controller's calls too: `StopSignals`, below.
"""

import asyncio
import logging
import signal
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Callable

from tqdm import tqdm

logger = logging.getLogger(__name__)


class CallTimeout(RuntimeError):
    """An actor call that did not answer within its role's timeout."""

    def __init__(self, role: str, what: str, seconds: float, key: str):
        super().__init__(f"{role} did not answer its {what} call within {seconds:g} s ({key})")
        self.role = role


@dataclass(frozen=True)
class Timeout:
    seconds: float  # 0: no limit
    key: str  # the config field that sets it, named in the error


@dataclass(frozen=True)
class Timeouts:
    """Each kind of call's limit, from the run's config."""

    generate: Timeout | None = None  # a group's generation
    start: Timeout | None = None  # a generator replica's start: vLLM loading the model
    relay: Timeout | None = None  # a weight relay attaching to the trainer's rings (generators bound their own pulls)
    grade: Timeout | None = None
    trainer: Timeout | None = None  # one trainer call: per micro-batch it carries, an optimizer step, a publish, the save
    reference: Timeout | None = None
    buffer: Timeout | None = None  # one replay-buffer call: adding a group, a step's plan, a micro-batch
    stop: Timeout | None = None  # each call made while stopping: the stop's checkpoint, the save, stopping meshes

    @staticmethod
    def of(config) -> "Timeouts":
        return Timeouts(
            generate=Timeout(config.generator.timeout_s, "generator.timeout_s"),
            start=Timeout(config.generator.start_timeout_s, "generator.start_timeout_s"),
            relay=Timeout(config.weight_sync.timeout_s, "weight_sync.timeout_s"),
            grade=Timeout(config.grader.timeout_s, "grader.timeout_s"),
            trainer=Timeout(config.trainer.timeout_s, "trainer.timeout_s"),
            reference=Timeout(config.reference.timeout_s, "reference.timeout_s"),
            buffer=Timeout(config.replay_buffer.timeout_s, "replay_buffer.timeout_s"),
            stop=Timeout(config.controller.stop_timeout_s, "controller.stop_timeout_s"))


@asynccontextmanager
async def deadline(timeout: Timeout | None, role: str, what: str):
    """Bound the calls awaited inside by `timeout`; CallTimeout names the role, the call and the key."""
    if timeout is None or timeout.seconds <= 0:
        yield
        return
    try:
        async with asyncio.timeout(timeout.seconds) as limit:
            yield
    except TimeoutError:
        if not limit.expired():  # a TimeoutError of the call's own, not ours
            raise
        raise CallTimeout(role, what, timeout.seconds, timeout.key) from None


async def bounded(call, timeout: Timeout | None, what: str):
    """Await `call` (a coroutine) for at most `timeout`; past it, one warning line and None: for calls
    made while stopping (a checkpoint, the save, stopping meshes), after which the stop goes on."""
    if timeout is None or timeout.seconds <= 0:
        return await call
    try:
        return await asyncio.wait_for(call, timeout.seconds)
    except TimeoutError:
        logger.warning("%s did not finish within %g s (%s); going on without it", what, timeout.seconds, timeout.key)
        return None


class Stopped(Exception):
    """A stop was asked for while a step trained: raised once the step is whole."""


class StopSignals:
    """Ctrl-C (SIGINT) or SIGTERM stops a run: `stopped_by` names the signal, and the controller's
    loops (`task`) are cancelled at once, or, while a step trains or a checkpoint is written
    (`holding`), stopped as soon as that ends (Stopped), so that the stop's checkpoint has whole steps. A second signal
    ends the process within seconds whatever it is doing (`on_hard_stop`: it writes what it can, stops
    every actor process and exits).

    Installed once the actors run: Monarch's runtime replaces the process's SIGINT handler beneath
    Python's, so asyncio's own Ctrl-C handling never fires."""

    def __init__(self):
        self.stopped_by: str | None = None
        self.held = False  # a step is training, or a checkpoint being written: a stop waits for it
        self.task: asyncio.Task | None = None  # what a stop cancels: the controller's loops, while they run
        self.on_hard_stop: Callable[[str], None] | None = None  # the second signal's: never returns

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request, sig.name)

    def request(self, name: str) -> None:
        """A stop asked for by signal `name` (the handler; tests call it too)."""
        if self.stopped_by is not None:
            tqdm.write(f"{name} again: stopping now, without a checkpoint")
            if self.on_hard_stop:
                self.on_hard_stop(name)
            return
        self.stopped_by = name
        tqdm.write(f"{name}: stopping after this step; saving a checkpoint and the policy (again to stop at once)")
        if self.task and not self.held:
            self.task.cancel()

    @contextmanager
    def holding(self):
        """A stop asked for meanwhile waits for the block to end, then raises Stopped."""
        self.held = True
        try:
            yield
        finally:
            self.held = False
        if self.stopped_by:
            raise Stopped(self.stopped_by)

    def release(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
