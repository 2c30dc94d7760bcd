"""`meshrl bench controller`: the controller's own cost, and what a placement's step time would be.

- Cost: the real controller (loops, work buffer, replica pools, tracer, metric rows, checkpoint)
  drives fake actors (tests/support/simulation.py) that answer at once, and the real replay buffer, all on one
  core: groups routed per second and the controller's CPU per group, for each replica count and
  completion length. Each step has one group per replica (of `group_size` completions of
  `max_tokens` tokens), one step of staleness allowed. The actors run in this process, each step of
  their endpoints timed (tests/support/fake_monarch.py's ACTOR_CPU): the controller's CPU is the process's
  less theirs. `with_buffer` adds the replay buffer's (composing and collating each batch): the work
  the controller did itself before the buffer was an actor of its own. Messages are not serialized
  between fakes; a real controller also unpickles each group's completions and pickles them on.
- Prediction: the same with the fakes taking simulated time from a cost model (seconds per generated
  token of a group, per trained token on each trainer rank, per publish and pull, and how much longer
  the slowest groups take): the step time of a placement trained synchronously (max_policy_age 0)
  and asynchronously (1), with generators that drain before loading a version or load it in flight,
  and the speedups. The model lets a replica decode its concurrent groups together at the cost of
  one (continuous batching, memory-bound decoding): an optimistic bound for generation. Simulated
  time runs `time_scale` times faster than real time; the figures are scaled back.
"""

import asyncio
import contextlib
import dataclasses
import io
import logging
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from meshrl.actors import cpu_name
from meshrl.actors.replay_buffer import FifoBuffer
from meshrl.tools.bench.checkout import from_checkout

# The simulation and the fake actor handles are test support, not in the wheel: this bench runs from a checkout.
simulation = from_checkout("simulation")
ACTOR_CPU = from_checkout("fake_monarch").ACTOR_CPU
Costs, fake_config, run_fake = simulation.Costs, simulation.fake_config, simulation.run_fake


def one_core() -> int:
    """Pin this process (and torch) to one core, as a controller would be measured; returns it."""
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    return core


def controller_cost(replicas: int, group_size: int, max_tokens: int, groups: int) -> dict:
    """Groups per second and CPU per group with instant fake actors, `replicas` generators."""
    steps = max(3, math.ceil(groups / replicas))
    config = fake_config(steps=steps, prompts=replicas, group=group_size, max_policy_age=1, replicas=replicas)
    config.generator.max_tokens, config.trainer.micro_batch_size = max_tokens, 16
    ACTOR_CPU.clear()
    with tempfile.TemporaryDirectory() as run_dir:
        wall, cpu = time.perf_counter(), time.process_time()
        with contextlib.redirect_stdout(io.StringIO()):  # the evals' example replies
            asyncio.run(run_fake(config, Path(run_dir), progress=False))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    routed = steps * replicas + 2 * len(range(2))  # the batches' groups and two evals of two prompts
    controller = cpu - sum(ACTOR_CPU.values())
    return {"replicas": replicas, "max_tokens": max_tokens, "steps": steps, "groups": routed, "wall_s": wall,
            "groups_per_s": routed / wall, "cpu_ms_per_group": 1000 * controller / routed,
            "with_buffer_ms_per_group": 1000 * (controller + ACTOR_CPU[FifoBuffer.__name__]) / routed,
            "actors_cpu_s": dict(ACTOR_CPU)}


ARMS = {"sync": (0, "drain"), "async_drain": (1, "drain"), "async": (1, "in_flight")}  # (max_policy_age, update)


def predict(replicas: int, ranks: int, prompts: int, group_size: int, max_tokens: int, costs: Costs,
            steps: int, time_scale: float) -> dict:
    """Median step time (after the first) of the placement under `costs`: synchronous, asynchronous with
    generators draining before they load a version, and asynchronous loading in flight."""
    out = {}
    for arm, (age, update) in ARMS.items():
        config = fake_config(steps=steps, prompts=prompts, group=group_size, max_policy_age=age, replicas=replicas)
        config.generator.max_tokens, config.trainer.ranks, config.trainer.micro_batch_size = max_tokens, ranks, 16
        config.generator.weight_update = update
        with tempfile.TemporaryDirectory() as run_dir, contextlib.redirect_stdout(io.StringIO()):
            done = asyncio.run(run_fake(config, Path(run_dir), costs=costs.faster(time_scale), progress=False))
        out[f"{arm}_step_s"] = statistics.median(r["step_time_s"] for r in done.rows[1:]) * time_scale
    out["async_speedup"] = out["sync_step_s"] / out["async_step_s"]
    out["async_drain_speedup"] = out["sync_step_s"] / out["async_drain_step_s"]
    return out


def run(replicas: list[int], group_size: int, max_tokens: list[int], groups: int, placement: dict | None,
        costs: Costs, time_scale: float) -> dict:
    core = one_core()
    logging.getLogger("meshrl").setLevel(logging.ERROR)
    controller_cost(8, group_size, max_tokens[0], 64)  # warm: imports, first allocations
    curve = [controller_cost(r, group_size, tokens, groups) for tokens in max_tokens for r in replicas]
    result = {"core": core, "cpu": cpu_name(), "group_size": group_size, "max_tokens": max_tokens, "cost": curve}
    if placement:
        result["placement"] = {**placement, "costs": dataclasses.asdict(costs), "time_scale": time_scale,
                               **predict(**placement, group_size=group_size, max_tokens=max_tokens[0], costs=costs,
                                         steps=6, time_scale=time_scale)}
    return result


def report(result: dict) -> str:
    lines = [f"controller cost on one core ({result['cpu']}), groups of {result['group_size']} completions, "
             "instant fake actors and the real replay buffer in process:",
             f"  {'tokens':>6s} {'replicas':>8s} {'groups':>7s} {'groups/s':>9s} {'CPU ms/group':>13s} "
             f"{'with buffer':>12s}"]
    lines += [f"  {c['max_tokens']:6d} {c['replicas']:8d} {c['groups']:7d} {c['groups_per_s']:9.0f} "
              f"{c['cpu_ms_per_group']:13.3f} {c['with_buffer_ms_per_group']:12.3f}" for c in result["cost"]]
    if p := result.get("placement"):
        lines.append(f"predicted for {p['replicas']} generator replicas, {p['ranks']} trainer ranks, {p['prompts']} "
                     f"prompts per step: step {p['sync_step_s']:.2f} s sync, {p['async_drain_step_s']:.2f} s async "
                     f"draining, {p['async_step_s']:.2f} s async in flight (async speedup "
                     f"{p['async_drain_speedup']:.2f} draining, {p['async_speedup']:.2f} in flight)")
    return "\n".join(lines)
