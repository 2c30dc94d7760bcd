"""The controller's two loops, over actors that are already running (meshrl/runtime/run.py starts them).

The rollout loop keeps groups in flight across the generator replicas: it starts every group the
work buffer's staleness gate lets start (meshrl/work_buffer.py), and wakes whenever a group ends or
a new policy version is published. The controller routes and the actors carry: a group's tokens go
from its generator to the replay buffer (meshrl/actors/replay_buffer.py) without passing here, and
what the controller decides for each kept group (its advantages) follows them, the groups kept within
50 ms of each other added in one call (meshrl/buffer_calls.py). The training loop takes batch b (complete, its episodes within
the bound), has the replay buffer compose and collate it, trains step b + 1 on it at policy version
b (meshrl/train_step.py: the trainer's ranks take the micro-batches from the buffer), publishes version
b + 1, evaluates now and then, and logs the step's row. It does not wait for the publish: the next
step's batch and forward and backward passes go on meanwhile (the trainer's next optimizer update
waits for it), and the version counts as published, for the gate and the generators, once the
trainer says it is readable. An evaluation or a checkpoint waits for it. `controller.max_policy_age` is the one switch
between synchronous (0: the two loops alternate) and asynchronous training.

A trainer that dies or hangs is restarted in the state it lost, a reference afresh, a replay buffer
empty with its untrained groups generated again (meshrl/restarts.py), and the step that failed is
trained again; the generators serve on meanwhile.

Each step's row counts the replies whose reward function raised (`reward_errors`, meshrl/episodes.py): a
share above `grader.warn_error_fraction` is one warning line; above `grader.max_error_fraction` for
`grader.max_error_steps` steps in a row, the run stops (TooManyFailures, one line).

A stop (Ctrl-C, SIGTERM) cancels the loops between steps (a step training or a checkpoint being
written finishes first); the groups in flight are stopped and their prompts kept, and a checkpoint
holds every step logged: `--resume` goes on from it with nothing lost and nothing trained twice.
"""

import asyncio
import gc
import logging
import time
from typing import Awaitable, Callable

from monarch.actor import ActorError

from meshrl.actors import first, in_rank_order
from meshrl.actors.replicas import ReplicaPool, RoleFailed
from meshrl.actors.timeouts import StopSignals, Stopped, Timeouts, bounded, deadline
from meshrl.actors.weight_updates import absorb, cache_figures, gather_reports, no_figures
from meshrl.buffer_calls import BufferCalls
from meshrl.checkpoint import Checkpointer, RunState, latest
from meshrl.configs import Config
from meshrl.episodes import batch_builder, keep_group, reward_error_stop, reward_error_warning
from meshrl.restarts import FAULTS, Respawner, Restarts
from meshrl.rollout import RolloutCollector
from meshrl.train_step import train_updates
from meshrl.types import BatchRef
from meshrl.work_buffer import Batch, Group, TooManyFailures, WorkBuffer

logger = logging.getLogger(__name__)


def quiet_gc() -> None:
    """Python's garbage collector, set for a process whose loops hold many groups' token lists: what
    exists before the loops (imports, the task, the actors' handles) is not walked again, and young
    objects are collected less often. Measured with `meshrl bench controller` (512 replicas, 1,024
    tokens, 2026-11-25): the controller's CPU per group 1.13 ms with the defaults, 0.46 ms so."""
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


class Controller:
    """The loops over one run's actors, the work buffer between them, and the checkpoints they take."""

    def __init__(self, config: Config, task, tokenizer, generators: ReplicaPool, graders: ReplicaPool, trainer,
                 reference, buffer, tracer, signals: StopSignals, checkpointer: Checkpointer, rows,
                 timeouts: Timeouts = Timeouts(), respawner: Respawner | None = None,
                 egress: Callable[[], Awaitable[int]] | None = None):
        """`trainer`, `reference` (or None) and `buffer`: actor meshes following roles.Trainer,
        roles.Reference and roles.ReplayBuffer (the trainer's and reference's ranks attached to it);
        `respawner`: how a dead trainer or reference is replaced (None: its death ends the run); `rows`:
        where each step's row goes (meshrl/runtime/metric_rows.py); `egress()`: bytes the weight relays
        (meshrl/runtime/relays.py) read from the trainer's hosts since the last call, beside those the
        generators read themselves (their `weight_updates`). The whole `config`: the loops run every
        role, so they read the controller's, generator's, trainer's, reference's, replay buffer's and
        checkpoint's sections (the collector gets its two, the restarts theirs)."""
        self.config, self.task, self.tokenizer, self.tracer, self.timeouts = config, task, tokenizer, tracer, timeouts
        self.trainer, self.reference, self.buffer, self.signals = trainer, reference, buffer, signals
        self.routed = (0, 0)  # the generator pool's sticky calls kept and moved, at the last step's row
        self.generators, self.graders, self.checkpointer, self.rows = generators, graders, checkpointer, rows
        # `config` is resolved (meshrl.configs.resolve): generate_ahead is the run's, not -1
        cfg, fresh = config.controller, config.replay_buffer.fresh_groups(config.controller.prompts_per_step)
        self.work = WorkBuffer(cfg.steps, fresh, cfg.max_policy_age, batch_builder(cfg, tracer.now, task.accuracy),
                               cfg.generate_ahead, fresh * (cfg.max_sample_rounds if cfg.drop_equal_reward_groups else 1),
                               cfg.drop_equal_reward_groups, cfg.max_failed_fraction, self._keep, self._discard)
        self.buffer_calls = BufferCalls(lambda: self.buffer, timeouts.buffer)  # kept groups' adds, discards
        self.rollouts: asyncio.Task | None = None  # the rollout loop, while it runs
        self.collector = RolloutCollector(config.controller, config.generator, task, tokenizer, generators, graders,
                                          tracer, self.work, lambda: self.buffer, timeouts, self._generator_report)
        self.bookkeeping: asyncio.Future | None = None  # the replicas', trainer's and buffer's reports, arriving
        self.figures = no_figures()  # what they reported since the last row
        self.trainer_version = 0  # the newest version the trainer published
        self.publishing: asyncio.Future | None = None  # the newest publish, maybe still copying
        self.training: dict | None = None  # while a step trains: {"updates": its updates applied so far}
        self.initial: dict = {}  # the eval before training
        self.trainer_busy = 0.0  # seconds the trainer has spent working
        self.updates = {"weight_swaps_in_flight": 0, "prefix_cache_resets_refused": 0}  # the generators', so far
        self.restarts = Restarts(respawner, config)
        self.egress = egress

    async def restore(self, state: RunState, checkpoint) -> None:
        """Go on from a checkpoint: the trainer's state (published again), the work buffer's position,
        the rows and the counters."""
        self.trainer_version = await self.checkpointer.restore_trainer(checkpoint)
        await self.checkpointer.restore_buffer(checkpoint)
        self.collector.latest = self.trainer_version
        self.work.restore(state.work)
        self.rows.rows, self.initial = list(state.rows), state.initial
        (self.generators.restarts, self.generators.retried), (self.graders.restarts, self.graders.retried) = (
            state.counters["generator"], state.counters["grader"])
        self.updates = dict(state.counters["updates"])
        self.restarts.restore(state.counters.get("restarts", ({}, 0.0)))

    async def run(self) -> None:
        """Train up to `controller.steps` (evaluating first, unless resumed), then checkpoint. A stop
        ends it between steps, with a checkpoint of the steps done; a role that fails ends it with
        its error (RoleFailed, TooManyFailures, ...), with no checkpoint: the newest is from before."""
        self.signals.task = asyncio.current_task()
        quiet_gc()
        try:
            if self.signals.stopped_by:  # stopped while the actors started
                return
            await self.record_rollouts()
            if not self.rows.done:
                self.initial = await self.collector.evaluate(step=0)
            self.rollouts = asyncio.create_task(self._rollout_loop())
            await self._train()
        except Stopped:  # asked for while a step trained: it is whole
            pass
        except asyncio.CancelledError:
            if self.signals.stopped_by is None:
                raise
            asyncio.current_task().uncancel()  # a requested stop: checkpoint what there is
        finally:
            self.signals.task = None
            if self.publishing:  # let the last publish end (its error, if the run failed, is the run's); not
                # cancelled past the bound: the checkpoint below waits for it again
                await bounded(asyncio.gather(asyncio.shield(self.publishing), return_exceptions=True),
                              self.timeouts.stop, "the last publish")
            if self.rollouts:
                self.rollouts.cancel()
                await asyncio.gather(self.rollouts, return_exceptions=True)
            # a replica's report rides on its answers: those whose calls are stopped now lose theirs, and only they
            # have loads and busy time no answer reported
            unanswered = [r for r in self.generators.replicas if r.load > 0]
            await bounded(self.collector.stop(), self.timeouts.stop, "stopping the groups in flight")
            waiting = [self.bookkeeping] if self.bookkeeping else []  # then the last reports, for the trace
            await bounded(asyncio.gather(*waiting, self._bookkeeping(unanswered), return_exceptions=True),
                          self.timeouts.stop,
                          "the last loads and spans (for the trace)")
        if self.rows.done and not self.signals.held:
            stop = self.timeouts.stop if self.signals.stopped_by else None
            await bounded(self.checkpoint(), stop, "the stop's checkpoint")

    async def checkpoint(self) -> None:
        """Everything that decides what comes next, after the last step logged (meshrl/checkpoint.py);
        groups in flight count as not started. Not after a step with an update not applied: the newest
        checkpoint stays the last good one."""
        if self.rows.bad_steps:
            return
        await self._published()
        await self.buffer_calls.sent()
        counters = {"generator": (self.generators.restarts, self.generators.retried),
                    "grader": (self.graders.restarts, self.graders.retried), "updates": dict(self.updates),
                    "restarts": self.restarts.counters()}
        await self.checkpointer.write(RunState(self.rows.done, self.trainer_version, self.work.snapshot(),
                                               list(self.rows.rows), self.initial, counters))

    async def record_rollouts(self) -> None:
        """The replay buffer writes rollouts.jsonl from now on, after the steps logged."""
        async with deadline(self.timeouts.buffer, "replay_buffer", "record_rollouts"):
            await self.buffer.record_rollouts.call_one(str(self.checkpointer.run_dir),
                                                       self.config.logging.rollouts_fraction, self.rows.done)

    def _keep(self, batch: int, group: Group):
        """A kept group of batch `batch`: what to train of it goes to the replay buffer (which holds its
        tokens) under the try that staged it, with the groups kept within FLUSH_S (meshrl/buffer_calls.py); a
        summary stays here."""
        episodes, kept = keep_group(group.scored, group.prompt_index, self.config.controller, self.task,
                                    self.config.generator.temperature)
        episodes.attempt = group.attempt
        self.buffer_calls.add(batch, episodes)
        return kept

    def _discard(self, group: Group) -> None:
        """A finished group not trained (dropped, stale): the replay buffer lets its staged tokens go."""
        if group.scored:
            self.buffer_calls.discard(group.prompt_index, group.attempt)

    # What the restarts (meshrl/restarts.py) have the controller do: they decide when and what, these change
    # the controller's own state.

    def abandon_step(self) -> int | None:
        """A role died while a step may have been training (it is trained again whole): the count of its
        updates already applied, None when no step was training."""
        training, self.training = self.training, None
        return None if training is None else training["updates"]

    def abandon_publish(self) -> None:
        """The trainer died: its publish in flight, if any, is dropped with its error (published again)."""
        if self.publishing is not None:
            self.publishing.cancel()
            self.publishing.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.publishing = None

    def replace_trainer(self, trainer) -> None:
        self.trainer = self.checkpointer.trainer = trainer

    def trainer_published(self, version: int) -> None:
        """A restarted trainer published `version` again: the gate and generators told, if not already."""
        if self.trainer_version < version:
            self.trainer_version = version
            self.collector.published(version)

    def replace_reference(self, reference) -> None:
        self.reference = reference

    def replace_buffer(self, buffer) -> int:
        """An empty replay buffer in the dead one's place; the count of groups lost. The groups kept for
        batches not yet trained are generated again, those on their way to the dead buffer lost with it, and
        those in flight (some staged in it) stop, their prompts started again. Not async: nothing runs
        between the swap and the loss, so each group kept from now on goes to the new buffer."""
        self.buffer = self.checkpointer.buffer = buffer
        lost = self.work.lose()
        self.buffer_calls.lose()
        self.collector.cancel()
        return lost

    async def attach_buffer(self) -> None:
        """The trainer's and reference's ranks take micro-batches from the buffer in place, which records
        rollouts from the steps logged on."""
        for mesh in (self.trainer, self.reference):
            if mesh is not None:
                await mesh.attach_buffer.call(self.buffer)
        await self.record_rollouts()

    def restart_rollouts(self) -> None:
        """The rollout loop running again if it had ended (every batch complete), and woken: the prompts
        stopped or lost start again."""
        if self.rollouts is not None and self.rollouts.done():
            self.rollouts.result()  # raises what ended it, if that was an error
            self.rollouts = asyncio.create_task(self._rollout_loop())
        self.collector.changed.set()

    async def _rollout_loop(self) -> None:
        """Keep every group the gate allows in flight; raise what ends the run (a pool out of replicas,
        too many failed groups)."""
        c = self.collector
        while not self.work.done():
            c.start_groups(self.trainer_version)
            c.changed.clear()
            await c.changed.wait()
            if c.error:
                raise c.error

    async def _train(self) -> None:
        """Steps after the last one done up to `controller.steps`, a checkpoint every `checkpoint.every`.
        A trainer, reference or replay buffer that dies or hangs meanwhile is restarted (meshrl/restarts.py),
        and the step goes on."""
        for step in self.rows.progress(self.config.controller.steps):
            while True:
                try:
                    await self._train_step(step)
                    break
                except FAULTS as e:
                    await self._recover(e)

    async def _recover(self, error: BaseException) -> None:
        """Restart what `error` says died; a failure during that restart is handled the same way (the
        restart budgets bound them). A stop waits for the roles to be whole again."""
        while True:
            try:
                with self.signals.holding():
                    await self.restarts.after(self, error)
                return
            except FAULTS as again:
                if again is error:  # not a death the restarts can undo
                    raise
                error = again

    async def _train_step(self, step: int) -> None:
        """Step `step`, unless logged already (a restart after its row), and its checkpoint if one is due.
        A step whose update was not applied (NaN or infinite) is counted; `trainer.max_bad_steps` of them
        in a row stop the run."""
        cfg, every, max_bad = self.config.controller, self.config.checkpoint.every, self.config.trainer.max_bad_steps
        batch = None
        if self.rows.done < step:
            start, busy = time.perf_counter(), self._busy()
            batch = await self._next_batch(step - 1)
        with self.signals.holding():  # a stop waits for the step: a checkpoint now would hold half of it
            if batch is not None:
                row = await self._step(step, batch, start)
                row["step_time_s"] = time.perf_counter() - start
                row["generator_busy"], row["trainer_busy"] = (
                    (b - a) / row["step_time_s"] for a, b in zip(busy, self._busy()))
                if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
                    await self._published()  # the policy just trained is the one evaluated
                    row |= await self.collector.evaluate(step)
                self.work.trained(batch.index)
                try:  # its rollout records written (by the buffer, which holds them) before its row says it is done
                    async with deadline(self.timeouts.buffer, "replay_buffer", "trained"):
                        await self.buffer.trained.call_one(batch.index, step)
                finally:  # a buffer dying now is restarted (its records die with it); the step is not trained again
                    self.rows.log(row)
                await self._reward_errors(row)
                if self.rows.bad_steps:
                    logger.warning("step %d: %d of its updates had a NaN or infinite loss or gradient norm and "
                                   "were not applied", step, row["updates_skipped"])
                if self.rows.bad_steps >= max_bad:
                    raise RoleFailed(f"{self.rows.bad_steps} steps in a row had a NaN or infinite loss or gradient "
                                     f"norm (trainer.max_bad_steps {max_bad}); the newest checkpoint, "
                                     f"{latest(self.checkpointer.run_dir) or 'none'}, is from before them")
            if every and step % every == 0 and step < cfg.steps:
                await self.checkpoint()

    async def _reward_errors(self, row: dict) -> None:
        """A warning line when the step's share of replies the reward function raised on passes
        `grader.warn_error_fraction`; TooManyFailures when it stayed above `grader.max_error_fraction` for
        `grader.max_error_steps` steps in a row."""
        g = self.config.grader
        warn = reward_error_warning(row, g.warn_error_fraction, "") is not None
        stop = reward_error_stop(self.rows.rows, g.max_error_fraction, g.max_error_steps) is not None
        if warn or stop:
            first = await self.collector.first_reward_error()
            if warn:
                logger.warning(reward_error_warning(row, g.warn_error_fraction, first))
            if stop:
                raise TooManyFailures(reward_error_stop(self.rows.rows, g.max_error_fraction, g.max_error_steps, first))

    async def _next_batch(self, index: int) -> Batch:
        """Batch `index` once complete; re-raises if the rollout loop, the last publish (whose version
        the batch may be waiting for) or the replay buffer (failing a group's stage) failed, instead of
        waiting forever."""
        while (batch := self.work.batch(index)) is None:
            if self.publishing and self.publishing.done():
                self.publishing.result()  # raises the publish's error (it may have failed before this wait)
            if error := self.collector.failed_buffer():  # no group can finish into it: restarted by _train
                raise error
            self.collector.batch_ready.clear()
            ready = asyncio.ensure_future(self.collector.batch_ready.wait())
            # a publish still running may fail: wake up for it too (not for one already done, which would spin)
            publishing = {self.publishing} if self.publishing and not self.publishing.done() else set()
            try:
                await asyncio.wait({ready, self.rollouts, *publishing}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                ready.cancel()
            if self.publishing and self.publishing.done():
                self.publishing.result()
            if self.rollouts.done():
                self.rollouts.result()  # raises the rollout loop's error
                if self.work.batch(index) is None:
                    raise RuntimeError(f"the rollout loop ended without batch {index}")
        return batch

    async def _step(self, step: int, batch: Batch, start: float) -> dict:
        """Train `batch` at its policy version, publish the next one; the step's row (without eval). A
        batch with nothing to train (every group dropped) trains nothing: 0 updates, no lr step."""
        t1 = time.perf_counter()
        self._bookkeep()
        await self._sleep_generators()
        await self.buffer_calls.sent()
        async with self.tracer.span("replay_buffer", "sample", batch.index, timeout=self.timeouts.buffer):
            plan = await self.buffer.sample.call_one(batch.index, batch.groups)
        updates = [[BatchRef(batch.index, u, m) for m in range(count)] for u, count in enumerate(plan.pop("micro_batches"))]
        if not any(updates):  # train_updates steps no optimizer and no lr schedule for it
            logger.warning("step %d: its batch has no episode to train (every group dropped); nothing is trained, "
                           "the policy is published unchanged", step)
        self.training = {"updates": 0}  # while the step trains: how many of its updates are applied
        try:
            train = plan | await train_updates(self.trainer, self.reference, updates, self.config.trainer,
                                               self.tracer.span, batch.index, self.config.reference.ranks, self.timeouts,
                                               self.training)
        except ActorError:  # the ranks take their micro-batches from the buffer: its death fails their calls
            async with deadline(self.timeouts.buffer, "replay_buffer", "logged"):
                await self.buffer.logged.call_one()  # raises the buffer's own failure: restarted by _train
            raise
        self.training = None
        t2 = time.perf_counter()
        await self._published()  # the last step's: done, since this step's optimizer update waited for it
        version = self.trainer_version + 1
        self.publishing = asyncio.ensure_future(self._publish(version, batch.index + 1))
        t3 = time.perf_counter()
        self.trainer_busy += t3 - t1
        figures, self.figures = self.figures, no_figures()  # what the bookkeeping brought so far
        kept, moved = self.generators.kept, self.generators.moved
        routed = {"generator_calls_kept": kept - self.routed[0], "generator_calls_moved": moved - self.routed[1]}
        self.routed = (kept, moved)
        counters = {**routed, "generator_restarts": self.generators.restarts,
                    "generator_calls_retried": self.generators.retried,
                    "grader_restarts": self.graders.restarts, "grader_calls_retried": self.graders.retried,
                    "trainer_restarts": self.restarts.count["trainer"],
                    "reference_restarts": self.restarts.count["reference"],
                    "replay_buffer_restarts": self.restarts.count["replay_buffer"],
                    "restart_seconds": self.restarts.seconds_lost,
                    **self.updates, "batches_ready": len(self.work.ready) - 1}
        counters |= {**self.collector.take_counts(), "weight_bytes_egress": figures["egress"]}
        # what the batch held, the replicas' counters, what training did (the plan's staleness among it); the
        # loop's wait for the last publish before starting this one, and the slowest generator load reported
        # since the last row (gathered beside the loop, never waited for)
        row = {"step": step, "policy_version": version, **batch.stats, **counters, **cache_figures(figures), **train,
               "train_time_s": t2 - t1, "publish_wait_s": t3 - t2, "longest_load_s": figures["pull"],
               "weight_transfer_s": figures["transfer"], "weight_load_s": figures["load"],
               "wait_time_s": t1 - start}
        row["generator_idle"] = max(0.0, 1 - figures["busy"] / self.config.generator.replicas
                                    / (time.perf_counter() - start))
        return row

    async def _sleep_generators(self) -> None:
        """Synchronous training: replicas sharing their GPUs with the ranks free their memory while the step
        trains (vLLM's sleep mode, generator.engine.sleep); each wakes at its next call. Bookkeeping: bounded,
        a replica failing now is the pool's to find."""
        if self.config.controller.max_policy_age or self.config.generator.engine.sleep == "off":
            return

        async def ask(replica):
            async with deadline(self.timeouts.generate, "generator", "sleep"):
                await replica.actor.sleep.call_one()

        await asyncio.gather(*(ask(r) for r in self.generators.replicas if r.healthy and hasattr(r.actor, "sleep")),
                             return_exceptions=True)

    async def _publish(self, version: int, trace_version: int) -> None:
        """The trainer's publish of `version`; once readable, the generators and the gate are told."""
        async with self.tracer.span("trainer", "publish", trace_version, timeout=self.timeouts.trainer) as span:
            published = span["policy_version"] = await first(self.trainer.publish_weights.call())
        if published != version:
            raise RuntimeError(f"the trainer published version {published}, expected {version}")
        self.trainer_version = published
        self.collector.published(published)

    async def _published(self) -> None:
        """Wait for the newest publish (raising its error, if it failed)."""
        if self.publishing:
            await self.publishing

    def _generator_report(self, replica: int, report: dict) -> None:
        """What a generate answer brought of its replica's loads and busy time: into the next row's figures."""
        absorb(replica, report, self.tracer, self.figures, self.updates)

    def _bookkeep(self) -> None:
        """Gather the trainer's and the buffer's reports beside the loop (not awaited: a row reports what has
        arrived, the rest goes in the next). The generators' come with their answers."""
        if self.bookkeeping is None or self.bookkeeping.done():
            self.bookkeeping = asyncio.ensure_future(self._bookkeeping())

    async def _bookkeeping(self, generators: list | None = None) -> None:
        """The trainer's and the replay buffer's spans (into the trace) and the weights' egress, since the last
        time; with `generators` (the run's end: the replicas whose calls it stopped), what each did since its
        last answer (loads into the trace and `figures`); a role failing now is for the loops to find."""
        asked = [gather_reports(generators, self.timeouts.generate, self.tracer, self.figures,
                                self.updates)] if generators else []
        await asyncio.gather(
            *asked, self._spans(self.trainer, "trainer", self.timeouts.trainer),
            self._spans(self.buffer, "replay_buffer", self.timeouts.buffer), self._egress(), return_exceptions=True)

    async def _egress(self) -> None:
        if self.egress is not None:
            self.figures["egress"] += await self.egress()

    async def _spans(self, mesh, role: str, timeout) -> None:
        """The spans `role`'s actors timed since the last call (each rank's), into the trace."""
        async with deadline(timeout, role, "spans"):
            ranks = await in_rank_order(mesh.spans.call())
        for rank, spans in enumerate(ranks):
            for s in spans:
                self.tracer.add(role, s["what"], s["start"], s["end"], rank, s["policy_version"])

    def _busy(self) -> tuple[float, float]:
        """Seconds worked so far: by the average generator replica, by the trainer."""
        return self.generators.busy_seconds() / self.config.generator.replicas, self.trainer_busy
