"""One training run (`meshrl train`) or one evaluation (`meshrl eval`) from start to end, in the process
that drives it: the job's hosts (meshrl/runtime/jobs.py), every role's actors on them
(meshrl/runtime/launch.py), the generator and grader replica pools attached to the trainer's weight rings
(or their hosts' relays, meshrl/runtime/relays.py), the controller's loops (meshrl/controller.py), and
how it ends: the final checkpoint, the policy saved to final/ and summary.json, or a stop or a failure,
after which everything written so far is kept and no process is left behind.

The controller's loops move the data; this module starts and stops what they run on, and replaces what
they cannot: `Run._respawn` starts a dead trainer's, reference's or replay buffer's new mesh on the same
hosts and `Run._attach_generators` points the generators at a new trainer's rings, for the restarts
(meshrl/restarts.py); the generator and grader pools replace their own replicas (meshrl/actors/replicas.py).
"""

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import monarch.actor
import psutil
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from tqdm import tqdm

from meshrl import checkpoint
from meshrl.actors import in_rank_order
from meshrl.actors.replicas import (ReplicaPool, RoleFailed, error_line, monarch_replicas, processes, replica_name,
                                    sticky_slack)
from meshrl.actors.timeouts import CallTimeout, StopSignals, Timeouts, bounded, deadline
from meshrl.actors.trace import Tracer
from meshrl.configs import Config, resolve, to_dict
from meshrl.configs.recipe import recipe_hash
from meshrl.controller import Controller
from meshrl.episodes import reward_error_totals
from meshrl.models.model import ChatTokenizer, read_hf_config, resolve_checkpoint
from meshrl.restarts import Respawner
from meshrl.rollout import RolloutCollector
from meshrl.runtime.dtypes import Dtypes, choose_dtypes, run_roles
from meshrl.runtime.final import FinalPolicy, save_final
from meshrl.runtime.gpu_plan import plan_gpus
from meshrl.runtime.jobs import Hosts, gpus_per_host, host_gpus, make_job, plan
from meshrl.runtime.launch import (Actors, actor_classes, generator_args, note_fault, spawn_actors, spawn_buffer,
                                   spawn_ranked)
from meshrl.runtime.loggers import MetricLoggers, wandb_mode
from meshrl.runtime.memory_plan import refusal, refuse_unfitting
from meshrl.runtime.metric_rows import MetricRows
from meshrl.runtime.plot import plot_curves
from meshrl.runtime.relays import Relays
from meshrl.runtime.serve import GenerateServer, serve_run
from meshrl.runtime.settle import settle
from meshrl.runtime.settle import write as write_settled
from meshrl.tasks import make_task, task_config
from meshrl.weight_sync import published_weights
from meshrl.work_buffer import TooManyFailures

FAILURES = (RoleFailed, TooManyFailures, SupervisionError, CallTimeout)  # a role can no longer work


class Run:
    def __init__(self, config: Config, run_dir: Path, resume_from: Path | None = None):
        """Everything checked before anything starts: the config, the placement, the task, each role's
        implementation, the model. `resume_from`: a checkpoint of this run to go on from."""
        config.check()
        self.recipe = recipe_hash(config)  # of the settings as given, before anything is filled in
        self.given = to_dict(config)  # config.json: what the run was asked for, which a resume starts from
        # every value computed from others filled in once (meshrl.configs.resolve); the GPU plan and the dtypes
        # are written into it at the start, before any role is spawned (_start). Everything below reads it.
        config = resolve(config, run_dir)
        config.logging.wandb_mode = wandb_mode(config.logging)  # before the loggers start; the rest: _start
        self.placement = plan(config)
        self.gpus = plan_gpus(config, self.placement, gpus_per_host(config.job))
        self.timeouts = Timeouts.of(config)
        self.config, self.run_dir, self.resume_from = config, run_dir, resume_from
        self.task = make_task(config.task, task_config(config))
        self.classes = actor_classes(config)
        self.model_path = resolve_checkpoint(config.model.source)
        refuse_unfitting(config, read_hf_config(self.model_path), gpus_per_host(config.job))  # each GPU's memory
        if config.trainer.lora.rank:  # its targets and rank checked against the model, on the meta device
            published_weights(self.model_path, "float32", config.trainer.lora)
        self.tokenizer = ChatTokenizer(self.model_path, config.model.chat_template)
        self.tokenizer.check_tools(getattr(self.task, "offers_tools", False))  # an MCP environment's, say
        self.grader_task = task_config(config)  # with what it needs of the model, if anything (openenv's tool parser)
        if hasattr(self.grader_task, "launched"):
            self.grader_task = self.grader_task.launched(config.model.tool_parser, self.model_path)
        self.fit_prompts()
        self.signals = StopSignals()
        self.hosts: Hosts | None = None
        self.actors: Actors | None = None
        self.pools: list[ReplicaPool] = []
        self.transports: dict[str, str] = {}  # generator replica -> the weight transport it chose
        self.controller: Controller | None = None
        self.where: dict[str, tuple] = {}  # trainer / reference -> (host(s), pid(s))
        self.rings: list = []  # the trainer ranks' weight rings, which generators (or their hosts' relays) attach to
        self.relays: Relays | None = None  # a weight relay per generator host, if weight_sync.relay says so
        self.dtypes: Dtypes | None = None  # what each role computes in, and why (decided at the start)
        self.server: GenerateServer | None = None  # the generate endpoint, with serve.enabled
        self.final: FinalPolicy | None = None  # what final/ holds, once written

    def fit_prompts(self) -> None:
        """Tasks that can (the dataset's) drop samples whose prompts could not be generated from: more
        tokens than `generator.max_model_len` leaves with `generator.max_tokens` to spare."""
        keep_only, g = getattr(self.task, "keep_only", None), self.config.generator
        if keep_only:
            keep_only(lambda prompt: len(self.tokenizer.encode_chat(prompt)) + g.max_tokens <= g.max_model_len,
                      f"longer than generator.max_model_len ({g.max_model_len}) less generator.max_tokens "
                      f"({g.max_tokens}) tokens")

    async def run(self) -> dict:
        """Train for `controller.steps` steps; return (and write to summary.json) the eval rates before
        and after. Ctrl-C or SIGTERM stops it between steps: a checkpoint holds the steps done, the
        policy trained so far is saved to final/ and everything written so far is kept (`stopped_by` in
        the summary). A role that can no longer work stops it the same way without the checkpoint,
        then raises RoleFailed with one line."""
        start = time.perf_counter()
        resumed = checkpoint.load(self.resume_from) if self.resume_from else None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(self.given, indent=2))
        rows = MetricRows(MetricLoggers(self.run_dir, self.config, name=self.run_dir.name,
                                        resumed_rows=resumed.rows if resumed else ()))
        self.rows = rows
        self.tracer = Tracer(self.run_dir, resume=resumed is not None)
        monarch.actor.unhandled_fault_hook = note_fault  # failures reach us as errors of the calls
        failure, error = None, None
        try:
            try:
                await self._start()
                c = self.controller = Controller(
                    self.config, self.task, self.tokenizer, *self.pools, self.actors.trainer, self.actors.reference,
                    self.actors.buffer, self.tracer, self.signals,
                    checkpoint.Checkpointer(self.run_dir, self.config.checkpoint.keep, self.actors.trainer, self.tracer,
                                            self.timeouts, self.actors.buffer), rows, self.timeouts,
                    Respawner(self._respawn, self._attach_generators),
                    self.relays.egress if self.relays and self.relays.on else None)
                if self.config.serve.enabled:  # harnesses that drive their own loop (meshrl/runtime/serve.py)
                    self.server = await serve_run(self.config, self.pools[0], self.timeouts, lambda: c.trainer_version,
                                                  self.run_dir, self.model_path)
                if resumed:
                    await c.restore(resumed, self.resume_from)
                    tqdm.write(f"resumed from {self.resume_from} (step {resumed.step}, "
                               f"policy version {c.trainer_version})")
                await c.run()
            except FAILURES as e:  # a role died, hung or kept failing: write what there is
                error, failure = e, error_line(e) if isinstance(e, SupervisionError) else str(e)
            stop = self.timeouts.stop if self.signals.stopped_by or failure else None
            hung = isinstance(error, CallTimeout) and error.role == "trainer"
            self.final = await bounded(self._save("the trainer did not answer" if hung else None), stop,
                                       "saving the policy")
        finally:
            rows.close()
            if self.server:
                await self.server.stop()
            await self._stop_actors()
            self.signals.release()
            self.tracer.close()
        initial = self.controller.initial if self.controller else (resumed.initial if resumed else {})
        summary = self._summary(initial, time.perf_counter() - start, failure)
        if failure:
            kept = "metrics, rollouts, trace" + (f" and the {self.final.describe()}" if self.final else "")
            raise RoleFailed(f"{failure} (after {rows.done} steps; {kept} are in {self.run_dir})")
        return summary

    async def evaluate(self, split: str) -> dict[str, float]:
        """The run's model (a finished run's policy, `meshrl eval`) on the task's held-out `split`, with
        the rates the eval during training reports; nothing is trained, and no process is left behind."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(self.given, indent=2))
        self.tracer = Tracer(self.run_dir, resume=False)
        monarch.actor.unhandled_fault_hook = note_fault
        self.signals.task = asyncio.current_task()  # a Ctrl-C ends it, its actors stopped below
        try:
            await self._start()
            collector = RolloutCollector(self.config.controller, self.config.generator, self.task, self.tokenizer,
                                         *self.pools, self.tracer, None, lambda: self.actors.buffer, self.timeouts)
            return await collector.evaluate(None, split)
        finally:
            await self._stop_actors()
            self.signals.release()
            self.tracer.close()

    async def _start(self) -> None:
        """The job's hosts, every role's actors on them and the generator and grader pools."""
        self.hosts = await self._start_job()
        if self.gpus.asked:  # job.kind workers: each host says how many GPUs it has
            counts = await host_gpus(self.hosts)
            self.gpus = plan_gpus(self.config, self.placement, counts)
            tqdm.write("\n".join(self.gpus.describe()))
            if line := refusal(self.config, read_hf_config(self.model_path), counts):
                raise RoleFailed(line)  # before any role is spawned
        # every `auto` dtype decided once, here, and handed to the roles in their configs
        self.dtypes = await choose_dtypes(self.config, self.placement, self.hosts, run_roles(self.classes),
                                          self.gpus.apply(self.config))
        for line in self.dtypes.describe():
            tqdm.write(line)
        # every `auto` left settled once, written to resolved.json; every role, and the controller, get these
        self.config = settle(self.gpus.apply(self.config), self.placement, self.model_path,
                             read_hf_config(self.model_path), self.run_dir, "judge" in run_roles(self.classes),
                             bool(self.gpus.shared))
        write_settled(self.config, self.run_dir)
        self.actors = await spawn_actors(self.config, self.classes, self.model_path, self.hosts, self.tokenizer.pad_id)
        self.signals.install()
        self.signals.on_hard_stop = self._hard_stop
        await self._start_pools()

    def _summary(self, initial: dict, wall_time: float, failure: str | None = None, plot: bool = True) -> dict:
        """summary.json (and curves.png): eval rates before and after, steps, time, how it ended."""
        rows = self.rows.rows
        if rows and plot:
            plot_curves(rows, initial, self.run_dir / "curves.png")
        final = {k: v for k, v in rows[-1].items() if k.startswith("eval_")} if rows else {}
        summary = {**{f"{k}_initial": v for k, v in initial.items()}, **{f"{k}_final": v for k, v in final.items()},
                   **({"final_eval_step": rows[-1]["step"]} if final else {}),  # the policy the final evals scored
                   "final_policy": self.final.summary() if self.final else None,  # what final/ holds
                   "steps": len(rows), "wall_time_s": wall_time, "config_hash": self.recipe,
                   **reward_error_totals(rows),  # the replies whose reward function raised, and their share
                   **({"dtypes": self.dtypes.summary()} if self.dtypes else {}),
                   **({"stopped_by": self.signals.stopped_by} if self.signals.stopped_by else {}),
                   **({"failed": failure} if failure else {})}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

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
            try:
                await asyncio.wait_for(hosts.connected(), (job.kind == "workers" and job.connect_timeout_s) or None)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no answer from its workers within job.connect_timeout_s ({job.connect_timeout_s:g} "
                                   "s): are they running, and do they and this controller trust each other's "
                                   "certificates (job.tls)?") from None
            return hosts
        except Exception as e:
            if launched is not None:
                launched.kill()
            raise RoleFailed(f"the {job.kind} job did not start: {error_line(e)}") from None

    async def _start_pools(self) -> None:
        """The generator and grader replicas on their hosts, each generator attached to the trainer's
        weight ring; then processes.json and placement.json say where every actor runs."""
        cfg, timeouts = self.config, self.timeouts
        async with self.tracer.span("trainer", "attach", timeout=timeouts.trainer):
            self.rings = await in_rank_order(self.actors.trainer.weight_ring.call())
        self.relays = Relays(cfg, self.placement, self.hosts, timeouts, self._write_processes)
        await self.relays.start(self.rings)
        gen, grade = cfg.generator, cfg.grader

        generators = ReplicaPool("generator", monarch_replicas(
            lambda i: replica_name("generator", i, gen.replicas), self.classes["generator"],
            lambda i: generator_args(cfg, i, self.model_path), lambda i: self.hosts.host("generator", i), self._attach,
            timeouts.start, lambda i, e: self.hosts.lose("generator", i, e)), gen.replicas, gen.max_restarts,
            self._write_processes, timeouts.stop, cfg.controller.restart_window_s, sticky_slack(gen))
        graders = ReplicaPool("grader", monarch_replicas(
            lambda i: replica_name("grader", i, grade.replicas), self.classes["grader"],
            lambda i: (cfg.task, self.grader_task, grade), lambda i: self.hosts.host("grader", i), None, timeouts.grade,
            lambda i, e: self.hosts.lose("grader", i, e)),
            grade.replicas, grade.max_restarts, self._write_processes, timeouts.stop, cfg.controller.restart_window_s)
        self.pools = [generators, graders]
        await asyncio.gather(generators.start(), graders.start())
        for role, procs in self.actors.procs.items():
            found = await processes(procs, role)  # the trainer's: one per rank
            self.where[role] = ([h for h, _ in found], [p for _, p in found]) if len(found) > 1 else found[0]
        self._write_processes()
        if cfg.job.kind != "local":
            placed = json.loads((self.run_dir / "placement.json").read_text())
            tqdm.write("placement: " + ", ".join(
                f"{name} on {p['host']}" + (f" ({p['weight_transport']})" if "weight_transport" in p else "")
                for name, p in placed.items() if name != "job"))

    async def _attach(self, replica) -> None:
        """Generator `replica` pulls from the trainer's weight rings, or from its host's relay. A new replica's
        first call waits for its engine to start: bounded by generator.start_timeout_s, not generator.timeout_s."""
        timeout = self.timeouts.generate if replica.served else self.timeouts.start
        async with self.tracer.span("generator", "attach", replica=replica.index, timeout=timeout):
            name = replica_name("generator", replica.index, self.config.generator.replicas)
            rings = await self.relays.attach_to(replica.index) if self.relays else self.rings
            self.transports[name] = await replica.actor.attach_weights.call_one(rings)

    async def _respawn(self, role: str):
        """The dead trainer's, reference's or replay buffer's mesh stopped (if it can be) and a new one started
        on the same hosts (the first two attached to the replay buffer); processes.json names its processes."""
        try:
            await bounded(self.actors.procs[role].stop(), self.timeouts.stop, f"stopping the failed {role}")
        except Exception:  # a dead mesh may refuse to stop; the new one does not depend on it
            pass
        config = self.config
        if role == "replay_buffer":
            procs, mesh = spawn_buffer(config, self.classes, self.hosts, self.tokenizer.pad_id)
            self.actors.buffer = mesh
        else:
            procs, mesh = await spawn_ranked(role, config, self.classes, self.model_path, self.hosts)
            setattr(self.actors, role, mesh)
            async with deadline(getattr(self.timeouts, role), role, "attach_buffer"):
                await mesh.attach_buffer.call(self.actors.buffer)
        self.actors.procs[role] = procs
        found = await processes(procs, role)
        self.where[role] = ([h for h, _ in found], [p for _, p in found]) if len(found) > 1 else found[0]
        self._write_processes()
        return mesh

    async def _attach_generators(self, trainer) -> None:
        """Every serving generator (and each started from now on) pulls from `trainer`'s weight rings; a
        replica that cannot attach is the pool's to replace at its next call."""
        async with self.tracer.span("trainer", "attach", timeout=self.timeouts.trainer):
            self.rings = await in_rank_order(trainer.weight_ring.call())
        if self.relays:
            await self.relays.attach(self.rings)
        generators = self.pools[0]
        await asyncio.gather(*(self._attach(r) for r in generators.replicas if r.healthy), return_exceptions=True)

    def _write_processes(self) -> None:
        """processes.json (each actor's pid) and placement.json (its host, and each generator's transport)."""
        pids, hosts = {role: pid for role, (_, pid) in self.where.items()}, {r: h for r, (h, _) in self.where.items()}
        for pool in self.pools:
            pids.update(pool.pids())
            hosts.update(pool.hosts())
        if self.relays:  # "relay0", ...: `meshrl chaos` kills them too
            pids.update(self.relays.pids())
            hosts.update(self.relays.host_names())
        (self.run_dir / "processes.json").write_text(json.dumps(pids, indent=2))
        placement = {name: {"host": host, **({"weight_transport": self.transports[name]}
                                              if name in self.transports else {})} for name, host in hosts.items()}
        (self.run_dir / "placement.json").write_text(json.dumps({"job": self.config.job.kind, **placement}, indent=2))

    async def _save(self, why: str | None) -> FinalPolicy | None:
        """The policy to final/: the trainer's when it holds the last version trained, else the newest a
        generator or checkpoint holds (meshrl/runtime/final.py); what final/ holds, None if nothing was written.
        `why`: why the trainer is not asked."""
        if self.actors is None:
            return None
        generators = self.pools[0] if self.pools else None
        return await save_final(self.run_dir, self.actors.trainer, self.controller, generators, self.tracer,
                                self.timeouts, why)

    async def _stop_actors(self) -> None:
        """Every pool and mesh at once, each bounded; a dead process's mesh may refuse to stop, and the
        others still stop. Then the job's hosts."""
        pools = [pool.stop() for pool in self.pools]
        meshes = [bounded(mesh.stop(), self.timeouts.stop, "stopping a mesh")
                  for mesh in (self.actors.procs.values() if self.actors else [])]
        relays = [bounded(self.relays.stop(self.run_dir), self.timeouts.stop, "stopping the weight relays")
                  ] if self.relays else []
        await asyncio.gather(*pools, *meshes, *relays, return_exceptions=True)
        if self.hosts:
            self.hosts.kill()

    def _hard_stop(self, name: str) -> None:
        """A second signal: write what can be written at once, end every actor process and exit
        (128 + the signal's number) within seconds, whatever is running."""
        code = 128 + getattr(signal, name)
        threading.Timer(4.0, os._exit, (code,)).start()  # whatever hangs below, the process ends
        try:
            self.tracer.close(plot=False)
            if hasattr(self, "rows"):  # a training run's, not an eval's
                self.rows.close()
                self._summary(self.controller.initial if self.controller else {}, 0.0, plot=False)
            for child in psutil.Process().children(recursive=True):  # local actors; remote ones with the job
                try:
                    child.kill()
                except psutil.Error:
                    pass
            if self.hosts:
                killer = threading.Thread(target=self.hosts.kill, daemon=True)
                killer.start()
                killer.join(2.0)
            newest = checkpoint.latest(self.run_dir)
            resume = f"; go on with: meshrl train --resume {self.run_dir} (from {newest.name})" if newest else ""
            print(f"meshrl: stopped at once by a second {name} after {self.rows.done} steps; metrics, rollouts "
                  f"and the trace are in {self.run_dir}{resume}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
