"""Rollout collection: prompts to the generator, completions to the grader, scored groups to
trainer-ready Episodes with their group advantages, and the same on the eval split.

The controller decides when a batch may be sampled (its staleness gate); this module decides what
a batch is: which prompts, how its groups are graded and kept, and what the trainer receives.
"""

import asyncio
import math
import time
from collections import defaultdict
from dataclasses import dataclass

from tqdm import tqdm

from meshrl.advantages import all_equal, estimator
from meshrl.configs import Config
from meshrl.tasks import Sample
from meshrl.types import Completion, Episode, Prompt, Sampling, ScoredCompletion


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


def keep_groups(groups: dict[int, list[ScoredCompletion]], kept: dict[int, list[ScoredCompletion]], need: int,
                drop_equal: bool) -> tuple[int, int]:
    """Add graded groups to `kept` (in order) until it holds `need`. Groups whose rewards are all
    equal are left out when `drop_equal` (DAPO's dynamic sampling); groups whose every reward
    function failed are empty and left out. Returns (groups with equal rewards, groups with
    signal that found the batch full)."""
    equal = surplus = 0
    for gid, group in groups.items():
        if not group:
            continue
        no_signal = all_equal([s.reward for s in group])
        equal += no_signal
        if drop_equal and no_signal:
            continue
        if len(kept) >= need:
            surplus += 1
            continue
        kept[gid] = group
    return equal, surplus


def rollout_record(scored: ScoredCompletion, group_id: int, prompt: str) -> dict:
    """One completion as rollouts.jsonl keeps it (the recorder adds the step and the staleness)."""
    c = scored.completion
    return {"prompt_index": c.prompt_index, "group": group_id, "prompt": prompt, "completion": c.text,
            "reward": scored.reward, "reward_components": scored.reward_components,
            "policy_version": c.policy_version, "finish_reason": c.finish_reason}


@dataclass
class Rollout:
    """One generated, scored batch: its episodes wait in the replay buffer for the step that trains them."""

    num_episodes: int
    equal_reward_groups: int  # groups whose completions all got the same reward: no learning signal
    groups_dropped: int
    groups_surplus: int  # groups with signal sampled after the batch was full: graded, not trained
    rewards: list[float]
    checks: dict[str, float]  # the reward's checks, averaged over the batch's scored completions
    reward_errors: int
    tokens_generated: int
    gen_time_s: float
    pull_time_s: float
    rollout_time_s: float
    records: list[dict]  # one per completion of the kept groups, for rollouts.jsonl


class RolloutCollector:
    """Runs one batch's (or the eval split's) generation and grading on the role actors."""

    def __init__(self, config: Config, task, tokenizer, actors, tracer):
        self.config, self.task, self.tokenizer, self.actors, self.tracer = config, task, tokenizer, actors, tracer
        self.next_prompt = 0  # the task's next training sample
        self.generator_version = 0  # the version the generator serves

    async def collect(self) -> Rollout:
        """Pull the newest weights, then generate and grade prompts until the batch is full, and put
        its Episodes into the replay buffer.

        With drop_equal_reward_groups (DAPO's dynamic sampling) groups without signal are left out
        and more prompts are sampled, up to max_sample_rounds blocks, to fill the batch."""
        cfg, gen_cfg = self.config.controller, self.config.generator
        sampling = Sampling(n=cfg.group_size, temperature=gen_cfg.temperature, top_p=gen_cfg.top_p,
                            max_tokens=gen_cfg.max_tokens)
        t0 = time.perf_counter()
        pull_time = await self.pull()  # the newest version, between batches
        gen_time = 0.0
        kept, scored, completions, prompts = {}, [], [], {}
        equal = surplus = 0
        for _ in range(cfg.max_sample_rounds if cfg.drop_equal_reward_groups else 1):
            samples = {i: self.task.train_sample(i) for i in range(self.next_prompt,
                                                                    self.next_prompt + cfg.prompts_per_step)}
            self.next_prompt += cfg.prompts_per_step
            prompts |= {i: sample.prompt for i, sample in samples.items()}
            block, seconds = await self.generate(samples, sampling, "generate")
            gen_time += seconds
            completions += block
            groups = await self.score(block, samples)
            scored += [s for group in groups.values() for s in group]
            block_equal, block_surplus = keep_groups(groups, kept, cfg.prompts_per_step, cfg.drop_equal_reward_groups)
            equal, surplus = equal + block_equal, surplus + block_surplus
            if len(kept) >= cfg.prompts_per_step:
                break
        records = [rollout_record(s, gid, prompts[gid]) for gid, group in kept.items() for s in group]
        episodes = [e for gid, group in kept.items()
                    for e in build_episodes(group, gid, cfg.advantage, cfg.advantage_eps)]
        trained = [s for group in kept.values() for s in group]  # the rewards of the batch trained
        async with self.tracer.span("replay_buffer", "add"):
            await self.actors.replay_buffer.add.call_one(episodes)
        return Rollout(
            num_episodes=len(episodes), equal_reward_groups=equal,
            groups_dropped=equal if cfg.drop_equal_reward_groups else 0, groups_surplus=surplus,
            rewards=[s.reward for s in trained], checks=check_rates(trained, len(trained), prefix=""),
            reward_errors=len(completions) - len(scored),
            tokens_generated=sum(len(c.token_ids) for c in completions),
            gen_time_s=gen_time, pull_time_s=pull_time, rollout_time_s=time.perf_counter() - t0,
            records=records)

    async def evaluate(self, step: int) -> dict[str, float]:
        """The newest policy on the task's fixed eval split (`eval_samples` per prompt at `eval_temperature`;
        greedy by default): each reward check's mean as `eval_<check>` (`correct` as `eval_accuracy`).
        Prints the rates and three example completions."""
        cfg = self.config.controller
        await self.pull()
        samples = dict(enumerate(self.task.eval_samples()))
        sampling = Sampling(n=cfg.eval_samples, temperature=cfg.eval_temperature, top_p=self.config.generator.top_p,
                            max_tokens=self.config.generator.max_tokens)
        completions, _ = await self.generate(samples, sampling, "evaluate")
        scored = [s for group in (await self.score(completions, samples)).values() for s in group]
        rates = check_rates(scored, len(completions), prefix="eval_")  # a failed reward counts as 0
        lines = [f"eval at step {step}: " + "  ".join(f"{k.removeprefix('eval_')} {v:.3f}" for k, v in rates.items())]
        for c in completions[:3 * cfg.eval_samples:cfg.eval_samples]:
            lines += [f"  prompt: {samples[c.prompt_index].prompt}", f"  reply:  {c.text.strip()!r}"]
        tqdm.write("\n".join(lines))
        return rates

    async def pull(self) -> float:
        """The generator loads the newest published weights (if newer than its own); returns the
        seconds it took (not counting a wait behind another call to the generator, such as an eval)."""
        async with self.tracer.span("generator", "pull") as span:
            self.generator_version = span["policy_version"] = await self.actors.generator.pull_weights.call_one()
        return span["end"] - span["start"]

    async def generate(self, samples: dict[int, Sample], sampling: Sampling,
                       what: str) -> tuple[list[Completion], float]:
        """The completions, and the seconds the generator spent on them (as for `pull`)."""
        prompts = [Prompt(i, self.tokenizer.encode_chat(s.prompt)) for i, s in samples.items()]
        async with self.tracer.span("generator", what, self.generator_version) as span:
            completions = await self.actors.generator.generate.call_one(prompts, sampling=sampling)
        return completions, span["end"] - span["start"]

    async def score(self, completions, samples: dict[int, Sample]) -> dict[int, list[ScoredCompletion]]:
        """Grade each prompt's completions as one group, all groups concurrently."""
        by_prompt = defaultdict(list)
        for c in completions:
            by_prompt[c.prompt_index].append(c)
        indices = list(by_prompt)
        async with self.tracer.span("grader", "grade"):  # one span: the grader serves them one by one
            scored = await asyncio.gather(*(
                self.actors.grader.score.call_one(by_prompt[i], samples[i].answer) for i in indices))
        return dict(zip(indices, scored))
