"""The controller: spawns one proc mesh per actor and runs the two loops.

Completions (generator replicas) -> ScoredCompletions (grader replicas) -> Episodes with group
advantages (meshrl/rollout.py) -> ReplayBuffer -> TrainBatches (trainer, meshrl/train_step.py) ->
weight ring -> generators. A rollout loop (one prompt's group at a time, across the replicas) and a
training loop run concurrently; `replay_buffer.max_policy_age` bounds how far the rollouts may run
ahead (the staleness gate), and 0 makes the two alternate: synchronous training on the same code path.
A generator or grader replica that dies or stops answering is replaced (meshrl/replicas.py); the
trainer, the replay buffer or the reference dying or timing out ends the run with one line, after
writing what there is. Each role runs on the hosts its config names (meshrl/jobs.py).
"""

import asyncio
import json
import logging
import math
import statistics
import time
from pathlib import Path

import monarch.actor
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from tqdm import tqdm

from meshrl import checkpoint
from meshrl.actors import first, in_rank_order
from meshrl.configs import Config, to_dict
from meshrl.jobs import Hosts, make_job, plan
from meshrl.launch import (Actors, StopSignals, actor_classes, check_config, generator_args, note_fault,
                           spawn_actors)
from meshrl.loggers import MetricLoggers, RolloutRecorder
from meshrl.model import ChatTokenizer, resolve_checkpoint
from meshrl.plot import plot_curves
from meshrl.replicas import Replica, ReplicaPool, RoleFailed, describe, processes
from meshrl.rollout import Rollout, RolloutCollector
from meshrl.tasks import make_task, task_config
from meshrl.timeouts import CallTimeout, Timeouts
from meshrl.trace import Tracer
from meshrl.train_step import train_step

logger = logging.getLogger(__name__)


class Controller:
    """One loop for sync and async training: `replay_buffer.max_policy_age` sets how far ahead of the
    trainer the rollouts may run (0: generate, then train, strictly alternating)."""

    def __init__(self, config: Config, run_dir: Path, resume_from: Path | None = None):
        """`resume_from`: a checkpoint of this run (`meshrl train --resume`) to go on from."""
        check_config(config)
        self.placement = plan(config)
        self.timeouts = Timeouts.of(config)
        self.config = config
        self.run_dir = run_dir
        self.task = make_task(config.task, task_config(config))
        self.classes = actor_classes(config)
        self.checkpoint = resolve_checkpoint(config.model.source)
        self.tokenizer = ChatTokenizer(self.checkpoint)
        self.actors: Actors | None = None
        self.hosts: Hosts | None = None
        self.signals = StopSignals()
        self.trainer_stuck = False  # a trainer call timed out
        self.transports: dict[str, str] = {}  # generator replica -> the weight transport it chose
        self.resume_from = resume_from
        self.rows: list[dict] = []  # metrics.jsonl's rows
        self.initial: dict = {}  # the eval before training
        self.bad_steps = 0  # steps in a row with an update not applied (NaN or infinite)
        self.rollouts_open = asyncio.Event()  # cleared while a checkpoint settles the data position
        self.rollouts_parked = asyncio.Event()  # the rollout loop waits for rollouts_open
        self.trainer_version = 0  # the newest version the trainer published
        self.rollouts: asyncio.Queue[Rollout] = asyncio.Queue()
        self.rollout_task: asyncio.Task | None = None
        self.trainer_busy = 0.0  # seconds the trainer has spent working
        self.generators: ReplicaPool | None = None
        self.graders: ReplicaPool | None = None

    async def run(self) -> dict:
        """Train for `controller.steps` steps; return (and write to summary.json) the eval rates before
        and after. Ctrl-C or SIGTERM stops it within one actor call: the policy trained so far is
        saved to final/ and everything written so far is kept (`stopped_by` in the summary). A role
        that can no longer work (replicas out of restarts, the trainer's process dead) stops it the
        same way, then raises RoleFailed with one line."""
        start = time.perf_counter()
        resumed = checkpoint.load(self.resume_from) if self.resume_from else None
        if resumed:
            self.rows, self.initial = resumed.rows, resumed.initial
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(to_dict(self.config), indent=2))
        metrics = MetricLoggers(self.run_dir, self.config, name=self.run_dir.name, resumed_rows=self.rows)
        self.recorder = RolloutRecorder(self.run_dir, self.config.logging.rollouts_fraction,
                                        resumed.step if resumed else None)
        self.tracer = Tracer(self.run_dir, resume=resumed is not None)
        monarch.actor.unhandled_fault_hook = note_fault  # failures reach us as errors of the calls
        failure, saved = None, False
        try:
            self.hosts = await self._start_job()
            self.actors = await spawn_actors(self.config, self.classes, self.checkpoint, self.hosts)
            self.signals.install()
            try:
                self.signals.cancellable = True
                if resumed:
                    await self._restore_actors(resumed)
                await self._start_pools()
                if resumed:
                    self._restore_position(resumed)
                else:
                    self.initial = await self.collector.evaluate(step=0)
                self.rollouts_open.set()
                self.rollout_task = asyncio.create_task(self._rollout_loop())
                await self._train(metrics)
            except asyncio.CancelledError:
                if self.signals.stopped_by is None:
                    raise
                asyncio.current_task().uncancel()  # a requested stop: save and write what there is
            except (RoleFailed, SupervisionError, CallTimeout) as e:  # a role died or hung: write what there is
                failure = describe(e) if isinstance(e, SupervisionError) else str(e)
                if isinstance(e, CallTimeout) and e.role == "trainer":
                    self.trainer_stuck = True  # it would not answer the save either
            finally:
                self.signals.cancellable = False
            if failure is None and self.rows and not self.signals.held:  # the end, or a stop between steps
                try:
                    await self._checkpoint(stop_running=True)
                except (RoleFailed, SupervisionError, CallTimeout) as e:
                    failure = f"the last checkpoint could not be written: {describe(e)}"
            saved = await self._save()
        finally:
            self.signals.release()
            metrics.close()
            self.recorder.close()
            await self._stop_actors()
            if self.hosts:
                self.hosts.kill()
            self.tracer.close()
        rows, initial = self.rows, self.initial
        if rows:
            plot_curves(rows, initial, self.run_dir / "curves.png")
        final = {k: v for k, v in rows[-1].items() if k.startswith("eval_")} if rows else {}
        summary = {**{f"{k}_initial": v for k, v in initial.items()}, **{f"{k}_final": v for k, v in final.items()},
                   "steps": len(rows), "wall_time_s": time.perf_counter() - start,
                   **({"stopped_by": self.signals.stopped_by} if self.signals.stopped_by else {}),
                   **({"failed": failure} if failure else {})}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if failure:
            kept = "metrics, rollouts, trace" + (" and the policy (final/)" if saved else "")
            raise RoleFailed(f"{failure} (after {len(rows)} steps; {kept} are in {self.run_dir})")
        return summary

    async def _start_pools(self) -> None:
        """The generator and grader replicas on their hosts, each generator attached to the trainer's
        weight ring; then processes.json and placement.json say where every actor runs."""
        timeouts = self.timeouts
        async with self.tracer.span("trainer", "attach", timeout=timeouts.trainer):
            rings = await in_rank_order(self.actors.trainer.weight_ring.call())

        async def attach(replica: Replica) -> None:
            async with self.tracer.span("generator", "attach", replica=replica.index, timeout=timeouts.generate):
                transport = await replica.actor.attach_weights.call_one(rings)
            self.transports[self.generators.name(replica.index)] = transport

        cfg, pids, hosts = self.config, {}, {}

        def write_processes() -> None:
            for pool in (self.generators, self.graders):
                pids.update(pool.pids())
                hosts.update(pool.hosts())
            (self.run_dir / "processes.json").write_text(json.dumps(pids, indent=2))
            placement = {name: {"host": host, **({"weight_transport": self.transports[name]}
                                                  if name in self.transports else {})} for name, host in hosts.items()}
            (self.run_dir / "placement.json").write_text(json.dumps({"job": cfg.job.kind, **placement}, indent=2))

        self.generators = ReplicaPool("generator", self.classes["generator"],
                                      lambda i: generator_args(cfg, i, self.checkpoint), cfg.generator.replicas,
                                      cfg.generator.max_restarts, setup=attach, on_replaced=write_processes,
                                      host=lambda i: self.hosts.host("generator", i), start_timeout=timeouts.generate)
        self.graders = ReplicaPool("grader", self.classes["grader"], lambda i: (cfg.task, task_config(cfg)),
                                   cfg.grader.replicas, cfg.grader.max_restarts, on_replaced=write_processes,
                                   host=lambda i: self.hosts.host("grader", i), start_timeout=timeouts.grade)
        await asyncio.gather(self.generators.start(), self.graders.start())
        self.collector = RolloutCollector(cfg, self.task, self.tokenizer, self.generators, self.graders,
                                          self.actors.replay_buffer, self.tracer, timeouts)
        for role, procs in zip(("trainer", "replay_buffer", "reference"), self.actors.procs):
            where = await processes(procs, role)  # the trainer's: one per rank
            hosts[role], pids[role] = ([h for h, _ in where], [p for _, p in where]) if len(where) > 1 else where[0]
        write_processes()
        if cfg.job.kind != "local":
            tqdm.write("placement: " + ", ".join(f"{name} on {host}" + (f" ({self.transports[name]})"
                                                                       if name in self.transports else "")
                                                 for name, host in hosts.items()))

    async def _train(self, metrics: MetricLoggers) -> None:
        """Steps after the last one done (0, or the resumed checkpoint's) up to `controller.steps`, a
        checkpoint every `checkpoint.every`. A step whose update was not applied (NaN or infinite) is
        counted; `trainer.max_bad_steps` of them in a row stop the run."""
        cfg, done = self.config.controller, len(self.rows)
        every, max_bad = self.config.checkpoint.every, self.config.trainer.max_bad_steps
        with tqdm(range(done + 1, cfg.steps + 1), initial=done, total=cfg.steps, unit="step") as bar:
            last, busy = time.perf_counter(), self._busy()
            for step in bar:
                row = await self.train_step(step)
                now = time.perf_counter()
                row["step_time_s"] = now - last
                row["generator_busy"], row["trainer_busy"] = (
                    (b - a) / row["step_time_s"] for a, b in zip(busy, self._busy()))
                self.bad_steps = self.bad_steps + 1 if row["updates_skipped"] else 0
                row["steps_skipped"] = (self.rows[-1]["steps_skipped"] if self.rows else 0) + bool(self.bad_steps)
                if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
                    row |= await self.collector.evaluate(step)
                self.rows.append(row)
                metrics.log(row)
                self.signals.release_hold()  # the step is whole: trained, published and logged
                bar.set_postfix(reward=f"{row['reward_mean']:.2f}", acc=f"{row['accuracy']:.2f}")
                if self.bad_steps:
                    logger.warning("step %d: %d of its updates had a NaN or infinite loss or gradient norm and "
                                   "were not applied", step, row["updates_skipped"])
                if self.bad_steps >= max_bad:
                    newest = checkpoint.latest(self.run_dir)
                    raise RoleFailed(f"{self.bad_steps} steps in a row had a NaN or infinite loss or gradient norm "
                                     f"(trainer.max_bad_steps {max_bad}); the newest checkpoint, "
                                     f"{newest or 'none'}, is from before them")
                if every and step % every == 0 and step < cfg.steps:
                    await self._checkpoint()
                last, busy = time.perf_counter(), self._busy()

    async def _checkpoint(self, stop_running: bool = False) -> None:
        """Everything that decides what comes next, after the last step (meshrl/checkpoint.py). The
        rollout loop waits meanwhile; the groups it has generating finish first (at a stop, they are
        stopped and their prompts kept to run first after the resume). Not after a step with an
        update not applied: the newest checkpoint stays the last good one."""
        step = len(self.rows)
        if self.bad_steps or (self.run_dir / checkpoint.DIR / f"step-{step}").exists():
            return
        c = self.collector
        if self.rollout_task is not None and not self.rollout_task.done():
            await self._park_rollouts()
        try:
            for rollout in await c.settle(stop_running):
                self.rollouts.put_nowait(rollout)
            queued = [self.rollouts.get_nowait() for _ in range(self.rollouts.qsize())]
            for rollout in queued:
                self.rollouts.put_nowait(rollout)
            position = c.snapshot()
            partial = checkpoint.begin(self.run_dir, step)
            async with self.tracer.span("trainer", "save_state", self.trainer_version, timeout=self.timeouts.trainer):
                await in_rank_order(self.actors.trainer.save_state.call(str(partial / "trainer")))
            async with self.tracer.span("replay_buffer", "state", timeout=self.timeouts.replay_buffer):
                buffer = await self.actors.replay_buffer.state.call_one()
            counters = {"generator": (self.generators.restarts, self.generators.requeued),
                        "grader": (self.graders.restarts, self.graders.requeued)}
            checkpoint.commit(partial, checkpoint.RunState(step, self.trainer_version, position, queued, buffer,
                                                           self.rows, self.initial, counters),
                              self.config.checkpoint.keep)
        finally:
            self.rollouts_open.set()

    async def _park_rollouts(self) -> None:
        """Have the rollout loop wait at the top of its loop (not inside a batch's hand-over)."""
        self.rollouts_open.clear()
        self.collector.finished.put_nowait(None)  # wakes it if it waits for a group
        parked = asyncio.ensure_future(self.rollouts_parked.wait())
        await asyncio.wait({parked, self.rollout_task}, return_when=asyncio.FIRST_COMPLETED)
        parked.cancel()
        if self.rollout_task.done() and not self.rollout_task.cancelled() and self.rollout_task.exception():
            raise self.rollout_task.exception()

    async def _restore_actors(self, state: checkpoint.RunState) -> None:
        """The trainer's policy, optimizer and version, and the replay buffer's episodes, as checkpointed;
        the trainer publishes the policy so the generators load it before they sample."""
        async with self.tracer.span("trainer", "load_state", state.trainer_version, timeout=self.timeouts.trainer):
            versions = await in_rank_order(self.actors.trainer.load_state.call(str(self.resume_from / "trainer")))
        async with self.tracer.span("replay_buffer", "load_state", timeout=self.timeouts.replay_buffer):
            await self.actors.replay_buffer.load_state.call_one(state.buffer)
        self.trainer_version = versions[0]

    def _restore_position(self, state: checkpoint.RunState) -> None:
        """The data position and the counters, once the pools run."""
        self.collector.restore(state.collector)
        for rollout in state.queued:
            self.rollouts.put_nowait(rollout)
        (self.generators.restarts, self.generators.requeued), (self.graders.restarts, self.graders.requeued) = (
            state.counters["generator"], state.counters["grader"])
        tqdm.write(f"resumed from {self.resume_from} (step {state.step}, policy version {self.trainer_version})")

    def _busy(self) -> tuple[float, float]:
        """Seconds worked so far: by the average generator replica, by the trainer."""
        return self.generators.busy_seconds() / self.config.generator.replicas, self.trainer_busy

    async def _start_job(self) -> Hosts:
        """The job's host meshes, connected (the controller's own host for a local job); one line and
        nothing left running if the job cannot start or its hosts cannot be reached."""
        job = self.config.job
        if job.kind == "slurm":
            (self.run_dir / "job").mkdir(exist_ok=True)  # sbatch's output
        launched = None
        try:
            launched = make_job(job, self.run_dir / "job")
            hosts = Hosts(launched, self.placement)
            await hosts.connected()
            return hosts
        except Exception as e:
            if launched is not None:
                launched.kill()
            raise RoleFailed(f"the {job.kind} job did not start: {describe(e)}") from None

    async def _save(self) -> bool:
        """The current policy to final/; False (and a log line) if the trainer cannot."""
        if self.trainer_stuck or self.actors is None:
            return False
        try:
            async with self.tracer.span("trainer", "save", self.trainer_version, timeout=self.timeouts.trainer):
                await self.actors.trainer.save.call(str(self.run_dir / "final"))
            return True
        except Exception as e:
            logger.error("the policy could not be saved: %s", str(e).strip().splitlines()[0])
            return False

    async def _stop_actors(self) -> None:
        if self.rollout_task:
            self.rollout_task.cancel()
            await asyncio.gather(self.rollout_task, return_exceptions=True)
        # all at once; a dead process's mesh may refuse to stop, and the others still stop
        pools = [pool.stop() for pool in (self.generators, self.graders) if pool]
        meshes = self.actors.procs if self.actors else []
        await asyncio.gather(*pools, *(mesh.stop() for mesh in meshes), return_exceptions=True)

    async def _rollout_loop(self) -> None:
        """Keep groups in flight across the generator replicas, never more than max_policy_age ahead.

        A group started now helps fill batch b (`collector.next_batch()`); batch b feeds step b + 1,
        which trains at trainer version b, so the group may start only once version b - max_policy_age
        is published (its replica loads the newest version before generating)."""
        max_age, c = self.config.replay_buffer.max_policy_age, self.collector
        try:
            while c.batches_done < self.config.controller.steps:
                if not self.rollouts_open.is_set():  # a checkpoint settles the data position meanwhile
                    self.rollouts_parked.set()
                    await self.rollouts_open.wait()
                    self.rollouts_parked.clear()
                while (batch := c.next_batch()) is not None and self.trainer_version >= batch - max_age:
                    c.launch()
                if rollout := await c.next_rollout():
                    await self.rollouts.put(rollout)
        finally:
            await c.stop()

    async def _next_rollout(self) -> Rollout:
        """The next buffered batch; re-raises if the rollout loop died instead of waiting forever."""
        get = asyncio.ensure_future(self.rollouts.get())
        await asyncio.wait({get, self.rollout_task}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            self.rollout_task.result()  # raises the rollout loop's error
            raise RuntimeError("the rollout loop ended before the last train step")
        return get.result()

    async def train_step(self, step: int) -> dict:
        a = self.actors
        t0 = time.perf_counter()
        trained_version = self.trainer_version
        rollout = await self._next_rollout()
        # A batch that went stale waiting is evicted by the buffer (and counted); train on the next.
        while (episodes := await self._sample(trained_version, rollout.num_episodes)) is None:
            rollout = await self._next_rollout()
        t1 = time.perf_counter()
        self.signals.hold()  # until the step is logged a stop waits: a checkpoint now would hold half of it
        train = await train_step(a.trainer, a.reference, episodes, self.config.trainer, self.tokenizer.pad_id,
                                 self.tracer.span, trained_version, self.config.reference.ranks, self.timeouts)
        t2 = time.perf_counter()
        async with self.tracer.span("trainer", "publish", trained_version + 1,
                                    timeout=self.timeouts.trainer) as span:
            published = span["policy_version"] = await first(a.trainer.publish_weights.call())
        t3 = time.perf_counter()
        self.trainer_busy += t3 - t1
        self.trainer_version = published
        self.collector.published(published)
        self.recorder.write(step, trained_version, rollout.records)
        staleness = [trained_version - e.policy_version for e in episodes] or [0]  # [0]: nothing to train
        rewards = rollout.rewards
        return {
            "step": step,
            "policy_version": published,
            "reward_mean": statistics.fmean(rewards) if rewards else math.nan,
            "reward_std": statistics.pstdev(rewards) if rewards else math.nan,
            **rollout.checks,
            "reward_errors": rollout.reward_errors,
            "equal_reward_groups": rollout.equal_reward_groups,
            "groups_dropped": rollout.groups_dropped,
            "groups_stale": rollout.groups_stale,
            "episodes": rollout.num_episodes,
            "turns_mean": rollout.turns_mean,
            "generator_restarts": self.generators.restarts,
            "groups_requeued": self.generators.requeued,
            "grader_restarts": self.graders.restarts,
            **train,
            "tokens_generated": rollout.tokens_generated,
            "gen_time_s": rollout.gen_time_s,
            "rollout_time_s": rollout.rollout_time_s,
            "train_time_s": t2 - t1,
            "weight_sync_s": rollout.pull_time_s + t3 - t2,
            "wait_time_s": t1 - t0,
            "staleness_mean": statistics.fmean(staleness),
            "staleness_max": max(staleness),
            **await self._buffer_stats(),
        }

    async def _sample(self, trained_version: int, n: int):
        async with self.tracer.span("replay_buffer", "sample", trained_version, timeout=self.timeouts.replay_buffer):
            return await self.actors.replay_buffer.sample.call_one(trained_version, n)

    async def _buffer_stats(self) -> dict:
        async with self.tracer.span("replay_buffer", "stats", timeout=self.timeouts.replay_buffer):
            return await self.actors.replay_buffer.stats.call_one()
