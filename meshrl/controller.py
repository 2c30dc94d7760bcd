"""The controller: spawns one proc mesh per role and routes data between the actors.

Completions (generator) -> ScoredCompletions (grader) -> Episodes with group advantages (here)
-> ReplayBuffer -> TrainBatches (trainer) -> weight ring -> generator. A rollout loop and a
training loop run concurrently; `replay_buffer.max_policy_age` bounds how far the rollouts may
run ahead, and 0 makes the two alternate: synchronous training on the same code path.
"""

import asyncio
import json
import math
import signal
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from meshrl.actors import load_actor_class, spawn
from meshrl.advantages import all_equal, estimator
from meshrl.configs import Config, to_dict
from meshrl.loggers import MetricLoggers, RolloutRecorder
from meshrl.losses import check as check_loss
from meshrl.model import ChatTokenizer, resolve_checkpoint
from meshrl.plot import plot_curves
from meshrl.tasks import Sample, make_task
from meshrl.trace import Tracer
from meshrl.train_step import train_step
from meshrl.types import Episode, Prompt, Sampling, ScoredCompletion


def build_episodes(group: list[ScoredCompletion], group_id: int, advantage: str = "grpo",
                   eps: float = 1e-6) -> list[Episode]:
    """One prompt's scored completions -> flat Episodes carrying the group advantage."""
    advantages = estimator(advantage)([s.reward for s in group], eps)
    episodes = []
    for scored, adv in zip(group, advantages):
        c = scored.completion
        n_prompt = len(c.prompt_token_ids)
        episodes.append(Episode(
            tokens=c.prompt_token_ids + c.token_ids,
            loss_mask=[False] * n_prompt + [True] * len(c.token_ids),
            behaviour_logprobs=[0.0] * n_prompt + c.logprobs,
            advantage=adv,
            policy_version=c.policy_version,
            group_id=group_id,
        ))
    return episodes


def check_rates(scored: list[ScoredCompletion], total: int, prefix: str) -> dict[str, float]:
    """The mean of each reward check over `total` completions (those not in `scored` count as 0):
    `correct` as `{prefix}accuracy`, the others under their own names."""
    names = dict.fromkeys(["correct", *(k for s in scored for k in s.reward_components)])
    return {prefix + ("accuracy" if k == "correct" else k):
            sum(s.reward_components.get(k, 0.0) for s in scored) / total if total else math.nan for k in names}


def rollout_record(scored: ScoredCompletion, group_id: int, prompt: str) -> dict:
    """One completion as rollouts.jsonl keeps it (the recorder adds the step and the staleness)."""
    c = scored.completion
    return {"prompt_index": c.prompt_index, "group": group_id, "prompt": prompt, "completion": c.text,
            "reward": scored.reward, "reward_components": scored.reward_components,
            "policy_version": c.policy_version, "finish_reason": c.finish_reason}


@dataclass
class Actors:
    generator: object
    grader: object
    trainer: object
    replay_buffer: object
    procs: list
    reference: object | None = None


def actor_classes(config: Config) -> dict[str, type]:
    """The implementation each role's config names (checked before anything starts)."""
    roles = {"generator": config.generator, "grader": config.grader, "trainer": config.trainer,
             "replay_buffer": config.replay_buffer}
    if config.trainer.loss.kl_coef > 0:
        roles["reference"] = config.reference
    return {role: load_actor_class(role_config.impl) for role, role_config in roles.items()}


def spawn_actors(config: Config, classes: dict[str, type], checkpoint: Path) -> Actors:
    """One proc mesh per role."""
    args = {
        "generator": (config.generator, config.weight_sync, str(checkpoint)),
        "grader": (config.task, config.task_config),
        "trainer": (config.trainer, config.weight_sync, str(checkpoint)),
        "replay_buffer": (config.replay_buffer,),
        "reference": (config.reference, str(checkpoint)),
    }
    actors, procs = {}, []
    for role, cls in classes.items():
        mesh, actors[role] = spawn(role, cls, *args[role])
        procs.append(mesh)
    return Actors(**actors, procs=procs)


@dataclass
class Rollout:
    """One generated, scored batch: its episodes wait in the replay buffer for the step that trains them."""

    num_episodes: int
    equal_reward_groups: int  # groups whose completions all got the same reward: no learning signal
    groups_dropped: int
    rewards: list[float]
    checks: dict[str, float]  # the reward's checks, averaged over the batch's scored completions
    reward_errors: int
    tokens_generated: int
    gen_time_s: float
    pull_time_s: float
    rollout_time_s: float
    records: list[dict]  # one per completion of the kept groups, for rollouts.jsonl


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
        estimator(cfg.advantage)
        check_loss(config.trainer.loss)
        self.config = config
        self.run_dir = run_dir
        self.task = make_task(config.task, config.task_config)
        self.classes = actor_classes(config)
        self.checkpoint = resolve_checkpoint(config.model.source)
        self.tokenizer = ChatTokenizer(self.checkpoint)
        self.actors: Actors | None = None
        self.trainer_version = 0  # the newest version the trainer published
        self.generator_version = 0  # the version the generator serves
        self.published = asyncio.Condition()
        self.rollouts: asyncio.Queue[Rollout] = asyncio.Queue()
        self.rollout_task: asyncio.Task | None = None
        self.busy = {"generator": 0.0, "trainer": 0.0}  # seconds each has spent working

    async def run(self) -> dict:
        """Train for `controller.steps` steps; return (and write to summary.json) the eval rates before
        and after. Ctrl-C or SIGTERM stops it within one actor call: the policy trained so far is
        saved to final/ and everything written so far is kept (`stopped_by` in the summary)."""
        cfg = self.config.controller
        start = time.perf_counter()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(to_dict(self.config), indent=2))
        metrics = MetricLoggers(self.run_dir, self.config, name=self.run_dir.name)
        self.recorder = RolloutRecorder(self.run_dir, self.config.logging.rollouts_fraction)
        self.tracer = Tracer(self.run_dir)
        self.actors = spawn_actors(self.config, self.classes, self.checkpoint)
        self._catch_stop_signals()
        rows, initial, final = [], {}, {}
        try:
            span = self.tracer.span
            try:
                self.cancellable = True
                async with span("trainer", "attach"):
                    ring = await self.actors.trainer.weight_ring.call_one()
                async with span("generator", "attach"):
                    await self.actors.generator.attach_weights.call_one(ring)
                initial = await self.evaluate(step=0)
                self.rollout_task = asyncio.create_task(self._rollout_loop())
                with tqdm(range(1, cfg.steps + 1), unit="step") as bar:
                    last, busy = time.perf_counter(), dict(self.busy)
                    for step in bar:
                        row = await self.train_step(step)
                        now = time.perf_counter()
                        row["step_time_s"] = now - last
                        for role in self.busy:
                            row[f"{role}_busy"] = (self.busy[role] - busy[role]) / row["step_time_s"]
                        if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
                            row |= await self.evaluate(step)
                        last, busy = time.perf_counter(), dict(self.busy)
                        rows.append(row)
                        metrics.log(row)
                        bar.set_postfix(reward=f"{row['reward_mean']:.2f}", acc=f"{row['accuracy']:.2f}")
                final = {k: v for k, v in rows[-1].items() if k.startswith("eval_")}
            except asyncio.CancelledError:
                if self.stopped_by is None:
                    raise
                asyncio.current_task().uncancel()  # a requested stop: save and write what there is
            finally:
                self.cancellable = False
            async with span("trainer", "save", self.trainer_version):
                await self.actors.trainer.save.call_one(str(self.run_dir / "final"))
        finally:
            self._release_stop_signals()
            metrics.close()
            self.recorder.close()
            if self.rollout_task:
                self.rollout_task.cancel()
                await asyncio.gather(self.rollout_task, return_exceptions=True)
            for mesh in self.actors.procs:
                await mesh.stop()
            self.tracer.close()
        if rows:
            plot_curves(rows, initial, self.run_dir / "curves.png")
        summary = {**{f"{k}_initial": v for k, v in initial.items()}, **{f"{k}_final": v for k, v in final.items()},
                   "steps": len(rows), "wall_time_s": time.perf_counter() - start,
                   **({"stopped_by": self.stopped_by} if self.stopped_by else {})}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _catch_stop_signals(self) -> None:
        """Ctrl-C (SIGINT) or SIGTERM cancels the training; `run` then saves and writes what it has.

        Installed once the actors run: Monarch's runtime replaces the process's SIGINT handler beneath
        Python's, so asyncio's own Ctrl-C handling never fires. A second signal while stopping is
        ignored: stopping takes one actor call and the save."""
        self.stopped_by, self.cancellable = None, False
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
        """Generate, score and buffer one batch per train step, never more than max_policy_age ahead.

        Batch i feeds step i + 1, which trains at trainer version i, so it may only be sampled with
        a policy no older than version i - max_policy_age: wait until the trainer has published it.
        """
        cfg, gen_cfg, a = self.config.controller, self.config.generator, self.actors
        max_age = self.config.replay_buffer.max_policy_age
        sampling = Sampling(n=cfg.group_size, temperature=gen_cfg.temperature, top_p=gen_cfg.top_p,
                            max_tokens=gen_cfg.max_tokens)
        rounds = cfg.max_sample_rounds if cfg.drop_equal_reward_groups else 1
        next_prompt = 0
        for batch in range(cfg.steps):
            async with self.published:
                await self.published.wait_for(lambda: self.trainer_version >= batch - max_age)
            t0 = time.perf_counter()
            await self._pull()  # the newest version, between batches
            pull_time, gen_time = time.perf_counter() - t0, 0.0
            kept, scored, equal, completions, records = {}, [], 0, [], []
            # DAPO's dynamic sampling: with drop_equal_reward_groups, groups without signal are left out
            # and more prompts are sampled, up to max_sample_rounds blocks, to fill the batch.
            for _ in range(rounds):
                samples = {i: self.task.train_sample(i) for i in range(next_prompt, next_prompt + cfg.prompts_per_step)}
                next_prompt += cfg.prompts_per_step
                t1 = time.perf_counter()
                async with self.tracer.span("generator", "generate", self.generator_version):
                    block = await a.generator.generate.call_one(self._prompts(samples), sampling=sampling)
                gen_time += time.perf_counter() - t1
                completions += block
                for gid, group in (await self._score(block, samples)).items():
                    if not group:  # every completion's reward function failed
                        continue
                    scored += group
                    no_signal = all_equal([s.reward for s in group])
                    equal += no_signal
                    if not (cfg.drop_equal_reward_groups and no_signal):
                        kept[gid] = group
                        records += [rollout_record(s, gid, samples[gid].prompt) for s in group]
                if len(kept) >= cfg.prompts_per_step:
                    break
            self.busy["generator"] += pull_time + gen_time
            episodes = [e for gid, group in kept.items()
                        for e in build_episodes(group, gid, cfg.advantage, cfg.advantage_eps)]
            async with self.tracer.span("replay_buffer", "add"):
                await a.replay_buffer.add.call_one(episodes)
            await self.rollouts.put(Rollout(
                num_episodes=len(episodes), equal_reward_groups=equal,
                groups_dropped=equal if cfg.drop_equal_reward_groups else 0,
                rewards=[s.reward for s in scored], checks=check_rates(scored, len(scored), prefix=""),
                reward_errors=len(completions) - len(scored),
                tokens_generated=sum(len(c.token_ids) for c in completions),
                gen_time_s=gen_time, pull_time_s=pull_time, rollout_time_s=time.perf_counter() - t0,
                records=records))

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
                                 self.tracer.span, trained_version)
        t2 = time.perf_counter()
        async with self.tracer.span("trainer", "publish", trained_version + 1) as span:
            published = span["policy_version"] = await a.trainer.publish_weights.call_one()
        t3 = time.perf_counter()
        self.busy["trainer"] += t3 - t1
        async with self.published:
            self.trainer_version = published
            self.published.notify_all()
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

    async def evaluate(self, step: int) -> dict[str, float]:
        """The newest policy on the task's fixed eval split (`eval_samples` per prompt at `eval_temperature`;
        greedy by default): each reward check's mean as `eval_<check>` (`correct` as `eval_accuracy`).
        Prints the rates and three example completions."""
        cfg = self.config.controller
        await self._pull()
        samples = dict(enumerate(self.task.eval_samples()))
        sampling = Sampling(n=cfg.eval_samples, temperature=cfg.eval_temperature, top_p=self.config.generator.top_p,
                            max_tokens=self.config.generator.max_tokens)
        async with self.tracer.span("generator", "evaluate", self.generator_version):
            completions = await self.actors.generator.generate.call_one(self._prompts(samples), sampling=sampling)
        scored = [s for group in (await self._score(completions, samples)).values() for s in group]
        rates = check_rates(scored, len(completions), prefix="eval_")  # a failed reward counts as 0
        lines = [f"eval at step {step}: " + "  ".join(f"{k.removeprefix('eval_')} {v:.3f}" for k, v in rates.items())]
        for c in completions[:3 * cfg.eval_samples:cfg.eval_samples]:
            lines += [f"  prompt: {samples[c.prompt_index].prompt}", f"  reply:  {c.text.strip()!r}"]
        tqdm.write("\n".join(lines))
        return rates

    async def _pull(self) -> int:
        """The generator loads the newest published weights (if newer than its own)."""
        async with self.tracer.span("generator", "pull") as span:
            self.generator_version = span["policy_version"] = await self.actors.generator.pull_weights.call_one()
        return self.generator_version

    async def _sample(self, trained_version: int, n: int):
        async with self.tracer.span("replay_buffer", "sample", trained_version):
            return await self.actors.replay_buffer.sample.call_one(trained_version, n)

    async def _buffer_stats(self) -> dict:
        async with self.tracer.span("replay_buffer", "stats"):
            return await self.actors.replay_buffer.stats.call_one()

    def _prompts(self, samples: dict[int, Sample]) -> list[Prompt]:
        return [Prompt(i, self.tokenizer.encode_chat(s.prompt)) for i, s in samples.items()]

    async def _score(self, completions, samples: dict[int, Sample]) -> dict[int, list[ScoredCompletion]]:
        """Grade each prompt's completions as one group, all groups concurrently."""
        by_prompt = defaultdict(list)
        for c in completions:
            by_prompt[c.prompt_index].append(c)
        indices = list(by_prompt)
        async with self.tracer.span("grader", "grade"):  # one span: the grader serves them one by one
            scored = await asyncio.gather(*(
                self.actors.grader.score.call_one(by_prompt[i], samples[i].answer) for i in indices))
        return dict(zip(indices, scored))
