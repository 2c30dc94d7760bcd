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
import dataclasses
import json
import logging
import math
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import monarch.actor
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from tqdm import tqdm

from meshrl.actors import first, in_rank_order, load_actor_class, placement, spawn, spawn_ranks
from meshrl.actors.roles import ROLES, missing_endpoints
from meshrl.advantages import estimator
from meshrl.configs import Config, to_dict
from meshrl.jobs import Hosts, make_job, plan
from meshrl.loggers import MetricLoggers, RolloutRecorder
from meshrl.losses import check as check_loss
from meshrl.model import ChatTokenizer, resolve_checkpoint
from meshrl.plot import plot_curves
from meshrl.replicas import Replica, ReplicaPool, RoleFailed, describe, processes
from meshrl.rollout import Rollout, RolloutCollector
from meshrl.tasks import make_task
from meshrl.timeouts import CallTimeout, Timeouts
from meshrl.trace import Tracer
from meshrl.train_step import train_step

if TYPE_CHECKING:
    from monarch._src.actor.actor_mesh import ActorMesh

    from meshrl.actors import roles

logger = logging.getLogger(__name__)


@dataclass
class Actors:
    """Handles to the single actors' meshes (the generators and graders are pools of replicas, whose
    actors follow roles.Generator and roles.Grader); meshrl/actors/roles.py says what each must answer."""

    trainer: "ActorMesh[roles.Trainer]"
    replay_buffer: "ActorMesh[roles.ReplayBuffer]"
    procs: list  # the proc meshes, to stop
    reference: "ActorMesh[roles.Reference] | None" = None


def actor_classes(config: Config) -> dict[str, type]:
    """The implementation each role's config names (checked before anything starts)."""
    roles = {"generator": config.generator, "grader": config.grader, "trainer": config.trainer,
             "replay_buffer": config.replay_buffer}
    if config.trainer.loss.kl_coef > 0:
        roles["reference"] = config.reference
    classes = {role: load_actor_class(role_config.impl) for role, role_config in roles.items()}
    for role, cls in classes.items():
        if missing := missing_endpoints(role, cls):
            raise ValueError(f"{roles[role].impl} cannot be the {role}: it has no {', '.join(missing)} endpoint "
                             f"(the contract is meshrl.actors.roles.{ROLES[role].__name__})")
    return classes


async def spawn_actors(config: Config, classes: dict[str, type], checkpoint: Path, hosts: Hosts) -> Actors:
    """One proc mesh per role besides the pools, on the hosts each role's config names: the trainer's
    (`trainer.ranks` processes), the replay buffer's and the reference's (`reference.ranks`)."""
    procs, trainer = await spawn_ranks("trainer", classes["trainer"], config.trainer.ranks, config.trainer,
                                       config.weight_sync, str(checkpoint), hosts=hosts.of("trainer"))
    actors, meshes = {"trainer": trainer}, [procs]
    procs, actors["replay_buffer"] = spawn("replay_buffer", classes["replay_buffer"], config.replay_buffer,
                                           host=hosts.host("replay_buffer", 0))
    meshes.append(procs)
    if "reference" in classes:
        procs, actors["reference"] = await spawn_ranks("reference", classes["reference"], config.reference.ranks,
                                                       config.reference, str(checkpoint),
                                                       hosts=hosts.of("reference"))
        meshes.append(procs)
    return Actors(**actors, procs=meshes)


def generator_args(config: Config, index: int, checkpoint: Path) -> tuple:
    """Replica `index`'s constructor arguments: its own cores ("0;1": one set per replica) and seed."""
    replica = dataclasses.replace(config.generator, cpus=placement(config.generator.cpus, index),
                                  seed=config.generator.seed + index)
    return replica, config.weight_sync, str(checkpoint)


class Controller:
    """One loop for sync and async training: `replay_buffer.max_policy_age` sets how far ahead of the
    trainer the rollouts may run (0: generate, then train, strictly alternating)."""

    def __init__(self, config: Config, run_dir: Path):
        cfg = config.controller
        if cfg.steps < 1 or cfg.prompts_per_step < 1 or cfg.eval_samples < 1:
            raise ValueError("controller.steps, prompts_per_step and eval_samples must be at least 1")
        if cfg.group_size < 2:
            raise ValueError("controller.group_size must be at least 2: a group of one has no advantage to learn from")
        if config.trainer.mini_batches < 1 or config.trainer.micro_batch_size < 1:
            raise ValueError("trainer.mini_batches and trainer.micro_batch_size must be at least 1")
        if config.logging.wandb_mode not in ("auto", "online", "offline"):
            raise ValueError(f"unknown logging.wandb_mode {config.logging.wandb_mode!r}; known: auto, online, offline")
        if config.replay_buffer.max_policy_age < 0:
            raise ValueError("replay_buffer.max_policy_age must be at least 0")
        if min(config.generator.replicas, config.grader.replicas, config.trainer.ranks, config.reference.ranks) < 1:
            raise ValueError("generator.replicas, grader.replicas, trainer.ranks and reference.ranks must be at least 1")
        if ";" in config.generator.cpus and len(config.generator.cpus.split(";")) != config.generator.replicas:
            raise ValueError(f"generator.cpus {config.generator.cpus!r} names one set of cores per replica: "
                             f"it needs {config.generator.replicas} sets separated by ';'")
        estimator(cfg.advantage)
        check_loss(config.trainer.loss)
        self.placement = plan(config)
        self.timeouts = Timeouts.of(config)
        self.config = config
        self.run_dir = run_dir
        self.task = make_task(config.task, config.task_config)
        self.classes = actor_classes(config)
        self.checkpoint = resolve_checkpoint(config.model.source)
        self.tokenizer = ChatTokenizer(self.checkpoint)
        self.actors: Actors | None = None
        self.hosts: Hosts | None = None
        self.stopped_by: str | None = None  # the signal that stopped the run
        self.cancellable = False
        self.trainer_stuck = False  # a trainer call timed out
        self.transports: dict[str, str] = {}  # generator replica -> the weight transport it chose
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
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(to_dict(self.config), indent=2))
        metrics = MetricLoggers(self.run_dir, self.config, name=self.run_dir.name)
        self.recorder = RolloutRecorder(self.run_dir, self.config.logging.rollouts_fraction)
        self.tracer = Tracer(self.run_dir)
        monarch.actor.unhandled_fault_hook = _note_fault  # failures reach us as errors of the calls
        rows, initial, failure, saved = [], {}, None, False
        try:
            self.hosts = await self._start_job()
            self.actors = await spawn_actors(self.config, self.classes, self.checkpoint, self.hosts)
            self._catch_stop_signals()
            try:
                self.cancellable = True
                await self._start_pools()
                initial = await self.collector.evaluate(step=0)
                self.rollout_task = asyncio.create_task(self._rollout_loop())
                await self._train(metrics, rows)
            except asyncio.CancelledError:
                if self.stopped_by is None:
                    raise
                asyncio.current_task().uncancel()  # a requested stop: save and write what there is
            except (RoleFailed, SupervisionError, CallTimeout) as e:  # a role died or hung: write what there is
                failure = describe(e) if isinstance(e, SupervisionError) else str(e)
                if isinstance(e, CallTimeout) and e.role == "trainer":
                    self.trainer_stuck = True  # it would not answer the save either
            finally:
                self.cancellable = False
            saved = await self._save()
        finally:
            self._release_stop_signals()
            metrics.close()
            self.recorder.close()
            await self._stop_actors()
            if self.hosts:
                self.hosts.kill()
            self.tracer.close()
        if rows:
            plot_curves(rows, initial, self.run_dir / "curves.png")
        final = {k: v for k, v in rows[-1].items() if k.startswith("eval_")} if rows else {}
        summary = {**{f"{k}_initial": v for k, v in initial.items()}, **{f"{k}_final": v for k, v in final.items()},
                   "steps": len(rows), "wall_time_s": time.perf_counter() - start,
                   **({"stopped_by": self.stopped_by} if self.stopped_by else {}),
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
        self.graders = ReplicaPool("grader", self.classes["grader"], lambda i: (cfg.task, cfg.task_config),
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

    async def _train(self, metrics: MetricLoggers, rows: list[dict]) -> None:
        cfg = self.config.controller
        with tqdm(range(1, cfg.steps + 1), unit="step") as bar:
            last, busy = time.perf_counter(), self._busy()
            for step in bar:
                row = await self.train_step(step)
                now = time.perf_counter()
                row["step_time_s"] = now - last
                row["generator_busy"], row["trainer_busy"] = (
                    (b - a) / row["step_time_s"] for a, b in zip(busy, self._busy()))
                if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
                    row |= await self.collector.evaluate(step)
                last, busy = time.perf_counter(), self._busy()
                rows.append(row)
                metrics.log(row)
                bar.set_postfix(reward=f"{row['reward_mean']:.2f}", acc=f"{row['accuracy']:.2f}")

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

    def _catch_stop_signals(self) -> None:
        """Ctrl-C (SIGINT) or SIGTERM cancels the training; `run` then saves and writes what it has.

        Installed once the actors run: Monarch's runtime replaces the process's SIGINT handler beneath
        Python's, so asyncio's own Ctrl-C handling never fires. A second signal while stopping is
        ignored: stopping takes one actor call and the save."""
        loop, task = asyncio.get_running_loop(), asyncio.current_task()

        def stop(sig: signal.Signals) -> None:
            if self.stopped_by is None:
                self.stopped_by = sig.name
                tqdm.write(f"{sig.name}: stopping; saving the policy trained so far")
                if self.cancellable:
                    task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, sig)

    def _release_stop_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)

    async def _rollout_loop(self) -> None:
        """Keep groups in flight across the generator replicas, never more than max_policy_age ahead.

        A group started now helps fill batch b (`collector.next_batch()`); batch b feeds step b + 1,
        which trains at trainer version b, so the group may start only once version b - max_policy_age
        is published (its replica loads the newest version before generating)."""
        max_age, c = self.config.replay_buffer.max_policy_age, self.collector
        try:
            while c.batches_done < self.config.controller.steps:
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


def _note_fault(failure) -> None:
    """Monarch's hook for a dead actor process that no one supervises: its default exits the whole
    program. Here the failed calls raise instead, and the pools replace replicas."""
    logger.debug("actor failure: %s", failure)
