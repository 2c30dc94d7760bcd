"""Bringing a dead trainer (or reference) back, the trainer in the exact state it lost, while the run goes on.

A trainer rank's process that dies, or a trainer call that does not answer within `trainer.timeout_s`,
takes the whole trainer mesh with it (a sharded model needs all its ranks). The run starts a new mesh
on the same hosts (`respawn`, meshrl/runtime/run.py), restores the newest checkpoint into it (before the first
checkpoint: the initial policy, seeded as the first trainer was), then trains again, in order, the
batches the replay buffer logged since that checkpoint: the same micro-batches, the same optimizer
updates, each version published again into the new trainer's weight ring. The trainer then holds the
weights, optimizer state, RNG state and version count it had; the generators, which served the newest
version meanwhile, are attached to the new ring (`attach`), and the step that failed is trained again.

The reference holds no state: a dead or hung one is replaced by a fresh mesh of the initial policy,
attached to the replay buffer, and the step is trained again (the reference answers first in a step,
before the trainer changes anything: meshrl/train_step.py).

A dead or hung replay buffer is replaced by an empty one: the groups it held for batches not yet
trained are generated again (the work buffer's `lose`), groups trained before and kept for replay are
gone (fewer are reused), and so is its log of the batches trained since the newest checkpoint, so a
checkpoint is written at once, before a trainer restart could need that log.

`trainer.max_restarts`, `reference.max_restarts` and `replay_buffer.max_restarts` bound the restarts that follow each other within
`controller.restart_window_s` of the last (meshrl/actors/replicas.py's RestartBudget): a process that keeps
dying is a crash loop.
"""

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError

from meshrl.actors import first
from meshrl.actors.replicas import RestartBudget, RoleFailed, error_line
from meshrl.actors.timeouts import CallTimeout, deadline
from meshrl.checkpoint import checkpoints
from meshrl.train_step import train_updates
from meshrl.types import BatchRef

logger = logging.getLogger(__name__)
FAULTS = (SupervisionError, ActorError, CallTimeout)  # what a trainer call raises when its process is gone or hangs


@dataclass
class Respawner:
    """What the run does for a restart: `respawn(role)` stops the dead mesh of "trainer", "reference" or
    "replay_buffer" and returns a new one on the same hosts (the first two attached to the replay buffer); `attach(trainer)` points the
    generators (and the replicas started later) at a new trainer's weight rings."""

    respawn: Callable[[str], Awaitable[object]]
    attach: Callable[[object], Awaitable[None]]


async def is_dead(mesh, role: str, error: BaseException, timeout) -> bool:
    """Whether `error`, raised while the controller used `role`'s `mesh`, means that role is gone: its own
    call timed out, or it no longer answers `ping`, which changes nothing (another role's failure leaves it
    answering)."""
    if isinstance(error, CallTimeout):
        return error.role == role
    if not isinstance(error, (SupervisionError, ActorError)):
        return False
    try:
        async with deadline(timeout, role, "ping"):
            await mesh.ping.call()
        return False
    except asyncio.CancelledError:
        raise
    except Exception:  # the probe's own failure (its process gone, no answer in time, a refused call): dead
        return True


async def buffer_is_dead(buffer, error: BaseException, timeout) -> bool:
    """Whether `error` means the replay buffer is gone: its own call timed out, or it no longer answers
    (the trainer's calls fail too when it dies: they take their micro-batches from it)."""
    if isinstance(error, CallTimeout):
        return error.role == "replay_buffer"
    if not isinstance(error, (SupervisionError, ActorError)):
        return False
    try:
        async with deadline(timeout, "replay_buffer", "logged"):
            await buffer.logged.call_one()
        return False
    except asyncio.CancelledError:
        raise
    except Exception:  # the probe's own failure (its process gone, no answer in time, a refused call): dead
        return True


async def retrain_logged(trainer, reference, buffer, batches: range, config, span, timeouts) -> None:
    """Train `batches` again, as the replay buffer logged them (the same micro-batches), each followed by
    its publish: a restarted trainer brought to the state the dead one had after them."""
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
            await buffer.trained.call_one(b, b + 1)  # a batch trained again counts no new use, writes no record


class Restarts:
    """Whether the controller's trainer, reference or replay buffer died, and the steps that bring it back:
    these decide when and what, the controller's own methods for them (`abandon_step`, `replace_trainer`,
    `replace_buffer`, ...) change its state. How many restarts, and the seconds they cost."""

    def __init__(self, respawner: Respawner | None, config):
        """From `config`: the controller's restart window and each restartable role's `max_restarts` (a
        restarted trainer trains its batches again with the controller's config: `retrain_logged`)."""
        self.respawner = respawner
        window = config.controller.restart_window_s
        self.budgets = {"trainer": RestartBudget(config.trainer.max_restarts, window),
                        "reference": RestartBudget(config.reference.max_restarts, window),
                        "replay_buffer": RestartBudget(config.replay_buffer.max_restarts, window)}
        self.count = {"trainer": 0, "reference": 0, "replay_buffer": 0}
        self.seconds_lost = 0.0
        self.trainer_behind = False  # a trainer restart has begun and not ended: its state is not the run's
        self.given_up: str | None = None  # the role whose failures outran its restart budget, ending the run
        for role, budget in self.budgets.items():
            budget.start(role)

    def counters(self) -> tuple[dict, float]:
        """What a checkpoint keeps: the restarts per role and the seconds they cost."""
        return dict(self.count), self.seconds_lost

    def restore(self, counters: tuple[dict, float]) -> None:
        """Go on from a checkpoint's `counters()`."""
        count, self.seconds_lost = counters
        self.count.update(count)

    async def after(self, controller, error: BaseException) -> None:
        """`error` ended a step: restart the trainer, the reference or the replay buffer if it is the one that
        died (re-raise it otherwise, or when there is no way back)."""
        if self.respawner is not None:
            timeouts = controller.timeouts
            if await is_dead(controller.trainer, "trainer", error, timeouts.trainer):
                return await self._timed(controller, "trainer", error, self._trainer)
            if controller.reference is not None and await is_dead(controller.reference, "reference", error,
                                                                  timeouts.reference):
                return await self._timed(controller, "reference", error, self._reference)
            if await buffer_is_dead(controller.buffer, error, timeouts.buffer):
                return await self._timed(controller, "replay_buffer", error, self._buffer)
        raise error

    async def _timed(self, controller, role: str, error: BaseException, restart) -> None:
        start = time.perf_counter()
        cause = error_line(error)
        name = role.replace("_", " ")
        if not self.budgets[role].failed(role):
            self.given_up = role
            raise RoleFailed(f"the {name} {self.budgets[role].describe(role)}: {cause}")
        async with controller.tracer.span(role, "restart", controller.rows.done):
            await restart(controller, cause)
            self.budgets[role].start(role)
        lost = time.perf_counter() - start
        self.count[role] += 1
        self.seconds_lost += lost
        logger.warning("the %s is back at policy version %d after %.1f s", name, controller.rows.done, lost)

    async def _reference(self, controller, cause: str) -> None:
        """A fresh reference: the initial policy, as the dead one held."""
        logger.warning("the reference failed (%s); restarting it", cause)
        controller.replace_reference(await self.respawner.respawn("reference"))

    async def _buffer(self, controller, cause: str) -> None:
        """An empty replay buffer; the groups the dead one held for untrained batches generated again."""
        if self.trainer_behind:
            raise RoleFailed(f"the replay buffer failed ({cause}) while the trainer was being brought back from the "
                             "batches it logged, which died with it; go on from the newest checkpoint with --resume")
        applied = controller.abandon_step()
        if applied:  # its batch is lost with the buffer: those updates cannot be redone
            raise RoleFailed(f"the replay buffer failed ({cause}) after {applied} of step "
                             f"{controller.rows.done + 1}'s updates were applied, which cannot be undone; go on from "
                             "the newest checkpoint with --resume")
        lost = controller.replace_buffer(await self.respawner.respawn("replay_buffer"))
        logger.warning("the replay buffer failed (%s); restarted empty: the %d groups it held for batches not yet "
                       "trained are generated again", cause, lost)
        await controller.attach_buffer()
        if applied is not None:  # the failed step's micro-batches trained so far: it is trained again whole
            await controller.trainer.drop_gradients.call()
        controller.restart_rollouts()
        done = controller.rows.done
        if done and done not in [step for step, _ in checkpoints(controller.checkpointer.run_dir)]:
            await controller.checkpoint()  # the log of the batches trained since the newest one died with it

    async def _trainer(self, controller, cause: str) -> None:
        """A new trainer mesh in `controller.trainer`'s place, in the state the dead one had after the steps
        logged (`controller.rows.done`)."""
        done = controller.rows.done
        saved = [(step, path) for step, path in checkpoints(controller.checkpointer.run_dir) if step <= done]
        since, newest = saved[-1] if saved else (0, None)
        logger.warning("the trainer failed (%s); restarting it from %s and training again the %d step(s) since",
                       cause, newest.name if newest else "the initial policy", done - since)
        controller.abandon_publish()  # it failed, or will: the retraining publishes its version again
        controller.abandon_step()  # restored and retrained: none of the step is left
        self.trainer_behind = True
        trainer = await self.respawner.respawn("trainer")
        controller.replace_trainer(trainer)
        if newest is not None:
            await controller.checkpointer.restore_trainer(newest)
        await retrain_logged(trainer, controller.reference, controller.buffer, range(since, done), controller.config,
                             controller.tracer.span, controller.timeouts)
        await self.respawner.attach(trainer)
        self.trainer_behind = False
        controller.trainer_published(done)
