"""`meshrl bench controller --real`: the controller's cost on real Monarch processes.

The in-process bench (meshrl/tools/bench/controller.py) drives the real Controller with fakes in its own
process: no pickling, no network, no spawn, no supervision. Here every actor is a real Monarch actor in
a process of its own kind: light generator and grader stand-ins (meshrl/tools/bench/standins.py; many
to a process, `processes` generator processes spread round-robin over the hosts), the real FifoBuffer
replay buffer in its own process, a trainer stand-in that takes its micro-batches from the buffer by
BatchRef as the real trainer does. The controller (this process) runs the real Controller,
RolloutCollector, WorkBuffer and ReplicaPools over them.

Each run reports: the controller process's CPU per group (`time.process_time()` over the run: its
Python and Monarch's threads, divided by the groups routed, evals included), and its main thread's; the
groups/s one controller core could route (1 / that CPU per group); the Monarch messages the controller
sent per group and by endpoint (meshrl/tools/bench/messages.py); `controller_bytes_in` per
training group (the step rows' sum / the steps' groups), groups/s, the seconds until every replica
answered its first call (spawn), and one kill: a generator process SIGKILLed after the run, the
seconds until the pool noticed (its first replacement counted) and until every replica it held served
again on a fresh process. Then the in-process bench's figures for the same actors and tokens, in this
process after the real runs, on one core.

Hosts: this machine's processes by default; with `workers` (Monarch workers' addresses, e.g. test hosts
in network namespaces running `meshrl worker --insecure`) the generator processes go round-robin over
them, the grader, buffer and trainer stay local.
"""

import asyncio
import contextlib
import io
import logging
import math
import os
import signal
import tempfile
import time
from pathlib import Path

import psutil

from meshrl import checkpoint
from meshrl.actors import cpu_name, spawn
from meshrl.actors.replay_buffer import FifoBuffer
from meshrl.actors.replicas import Replica, ReplicaPool, processes
from meshrl.actors.timeouts import StopSignals, Timeouts, bounded
from meshrl.actors.trace import Tracer
from meshrl.configs import resolve
from meshrl.controller import Controller
from meshrl.runtime.launch import note_fault
from meshrl.runtime.metric_rows import MetricRows
from meshrl.tools.bench.checkout import from_checkout
from meshrl.tools.bench.messages import MessageCounter
from meshrl.tools.bench.standins import StandInGenerator, StandInGrader, StandInTrainer

# The fake task and tokenizer and the small config of the in-process bench: test support, from a checkout.
simulation = from_checkout("simulation")
FakeTask, FakeTokenizer, fake_config = simulation.FakeTask, simulation.FakeTokenizer, simulation.fake_config

SUPERVISION_WAIT_S = 120.0  # a kill not noticed and replaced within this is reported as not


class Shared:
    """Processes that hold many replicas: a replica's `procs` handle (stopping one replica leaves its process
    to the others); a process that died is replaced once, for all the replicas it held."""

    def __init__(self, role: str, count: int, cls, hosts: list):
        self.role, self.count, self.cls, self.hosts = role, count, cls, hosts
        self.meshes: dict[int, object] = {}  # process slot -> its proc mesh now
        self.where: dict[int, tuple[str, int]] = {}  # slot -> (host, pid) now
        self.born: dict[int, int] = {}  # slot -> generation of its process now
        self.placed: dict[int, int] = {}  # replica -> the generation of the process it was put on
        self.lock = asyncio.Lock()
        self.all: list = []  # every proc mesh started, to stop at the end
        self.pids: list[int] = []

    async def _process(self, slot: int) -> None:
        host = self.hosts[slot % len(self.hosts)] if self.hosts else None
        procs = (host or _this_host()).spawn_procs(per_host={"procs": 1}, name=f"{self.role}_p{slot}")
        self.all.append(procs)
        [(where, pid)] = await processes(procs, f"{self.role}_p{slot}")
        self.meshes[slot], self.where[slot] = procs, (where, pid)
        self.born[slot] = self.born.get(slot, -1) + 1
        self.pids.append(pid)

    async def start(self, index: int) -> Replica:
        """Replica `index` on process slot index % count: a replacement goes on a fresh process there."""
        slot = index % self.count
        async with self.lock:
            if slot not in self.meshes or self.placed.get(index) == self.born[slot]:
                await self._process(slot)
        self.placed[index] = self.born[slot]
        args = (index,) if self.cls is StandInGenerator else ()
        actor = self.meshes[slot].spawn(f"{self.role}{index}_{self.born[slot]}", self.cls, *args)
        if self.cls is StandInGenerator:
            await actor.weight_sync_stats.call_one()  # serving
        return Replica(index, Kept(), actor, *self.where[slot])

    async def stop(self, timeouts: Timeouts) -> None:
        await asyncio.gather(*(bounded(p.stop(), timeouts.stop, "stopping a process") for p in self.all),
                             return_exceptions=True)


class Kept:
    """A replica's `procs` on a shared process: stopping it leaves the process to the others."""

    async def stop(self) -> None:
        pass


def _this_host():
    from monarch.actor import this_host

    return this_host()


async def real_cost(actors: int, tokens: int, group_size: int, steps: int, processes_: int, graders: int,
                    hosts: list, run_dir: Path, counter: MessageCounter | None = None, kill: bool = True) -> dict:
    """One run of the real controller over `actors` generator stand-ins on `processes_` processes, then (with
    `kill`) a generator process killed; with a `counter` installed before it, the messages the controller sent
    while it ran, by endpoint."""
    counter = counter or MessageCounter()
    config = fake_config(steps=steps, prompts=actors, group=group_size, max_policy_age=1, replicas=actors)
    config.generator.max_tokens, config.trainer.micro_batch_size = tokens, 16
    config.grader.replicas = graders
    config = resolve(config, run_dir)  # as a run's: the controller reads resolved values only
    timeouts = Timeouts.of(config)
    gens = Shared("generator", processes_, StandInGenerator, hosts)
    grads = Shared("grader", max(1, processes_ // 4), StandInGrader, [])
    buffer_procs = trainer_procs = generators = grader_pool = None
    started = time.perf_counter()
    try:
        buffer_procs, buffer = spawn("replay_buffer", FifoBuffer, config.replay_buffer, config.trainer,
                                     config.controller.prompts_per_step, config.controller.max_policy_age,
                                     FakeTokenizer.pad_id)
        trainer_procs, trainer = spawn("trainer", StandInTrainer)
        await trainer.attach_buffer.call(buffer)
        generators = ReplicaPool("generator", gens.start, actors, config.generator.max_restarts,
                                 stop_timeout=timeouts.stop, restart_window_s=0.0)
        grader_pool = ReplicaPool("grader", grads.start, graders, config.grader.max_restarts,
                                  stop_timeout=timeouts.stop)
        await asyncio.gather(generators.start(), grader_pool.start())
        spawn_s = time.perf_counter() - started
        tracer, rows = Tracer(run_dir), MetricRows(None, progress=False)
        controller = Controller(config, FakeTask(), FakeTokenizer(), generators, grader_pool, trainer, None, buffer,
                                tracer, StopSignals(), checkpoint.Checkpointer(run_dir, 0, trainer, tracer, timeouts,
                                                                               buffer), rows, timeouts)
        wall, cpu, main, threads = time.perf_counter(), time.process_time(), time.thread_time(), thread_cpu()
        counter.start()
        with contextlib.redirect_stdout(io.StringIO()):  # the evals' example replies
            await controller.run()
        sent = counter.stop()
        wall, cpu, main = time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - main
        threads = {name: round(s - threads.get(name, 0.0), 2) for name, s in thread_cpu().items()}
        tracer.close(plot=False)
        trained = steps * actors
        routed = trained + 2 * len(FakeTask().eval_samples())  # the batches' groups and the two evals'
        fetched = await trainer.stats.call_one()
        result = {"actors": actors, "max_tokens": tokens, "processes": processes_, "graders": graders,
                  "hosts": sorted({h for h, _ in gens.where.values()}), "steps": steps, "groups": routed,
                  "wall_s": wall, "groups_per_s": routed / wall, "controller_cpu_ms_per_group": 1000 * cpu / routed,
                  # of which its main thread's (the loops, Python's side of each call); the rest is Monarch's runtime
                  "main_thread_cpu_ms_per_group": 1000 * main / routed,
                  # what one controller core could route, were its CPU the only bound: 1 / CPU per group
                  "groups_per_core_s": routed / cpu if cpu > 0 else math.inf,
                  # the Monarch messages it sent (a call to a mesh of n actors: n), per group and by endpoint
                  "messages_per_group": sum(sent.values()) / routed, "messages": sent,
                  "controller_bytes_in_per_group": sum(r["controller_bytes_in"] for r in rows.rows) / trained,
                  "groups_regenerated": sum(r.get("groups_regenerated", 0) for r in rows.rows),
                  "rows": len(rows.rows), "spawn_s": spawn_s, "trainer_fetched": fetched,
                  "thread_cpu_s": {k: v for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v > 0}}
        others = [pid for procs in (buffer_procs, trainer_procs) for _, pid in await processes(procs, "bench")]
        if kill:
            result["supervision"] = await kill_one(generators, gens)
        result["pids"] = gens.pids + grads.pids + others  # every process it started, the replacement's too
        return result
    finally:
        for pool in (generators, grader_pool):
            if pool:
                await pool.stop()
        await asyncio.gather(gens.stop(timeouts), grads.stop(timeouts), *(
            bounded(p.stop(), timeouts.stop, "stopping a process") for p in (buffer_procs, trainer_procs) if p),
                             return_exceptions=True)


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far, summed by thread name (Python's, Monarch's runtime's)."""
    ticks, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


async def kill_one(pool: ReplicaPool, shared: Shared) -> dict:
    """SIGKILL generator process 0, then calls to every replica (through the pool, as the controller's) until
    the pool has replaced every replica it held: seconds until the first replacement was counted (noticed)
    and until all of them served again on a fresh process (replaced), watched every 10 ms."""
    host, pid = shared.where[0]
    victims = {r.index for r in pool.replicas if r.pid == pid}
    restarts, start = pool.restarts, time.perf_counter()
    seen: dict[str, float] = {}

    async def watch() -> None:
        while "replaced_s" not in seen:
            if "noticed_s" not in seen and pool.restarts > restarts:
                seen["noticed_s"] = time.perf_counter() - start
            if all(r.healthy and r.pid != pid for r in pool.replicas if r.index in victims):
                seen["replaced_s"] = time.perf_counter() - start
            await asyncio.sleep(0.01)

    async def ask(replica: Replica):
        return await replica.actor.weight_sync_stats.call_one()

    watcher = asyncio.ensure_future(watch())
    os.kill(pid, signal.SIGKILL)  # a test host's processes are this machine's too
    while not watcher.done() and time.perf_counter() - start < SUPERVISION_WAIT_S:
        calls = [asyncio.ensure_future(pool.call(ask)) for _ in pool.replicas]
        await asyncio.wait([watcher, *calls], timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.wait(calls, timeout=1.0)
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    watcher.cancel()
    back = sum(r.healthy and r.pid != pid for r in pool.replicas if r.index in victims)
    return {"host": host, "replicas_on_process": len(victims), "noticed_s": seen.get("noticed_s"),
            "replaced_s": seen.get("replaced_s"), "restarts": pool.restarts - restarts, "serving_again": back}


def attach_hosts(workers: str, bind: str) -> list:
    """Host meshes of the Monarch workers at `workers` (comma-separated tcp:// addresses), one each; [] for
    this machine's processes. Switches this process to TCP first, as meshrl/runtime/jobs.py does."""
    addresses = [a.strip() for a in workers.split(",") if a.strip()]
    if not addresses:
        return []
    from monarch.actor import attach_to_workers, enable_transport

    enable_transport(bind or "tcp")
    mesh = attach_to_workers(name="bench_hosts", ca="trust_all_connections", workers=addresses)
    return [mesh.slice(hosts=i) for i in range(len(addresses))]


def parse_runs(spec: str, replicas: list[int], max_tokens: list[int]) -> list[tuple[int, int]]:
    """ "256x16,256x1024" -> [(256, 16), (256, 1024)]; "" -> every replica count at every length."""
    if not spec:
        return [(r, t) for t in max_tokens for r in replicas]
    try:
        return [tuple(int(n) for n in run.split("x")) for run in spec.split(",")]
    except ValueError:
        raise ValueError(f"--real-runs {spec!r} is not ACTORSxTOKENS,..., e.g. 256x16,256x1024") from None


async def _real(runs: list[tuple[int, int]], group_size: int, groups: int, processes_: int, hosts: list) -> list:
    import monarch.actor

    monarch.actor.unhandled_fault_hook = note_fault  # the kill reaches the pool as its calls' errors
    out = []
    for actors, tokens in runs:
        with tempfile.TemporaryDirectory() as run_dir, MessageCounter().installed() as counter:
            steps = max(3, math.ceil(groups / actors))  # as the in-process bench
            out.append(await real_cost(actors, tokens, group_size, steps, processes_, max(1, actors // 16), hosts,
                                       Path(run_dir), counter))
    return out


def run(runs: list[tuple[int, int]], group_size: int, groups: int, processes_: int, workers: str = "",
        bind: str = "") -> dict:
    """Each (actors, tokens) run on real processes, then the in-process bench's figures for the same."""
    from meshrl.tools.bench import controller

    logging.getLogger("meshrl").setLevel(logging.ERROR)
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    hosts = attach_hosts(workers, bind)
    real = asyncio.run(_real(runs, group_size, groups, processes_, hosts))
    spawned = [pid for r in real for pid in r.pop("pids", [])]
    left = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in children_before]
    core = controller.one_core()  # the in-process figures as that bench takes them: one core
    in_process = [controller.controller_cost(actors, group_size, tokens, groups) for actors, tokens in runs]
    for figure in in_process:
        figure.pop("actors_cpu_s")
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "load_average": os.getloadavg(),  # others' work too
            "group_size": group_size, "workers": workers,
            "real": real, "in_process": in_process, "in_process_core": core, "processes_left": left,
            "spawned_pids": spawned}


def report(result: dict) -> str:
    lines = [f"the controller on real Monarch processes ({result['cpu']}), groups of {result['group_size']}, "
             "beside the in-process bench (fakes in one process, one core):",
             f"  {'actors':>6s} {'tokens':>6s} {'procs':>5s} {'groups':>6s} {'groups/s':>8s} {'CPU ms/group':>12s} "
             f"{'1 core groups/s':>15s} {'msgs/group':>10s} {'bytes in/group':>14s} {'spawn s':>7s} {'kill noticed/replaced s':>23s} | "
             f"{'in-process groups/s':>19s} {'CPU ms/group':>12s}"]
    for r, f in zip(result["real"], result["in_process"]):
        s = r["supervision"]
        kill = f"{s['noticed_s'] or float('nan'):.1f} / {s['replaced_s'] or float('nan'):.1f}"
        lines.append(f"  {r['actors']:6d} {r['max_tokens']:6d} {r['processes']:5d} {r['groups']:6d} "
                     f"{r['groups_per_s']:8.0f} {r['controller_cpu_ms_per_group']:12.3f} {r['groups_per_core_s']:15.0f} "
                     f"{r['messages_per_group']:10.2f} "
                     f"{r['controller_bytes_in_per_group']:14.0f} {r['spawn_s']:7.1f} {kill:>23s} | "
                     f"{f['groups_per_s']:19.0f} {f['cpu_ms_per_group']:12.3f}")
    lines.append(f"processes left after the runs: {len(result['processes_left'])}")
    return "\n".join(lines)
