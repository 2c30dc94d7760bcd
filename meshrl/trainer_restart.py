"""Bringing a dead trainer back to the exact state it lost, while the run goes on.

A trainer rank's process that dies, or a trainer call that does not answer within `trainer.timeout_s`,
takes the whole trainer mesh with it (a sharded model needs all its ranks). The run starts a new mesh
on the same hosts (`respawn`, meshrl/run.py), restores the newest checkpoint into it (before the first
checkpoint: the initial policy, seeded as the first trainer was), then trains again, in order, the
batches the replay buffer logged since that checkpoint: the same micro-batches, the same optimizer
updates, each version published again into the new trainer's weight ring. The trainer then holds the
weights, optimizer state, RNG state and version count it had; the generators, which served the newest
version meanwhile, are attached to the new ring (`attach`), and the step that failed is trained again.

`trainer.max_restarts` bounds the restarts that follow each other within `controller.restart_window_s`
of the last (meshrl/replicas.py's RestartBudget): a trainer that keeps dying is a crash loop.
"""

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError

from meshrl.actors import first, in_rank_order
from meshrl.checkpoint import checkpoints
from meshrl.replicas import RestartBudget, RoleFailed, error_line
from meshrl.timeouts import CallTimeout, deadline
from meshrl.train_step import train_updates
from meshrl.types import BatchRef

logger = logging.getLogger(__name__)
FAULTS = (SupervisionError, ActorError, CallTimeout)  # what a trainer call raises when its process is gone or hangs


@dataclass
class Respawner:
    """What the run does for a restart: `respawn()` stops the dead mesh and returns a new trainer mesh on
    the same hosts, attached to the replay buffer; `attach(trainer)` points the generators (and the
    replicas started later) at its weight rings."""

    respawn: Callable[[], Awaitable[object]]
    attach: Callable[[object], Awaitable[None]]


async def is_dead(trainer, error: BaseException, timeouts) -> bool:
    """Whether `error`, raised while the controller used the trainer, means the trainer is gone: its own
    call timed out, or it no longer answers (a buffer or reference failure leaves it answering)."""
    if isinstance(error, CallTimeout):
        return error.role == "trainer"
    if not isinstance(error, (SupervisionError, ActorError)):
        return False
    try:
        async with deadline(timeouts.trainer, "trainer", "weight_ring"):
            await in_rank_order(trainer.weight_ring.call())
        return False
    except asyncio.CancelledError:
        raise
    except Exception:
        return True


async def replay(trainer, reference, buffer, batches: range, config, span, timeouts) -> None:
    """Train `batches` again, as logged by the replay buffer, each followed by its publish."""
    logged = set(await buffer.logged.call_one())
    if missing := [b for b in batches if b not in logged]:
        raise RoleFailed(f"the replay buffer no longer holds batches {missing} trained since the newest checkpoint")
    for b in batches:
        async with span("replay_buffer", "sample", b, timeout=timeouts.buffer):
            plan = await buffer.sample.call_one(b, [])
        updates = [[BatchRef(b, u, m) for m in range(count)] for u, count in enumerate(plan["micro_batches"])]
        await train_updates(trainer, reference, updates, config.trainer, span, b, config.reference.ranks, timeouts)
        async with span("trainer", "publish", b + 1, timeout=timeouts.trainer):
            version = await first(trainer.publish_weights.call())
        if version != b + 1:
            raise RoleFailed(f"the restarted trainer published version {version} for batch {b}, expected {b + 1}")
        async with deadline(timeouts.buffer, "replay_buffer", "trained"):
            await buffer.trained.call_one(b)  # a batch trained again counts no new use


class TrainerRestarts:
    """The controller's restarts of its trainer: how many, and the seconds they cost."""

    def __init__(self, respawner: Respawner | None, budget: RestartBudget):
        self.respawner, self.budget = respawner, budget
        self.count = 0
        self.seconds_lost = 0.0
        budget.start("trainer")

    async def restart(self, controller, error: BaseException) -> None:
        """A new trainer mesh in `controller.trainer`'s place, in the state the dead one had after the steps
        logged (`controller.rows.done`); RoleFailed when there is no way back."""
        start = time.perf_counter()
        cause = error_line(error)
        if self.respawner is None:
            raise error
        if not self.budget.failed("trainer"):
            raise RoleFailed(f"the trainer {self.budget.describe('trainer')}: {cause}")
        done = controller.rows.done
        saved = [(step, path) for step, path in checkpoints(controller.checkpointer.run_dir) if step <= done]
        since, newest = saved[-1] if saved else (0, None)
        logger.warning("the trainer failed (%s); restarting it from %s and training again the %d step(s) since",
                       cause, newest.name if newest else "the initial policy", done - since)
        if controller.publishing is not None:  # it failed, or will: the replay publishes its version again
            controller.publishing.cancel()
            controller.publishing.add_done_callback(lambda f: f.cancelled() or f.exception())
            controller.publishing = None
        async with controller.tracer.span("trainer", "restart", done):
            trainer = await self.respawner.respawn()
            controller.trainer = controller.checkpointer.trainer = trainer
            self.budget.start("trainer")
            if newest is not None:
                await controller.checkpointer.restore_trainer(newest)
            await replay(trainer, controller.reference, controller.buffer, range(since, done), controller.config,
                         controller.tracer.span, controller.timeouts)
            await self.respawner.attach(trainer)
        if controller.trainer_version < done:  # the dead trainer's last publish never said it was readable
            controller.trainer_version = done
            controller.collector.published(done)
        lost = time.perf_counter() - start
        self.count += 1
        self.seconds_lost += lost
        logger.warning("the trainer is back at policy version %d after %.1f s", done, lost)
