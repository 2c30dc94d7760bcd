"""`meshrl bench buffer`: how many groups a second one replay buffer process takes in and hands out.

Each group passes the buffer three times in a run: `stage` (its Completions taken from the generator
holding them), `add` (the controller's decision: its episodes flattened from them) and `sample` (its batch
composed and cut into micro-batches), then `trained` lets it go. Here the real FifoBuffer runs on a
process of its own, the completions wait on generator stand-ins (meshrl/tools/bench/standins.py, on
processes of their own, made before the clock starts; each completion's tokens and logprobs random and its
own, as real ones are), and this process asks as the controller does: each group's stage as its group is
graded (all of a batch at once here; the controller's Stages sends those waiting together), one add for the
batch, its sample and trained. Reported per completion length: groups/s over the timed batches (`stage_add_sample`), the buffer process's CPU per group and what one
core of it takes in at that cost (`groups_per_core_s`: the stand-ins and this process share the machine's cores
with it, and in a run they are other hosts), and the same with every micro-batch fetched and collated (what the
trainer's ranks ask next, `with_fetch`).
"""

import asyncio
import os
import time

import psutil

from meshrl.actors import cpu_name, spawn
from meshrl.actors.replay_buffer import FifoBuffer
from meshrl.actors.replay_buffer_config import ReplayBufferConfig
from meshrl.actors.replicas import processes
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.buffer_calls import Stages
from meshrl.tools.bench.standins import StandInGenerator
from meshrl.types import BatchRef, GroupEpisodes, Prompt, Sampling


async def held_groups(generators: list, groups: range, group_size: int, tokens: int) -> dict[int, tuple[int, list[int]]]:
    """Each group's completions made and held on a generator (round-robin): group -> (generator, its keys)."""
    sampling = Sampling(1.0, tokens, n=group_size)
    out = {}
    for g in groups:
        made = await generators[g % len(generators)].generate.call_one([Prompt(g, [1, 2, 3])], sampling=sampling)
        out[g] = (g % len(generators), [c.key for c in made.completions])
    return out


def episodes(group: int, group_size: int, batch: int) -> GroupEpisodes:
    """A kept group's decision as the controller sends it: each sequence trained whole, rewards 0 and 1."""
    rewards = [float(j % 2) for j in range(group_size)]
    return GroupEpisodes(group, [(j, 0, 1) for j in range(group_size)], [r - 0.5 for r in rewards],
                         [batch] * group_size, rewards, 1.0, attempt=1)


async def one_length(tokens: int, batches: int, batch_size: int, group_size: int, fetch: bool) -> dict:
    """Groups/s of `batches` batches of `batch_size` groups of `tokens`-token completions through one buffer."""
    trainer = TrainerConfig(micro_batch_size=16)
    buffer_procs, buffer = spawn("bench_buffer", FifoBuffer, ReplayBufferConfig(), trainer, batch_size, 1 << 30, 0)
    meshes = [spawn(f"bench_holder{i}", StandInGenerator, i, True) for i in range(2)]  # distinct tokens, as real ones
    holders = [actor for _, actor in meshes]
    try:
        [(_, pid)] = await processes(buffer_procs, "bench_buffer")
        buffer_cpu = psutil.Process(pid)
        await buffer.logged.call_one()  # serving
        seconds = cpu = 0.0
        stages = Stages(lambda: buffer, None)  # the controller's: each group asks, those waiting go together
        for b in range(batches + 1):  # batch 0 warms up, untimed
            groups = range(b * batch_size, (b + 1) * batch_size)
            held = await held_groups(holders, groups, group_size, tokens)
            start, cpu_start = time.perf_counter(), buffer_cpu.cpu_times()
            staged = await asyncio.gather(*(stages.stage(g, 1, [[(holders[h], k)] for k in keys])
                                            for g, (h, keys) in held.items()))
            if not all(staged):
                raise RuntimeError("a stand-in generator did not hand its completions over")
            await buffer.add.call_one(b, [episodes(g, group_size, b) for g in groups])
            plan = await buffer.sample.call_one(b, list(groups))
            if fetch:
                await asyncio.gather(*(buffer.micro_batch.call_one(BatchRef(b, u, m))
                                       for u, count in enumerate(plan["micro_batches"]) for m in range(count)))
            await buffer.trained.call_one(b, b + 1)
            if b:
                seconds += time.perf_counter() - start
                cpu_end = buffer_cpu.cpu_times()
                cpu += cpu_end.user + cpu_end.system - cpu_start.user - cpu_start.system
        groups_timed = batches * batch_size
        return {"max_tokens": tokens, "groups": groups_timed, "seconds": seconds, "groups_per_s": groups_timed / seconds,
                "buffer_cpu_ms_per_group": 1000 * cpu / groups_timed,
                "groups_per_core_s": groups_timed / cpu if cpu else None}
    finally:
        for procs in [buffer_procs, *(m for m, _ in meshes)]:
            await procs.stop()


def run(max_tokens: list[int], batches: int, batch_size: int, group_size: int) -> dict:
    async def all_lengths():
        out = []
        for tokens in max_tokens:
            out.append({"stage_add_sample": await one_length(tokens, batches, batch_size, group_size, fetch=False),
                        "with_fetch": await one_length(tokens, batches, batch_size, group_size, fetch=True)})
        return out

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "batch_size": batch_size, "group_size": group_size,
            "batches": batches, "lengths": asyncio.run(all_lengths())}


def report(result: dict) -> str:
    lines = [f"one replay buffer process ({result['cpu']}, {result['cores']} cores), batches of {result['batch_size']} "
             f"groups of {result['group_size']}: stage + add + sample + trained, then with every micro-batch fetched",
             f"  {'tokens':>6s} {'groups/s':>9s} {'buffer CPU ms/group':>19s} {'groups/core-s':>13s} | "
             f"{'with fetch groups/s':>19s} {'buffer CPU ms/group':>19s}"]
    for length in result["lengths"]:
        a, f = length["stage_add_sample"], length["with_fetch"]
        lines.append(f"  {a['max_tokens']:6d} {a['groups_per_s']:9.0f} {a['buffer_cpu_ms_per_group']:19.3f} "
                     f"{a['groups_per_core_s'] or 0:13.0f} | "
                     f"{f['groups_per_s']:19.0f} {f['buffer_cpu_ms_per_group']:19.3f}")
    return "\n".join(lines)
