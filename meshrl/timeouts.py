"""Timeouts for the actor calls the controller makes: a call that does not answer in time is handled
as its actor having died, never as a hang. A generator or grader replica that times out is replaced
like a crashed one (its group redone elsewhere); the trainer or the reference timing out ends the
run with one line naming the call. Each role's config sets its own limit (`generator.timeout_s`,
`weight_sync.timeout_s` for weight pulls, `trainer.timeout_s`, ...). Calls made while stopping are
bounded too (`controller.stop_timeout_s`): past it the stop goes on without them.
"""

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

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

    generate: Timeout | None = None  # a group's generation; also a replica's start (vLLM loading)
    pull: Timeout | None = None  # a generator's weight pull: read and load into vLLM
    grade: Timeout | None = None
    trainer: Timeout | None = None  # one trainer call: a micro-batch, an optimizer step, a publish, the save
    reference: Timeout | None = None
    buffer: Timeout | None = None  # one replay-buffer call: adding a group, a step's plan, a micro-batch
    stop: Timeout | None = None  # each call made while stopping: the stop's checkpoint, the save, stopping meshes

    @staticmethod
    def of(config) -> "Timeouts":
        return Timeouts(
            generate=Timeout(config.generator.timeout_s, "generator.timeout_s"),
            pull=Timeout(config.weight_sync.timeout_s, "weight_sync.timeout_s"),
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
