"""`meshrl bench trainer`: trained tokens/s of the trainer actor against a plain torch training loop
of the same model on the same batch, in the same process placement, for each rank count.

- plain: each rank builds the model, shards it with torch's own `fully_shard` (several ranks), and
  runs forward (the LM head on the loss positions), a REINFORCE loss, backward, clipping and an
  AdamW step on a batch it already holds, timed inside the process;
- trainer: the real trainer actor on the same ranks, taking its micro-batches from a replay buffer actor
  on a process of its own, driven as the controller drives it (`train_updates`: the decoupled loss, the
  metrics; the batch's completions staged in the buffer from a generator standing in (`BatchHolder`) and
  added, untimed; `sample` composes the batch there, each rank fetches its micro-batch by reference),
  timed by the caller from `sample` to the last update.

Each figure is the best of `repeats` timed steps, after one warm-up step. With them, each trainer
rank's resident memory added while loading the model as the trainer does (several ranks read only their
own shards), and its peak; the trainer's peak while training; and the trainer actor with a LoRA adapter of
`--lora-rank` instead (on the first rank count): its step and its peak against full fine-tuning.
"""

import asyncio
import dataclasses
import time
from pathlib import Path

import torch
from monarch.actor import Actor, concurrent_endpoint, endpoint

from meshrl.actors import in_rank_order, parse_cpus, spawn, spawn_ranks
from meshrl.actors.distributed import join, load_on_ranks
from meshrl.actors.held import HeldCompletions
from meshrl.actors.replay_buffer import FifoBuffer
from meshrl.actors.replay_buffer_config import ReplayBufferConfig
from meshrl.actors.trainer import TitanTrainer
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.losses import autocast, response_logits, token_logprobs
from meshrl.models.lora import LoraConfig
from meshrl.models.model import build_policy, load_policy, read_hf_config, resolve_checkpoint
from meshrl.train_step import train_updates
from meshrl.types import BatchRef, Completion, Episode, GroupEpisodes, TrainBatch
from meshrl.weight_sync import WeightSyncConfig


def episodes(batch: int, prompt: int, response: int) -> list[Episode]:
    """A fixed batch: `batch` sequences of `prompt` + `response` tokens, advantages +1 and -1."""
    return [Episode(tokens=[(31 * i + 7 * t) % 40000 + 100 for t in range(prompt + response)],
                    loss_mask=[False] * prompt + [True] * response,
                    behaviour_logprobs=[0.0] * prompt + [-10.0] * response,
                    advantage=1.0 if i % 2 else -1.0, policy_version=0, group_id=i) for i in range(batch)]


class BatchHolder(Actor):
    """A generator's holding of Completions, without the generator: the replay buffer takes the bench's
    batch from it by key (`completions`, as from a real generator) before each step from the buffer."""

    def __init__(self):
        self.held = HeldCompletions(0)

    @concurrent_endpoint
    async def hold(self, completions: list[Completion]) -> list[int]:
        """Hold `completions`; their keys."""
        return [self.held.keep(c).key for c in completions]

    @concurrent_endpoint
    async def completions(self, keys: list[int], forget: bool = False) -> list[Completion]:
        return self.held.take(keys, forget)


class PlainLoop(Actor):
    """The baseline: a training loop written against torch and torchtitan directly, no meshrl."""

    def __init__(self, checkpoint: str, config: TrainerConfig, episodes: list[Episode]):
        me = join(config.device, config.cpus, config.num_threads)
        self.device = me.device
        self.model, _ = load_policy(checkpoint)
        self.model.to(self.device).train()
        if me.world > 1:  # torch's own FSDP2, layer by layer, then the root
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.device.type, (me.world,))
            for layer in self.model.layers.values():
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr)
        share = len(episodes) // me.world
        mine = episodes[me.rank * share:(me.rank + 1) * share]
        self.batch = TrainBatch.collate(mine, sum(e.num_response_tokens for e in episodes), len(episodes)).to(self.device)

    @endpoint
    async def step(self) -> float:
        """Seconds of one training step on this rank's share of the batch."""
        start = time.perf_counter()
        with autocast(self.device, True):
            logits = response_logits(self.model, self.batch)
        mask = self.batch.loss_mask
        logprobs = token_logprobs(logits, self.batch.target_ids[mask])
        advantages = self.batch.advantages.unsqueeze(1).expand_as(mask)[mask]
        loss = -(advantages * logprobs).sum() / self.batch.loss_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the clock after the kernels, not after their launch
        return time.perf_counter() - start


class MeasuredTrainer(TitanTrainer):
    """The real trainer, which also says its process's peak resident memory (the kernel's high-water mark)."""

    @endpoint
    async def peak_rss_mb(self) -> float:
        return _status_mb("VmHWM")


class LoadProbe(Actor):
    """A rank that only loads the policy as the trainer does (`load_on_ranks`): its resident memory
    before, and the peak while loading (the kernel's high-water mark, reset just before)."""

    def __init__(self, checkpoint: str, config: TrainerConfig):
        self.me = join(config.device, config.cpus, config.num_threads)
        self.checkpoint = checkpoint
        with torch.device("meta"):  # the model's code imported before measuring: shapes only, no memory
            build_policy(read_hf_config(checkpoint))

    @endpoint
    async def load(self) -> dict:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status_mb("VmRSS")
        load_on_ranks(self.checkpoint, self.me)
        return {"before_mb": before, "peak_mb": _status_mb("VmHWM")}


def _status_mb(field: str) -> float:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def run(model: str, rank_counts: list[int], batch: int, prompt: int, response: int, repeats: int,
        lora_rank: int = 16) -> dict:
    for ranks in rank_counts:
        if ranks < 1 or batch % ranks:
            raise ValueError(f"--batch {batch} does not split over {ranks} ranks")
    return asyncio.run(_run(model, rank_counts, batch, prompt, response, repeats, lora_rank))


async def _run(model: str, rank_counts: list[int], batch: int, prompt: int, response: int, repeats: int,
               lora_rank: int) -> dict:
    checkpoint = str(resolve_checkpoint(model))
    cores = sorted(parse_cpus(""))
    data = episodes(batch, prompt, response)
    tokens = sum(len(e.tokens) for e in data)
    result = {"model": model, "batch": batch, "tokens_per_step": tokens, "cores": len(cores), "repeats": repeats}
    for ranks in rank_counts:
        shares = [cores[r::ranks] for r in range(ranks)]  # the cores dealt out between the ranks
        config = TrainerConfig(lr=1e-6, ranks=ranks, num_threads=len(shares[0]), micro_batch_size=batch // ranks,
                               cpus=";".join(",".join(map(str, s)) for s in shares))
        procs, plain = await spawn_ranks("plain", PlainLoop, ranks, checkpoint, config, data)
        try:
            await plain.step.call()  # warm up
            plain_s = min([max(s for _, s in (await plain.step.call()).items()) for _ in range(repeats)])
        finally:
            await procs.stop()
        procs, probe = await spawn_ranks("load", LoadProbe, ranks, checkpoint, config)
        try:
            loads = await in_rank_order(probe.load.call())
        finally:
            await procs.stop()
        trainer_s, peak = await _trainer_step_s(checkpoint, config, data, repeats)
        if ranks == rank_counts[0] and lora_rank:
            lora = dataclasses.replace(config, lora=LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank), lr=1e-5)
            lora_s, lora_peak = await _trainer_step_s(checkpoint, lora, data, repeats)
            result["lora"] = {"rank": lora_rank, "ranks": ranks, "trainer_tokens_per_s": tokens / lora_s,
                              "vs_full": trainer_s / lora_s, "trainer_peak_rss_mb": lora_peak,
                              "peak_vs_full": lora_peak / peak}
        result[f"ranks_{ranks}"] = {"plain_tokens_per_s": tokens / plain_s, "trainer_tokens_per_s": tokens / trainer_s,
                                    "trainer_vs_plain": plain_s / trainer_s,
                                    "trainer_peak_rss_mb": peak,
                                    "load_mb_per_rank": max(r["peak_mb"] - r["before_mb"] for r in loads),
                                    "load_peak_rss_mb_per_rank": max(r["peak_mb"] for r in loads)}
    return result


async def _trainer_step_s(checkpoint: str, config: TrainerConfig, data: list[Episode], repeats: int):
    """The best of `repeats` steps of the trainer actor from the replay buffer (after a warm-up), and its
    ranks' peak memory."""
    procs, trainer = await spawn_ranks("trainer", MeasuredTrainer, config.ranks, config, WeightSyncConfig(), checkpoint)
    buffer_procs, buffer = spawn("replay_buffer", FifoBuffer, ReplayBufferConfig(), config, len(data), 0, 0)
    holder_procs, holder = spawn("holder", BatchHolder)
    try:
        await trainer.attach_buffer.call(buffer)
        times = [await _step_from_buffer(trainer, buffer, holder, data, config, i) for i in range(repeats + 1)]
        return min(times[1:]), max(await in_rank_order(trainer.peak_rss_mb.call()))
    finally:
        await asyncio.gather(procs.stop(), buffer_procs.stop(), holder_procs.stop())


async def _step_from_buffer(trainer, buffer, holder, data: list[Episode], config: TrainerConfig, index: int) -> float:
    """Seconds of one step whose micro-batches the trainer takes from the replay buffer (the batch put
    there first, untimed, as the controller has it done while groups finish: each group's completions
    staged from the generator holding them, then its episodes added)."""
    turns = []
    for e in data:
        prompt = e.loss_mask.index(True)
        turns.append(Completion(e.group_id, e.tokens[:prompt], e.tokens[prompt:], e.behaviour_logprobs[prompt:], "", 0,
                                "stop"))
    keys = await holder.hold.call_one(turns)
    if not all(await buffer.stage.call_one([(e.group_id, 0, [[(0, key)]]) for e, key in zip(data, keys)], [holder])):
        raise RuntimeError("the replay buffer could not take the groups' completions")
    await buffer.add.call_one(index, [GroupEpisodes(e.group_id, [(0, 0, 1)], [e.advantage], [index], [0.0, 1.0], 1.0)
                                      for e in data])
    start = time.perf_counter()
    plan = await buffer.sample.call_one(index, [e.group_id for e in data])
    updates = [[BatchRef(index, u, m) for m in range(count)] for u, count in enumerate(plan["micro_batches"])]
    await train_updates(trainer, None, updates, config)
    seconds = time.perf_counter() - start
    await buffer.trained.call_one(index, index + 1)
    return seconds


def report(result: dict) -> str:
    lines = [f"trainer, {result['model']}: {result['batch']} sequences, {result['tokens_per_step']} tokens a step, "
             f"{result['cores']} cores (best of {result['repeats']} warm steps)"]
    for key in (k for k in result if k.startswith("ranks_")):
        r = result[key]
        lines.append(f"  {key.replace('_', ' '):8s} plain loop {r['plain_tokens_per_s']:7.1f} tokens/s   trainer actor "
                     f"{r['trainer_tokens_per_s']:7.1f} tokens/s   ({r['trainer_vs_plain']:.2f} x plain, from the "
                     "replay buffer)   "
                     f"loading: +{r['load_mb_per_rank']:.0f} MB per rank (peak {r['load_peak_rss_mb_per_rank']:.0f} MB), "
                     f"training: peak {r['trainer_peak_rss_mb']:.0f} MB per rank")
    if "lora" in result:
        r = result["lora"]
        lines.append(f"  a LoRA adapter of rank {r['rank']} instead ({r['ranks']} rank(s)): trainer actor "
                     f"{r['trainer_tokens_per_s']:7.1f} tokens/s ({r['vs_full']:.2f} x full fine-tuning), peak "
                     f"{r['trainer_peak_rss_mb']:.0f} MB per rank ({r['peak_vs_full']:.2f} x)")
    return "\n".join(lines)
