"""Rollout collection, one prompt's group at a time: each group is generated on the least-loaded
generator replica, graded as soon as it is complete, and joins the batch being filled in the order
groups finish; a full batch becomes trainer-ready Episodes (with their group advantages) in the
replay buffer. The same on the eval split.

The controller decides when another group may start (its staleness gate, from `next_batch`); this
module decides what a batch is: which prompts, which groups are kept, and what the trainer receives.
"""

import asyncio
import dataclasses
import math
import statistics
from dataclasses import dataclass, field

from tqdm import tqdm

from meshrl.advantages import STEP_WISE, all_equal, estimator, step_wise
from meshrl.configs import Config
from meshrl.replicas import Replica, ReplicaPool
from meshrl.tasks import Sample, is_environment
from meshrl.timeouts import Timeouts
from meshrl.multiturn import converse
from meshrl.types import Completion, Episode, Prompt, Sampling, ScoredCompletion, Trajectory, model_turns


def build_episodes(group: list[ScoredCompletion], group_id: int, advantage: str = "grpo", eps: float = 1e-6,
                   divide_by_turns: bool = False) -> list[Episode]:
    """One prompt's scored completions (or trajectories) -> flat Episodes carrying the group advantage:
    one per completion, trained on all its model turns; with a `step_wise_` estimator one per model turn
    (everything before the turn as its prompt), each with its trajectory's advantage, divided by the
    trajectory's number of turns with `divide_by_turns`."""
    rewards = [s.reward for s in group]
    turns = [model_turns(s.completion) for s in group]
    if advantage.startswith(STEP_WISE):
        per_turn = step_wise(rewards, [len(t) for t in turns], advantage.removeprefix(STEP_WISE), divide_by_turns, eps)
        return [episode([turn], a, group_id, version=min(t.policy_version for t in ts))
                for ts, advantages in zip(turns, per_turn) for turn, a in zip(ts, advantages)]
    return [episode(ts, a, group_id) for ts, a in zip(turns, estimator(advantage)(rewards, eps))]


def episode(turns: list[Completion], advantage: float, group_id: int, version: int | None = None) -> Episode:
    """The last turn's prompt and tokens, trained on the tokens of each of `turns` (the environment's
    and the prompt's tokens are masked out); its version the oldest of its turns' unless given."""
    last = turns[-1]
    tokens = last.prompt_token_ids + last.token_ids
    loss_mask, logprobs = [False] * len(tokens), [0.0] * len(tokens)
    for turn in turns:
        start, end = len(turn.prompt_token_ids), len(turn.prompt_token_ids) + len(turn.token_ids)
        loss_mask[start:end], logprobs[start:end] = [True] * len(turn.token_ids), turn.logprobs
    return Episode(tokens, loss_mask, logprobs, advantage,
                   min(t.policy_version for t in turns) if version is None else version, group_id)


def check_rates(scored: list[ScoredCompletion], total: int, prefix: str,
                accuracy: str = "correct") -> dict[str, float]:
    """The mean of each reward check over `total` completions (those not in `scored` count as 0): the
    task's `accuracy` check as `{prefix}accuracy`, the others under their own names."""
    names = dict.fromkeys([accuracy, *(k for s in scored for k in s.reward_components)])
    return {prefix + ("accuracy" if k == accuracy else k):
            sum(s.reward_components.get(k, 0.0) for s in scored) / total if total else math.nan for k in names}


def rollout_record(scored: ScoredCompletion, group_id: int, prompt: str) -> dict:
    """One completion as rollouts.jsonl keeps it (the recorder adds the step and the staleness)."""
    c = scored.completion
    return {"prompt_index": c.prompt_index, "group": group_id, "prompt": prompt, "completion": c.text,
            "reward": scored.reward, "reward_components": scored.reward_components,
            "policy_version": c.policy_version, "finish_reason": c.finish_reason,
            **({"turns": len(c.turns)} if isinstance(c, Trajectory) else {})}



@dataclass
class Group:
    """One prompt's group as it came back from a generator and a grader."""

    prompt_index: int
    scored: list[ScoredCompletion]  # those whose reward function did not fail
    completions: int
    tokens: int
    policy_version: int  # the oldest version its completions sampled from
    launched: float  # tracer times (seconds since the run started)
    gen_start: float
    gen_end: float
    pull_time_s: float  # weight pulls this group waited for


@dataclass
class Rollout:
    """One generated, scored batch: its episodes wait in the replay buffer for the step that trains them."""

    num_episodes: int  # one per completion, or per model turn with a step-wise estimator
    turns_mean: float  # model turns per trained completion (1 unless the task is an environment)
    equal_reward_groups: int  # groups whose completions all got the same reward: no learning signal
    groups_dropped: int  # left out for want of signal (drop_equal_reward_groups)
    groups_stale: int  # finished too late for the staleness bound of the batch being filled; resampled
    rewards: list[float]
    checks: dict[str, float]  # the reward's checks, averaged over the batch's scored completions
    reward_errors: int
    tokens_generated: int
    gen_time_s: float  # from the batch's first generate call to its last one's end
    pull_time_s: float  # the longest any group waited for a weight pull (groups waiting on one pull overlap)
    rollout_time_s: float  # from its first group's start to the batch being full
    records: list[dict]  # one per completion of the kept groups, for rollouts.jsonl


@dataclass
class Filling:
    """The batch being filled: every group that finished into it, kept or not."""

    kept: dict[int, list[ScoredCompletion]] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)
    equal: int = 0
    stale: int = 0

    def add(self, group: Group, size: int, tries: int, drop_equal: bool) -> bool:
        """Count a finished group and keep it unless it has nothing to train (every reward failed; or
        all rewards equal, with `drop_equal`). True once the batch is full: `size` groups kept, or
        `tries` groups finished into it (a batch short of signal trains on what it has)."""
        self.groups.append(group)
        no_signal = bool(group.scored) and all_equal([s.reward for s in group.scored])
        self.equal += no_signal
        if group.scored and not (no_signal and drop_equal):
            self.kept[group.prompt_index] = group.scored
        return len(self.kept) >= size or len(self.groups) >= tries


class RolloutCollector:
    """Runs groups on the generator and grader pools and assembles batches from them."""

    def __init__(self, config: Config, task, tokenizer, generators: ReplicaPool, graders: ReplicaPool,
                 replay_buffer, tracer, timeouts: Timeouts = Timeouts()):
        self.config, self.task, self.tokenizer, self.tracer = config, task, tokenizer, tracer
        self.timeouts = timeouts
        self.generators, self.graders, self.replay_buffer = generators, graders, replay_buffer
        cfg = config.controller
        self.sampling = Sampling(n=cfg.group_size, temperature=config.generator.temperature,
                                 top_p=config.generator.top_p, max_tokens=config.generator.max_tokens)
        self.batch_size = cfg.prompts_per_step
        # without dynamic sampling a batch takes the first prompts_per_step groups, whatever they hold
        self.tries = cfg.prompts_per_step * (cfg.max_sample_rounds if cfg.drop_equal_reward_groups else 1)
        self.next_prompt = 0  # the task's next training sample
        self.latest = 0  # the newest version the trainer published: replicas pull it before their next group
        self.batches_done = 0
        self.filling = Filling()
        self.running: dict[asyncio.Task, int] = {}  # groups generating, and their prompt indices
        self.relaunch: list[int] = []  # prompts whose groups were stopped before they finished: started first
        self.finished: asyncio.Queue[Group | BaseException | None] = asyncio.Queue()

    def next_batch(self) -> int | None:
        """The batch a group started now would help fill, or None when every batch has its groups."""
        slots = self.batches_done * self.batch_size + len(self.filling.kept) + len(self.running)
        batch = slots // self.batch_size
        return batch if batch < self.config.controller.steps else None

    def launch(self) -> None:
        """Start the next training prompt's group (a stopped one's first)."""
        if self.relaunch:
            index = self.relaunch.pop(0)
        else:
            index, self.next_prompt = self.next_prompt, self.next_prompt + 1
        task = asyncio.create_task(self.run_group(index, self.task.train_sample(index), self.sampling, "generate"))
        self.running[task] = index
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.running.pop(task, None)
        if not task.cancelled():
            self.finished.put_nowait(task.exception() or task.result())

    async def settle(self, stop_running: bool) -> list[Rollout]:
        """Bring the data position to rest for a checkpoint (while nothing launches groups or takes
        them from `finished`): the groups still generating finish (or, with `stop_running`, are stopped
        and their prompts kept to start first again), then every finished group joins its batch.
        Returns the batches that became full."""
        if stop_running:
            stopped = dict(self.running)
            for task in stopped:
                task.cancel()
            await asyncio.gather(*stopped, return_exceptions=True)
            self.relaunch = sorted([*self.relaunch, *(i for t, i in stopped.items() if t.cancelled())])
        elif self.running:
            await asyncio.wait(set(self.running))
        full = []
        while not self.finished.empty():
            if rollout := await self.next_rollout():
                full.append(rollout)
        return full

    def snapshot(self) -> dict:
        """The data position (call once settled): what `restore` needs to go on from here."""
        return {"next_prompt": self.next_prompt, "batches_done": self.batches_done, "filling": self.filling,
                "relaunch": list(self.relaunch), "latest": self.latest}

    def restore(self, position: dict) -> None:
        self.next_prompt, self.batches_done = position["next_prompt"], position["batches_done"]
        self.filling, self.relaunch, self.latest = position["filling"], list(position["relaunch"]), position["latest"]

    def published(self, version: int) -> None:
        """A new policy version: replicas pull it before their next group; wake `next_rollout`."""
        self.latest = version
        self.finished.put_nowait(None)

    async def next_rollout(self) -> Rollout | None:
        """Wait for the next finished group (or a new version) and add it to the batch being filled;
        the batch, once full, goes to the replay buffer and is returned."""
        group = await self.finished.get()
        if isinstance(group, BaseException):
            raise group
        if group is None:
            return None
        f, max_age = self.filling, self.config.replay_buffer.max_policy_age
        if self.batches_done - group.policy_version > max_age:  # batch i trains at version i
            f.stale += 1
            return None
        if not f.add(group, self.batch_size, self.tries, self.config.controller.drop_equal_reward_groups):
            return None
        self.filling, self.batches_done = Filling(), self.batches_done + 1
        return await self._close(f)

    async def _close(self, f: Filling) -> Rollout:
        cfg = self.config.controller
        episodes = [e for gid, group in f.kept.items()
                    for e in build_episodes(group, gid, cfg.advantage, cfg.advantage_eps, cfg.divide_by_turns)]
        async with self.tracer.span("replay_buffer", "add", timeout=self.timeouts.replay_buffer):
            await self.replay_buffer.add.call_one(episodes)
        trained = [s for group in f.kept.values() for s in group]  # the rewards of the batch trained
        return Rollout(
            num_episodes=len(episodes), equal_reward_groups=f.equal,
            turns_mean=statistics.fmean(len(model_turns(s.completion)) for s in trained) if trained else math.nan,
            groups_dropped=f.equal if cfg.drop_equal_reward_groups else 0, groups_stale=f.stale,
            rewards=[s.reward for s in trained], checks=check_rates(trained, len(trained), "", self.task.accuracy),
            reward_errors=sum(g.completions - len(g.scored) for g in f.groups),
            tokens_generated=sum(g.tokens for g in f.groups),
            gen_time_s=max(g.gen_end for g in f.groups) - min(g.gen_start for g in f.groups),
            pull_time_s=max(g.pull_time_s for g in f.groups),
            rollout_time_s=self.tracer.now() - min(g.launched for g in f.groups),
            records=[rollout_record(s, gid, self.task.train_sample(gid).prompt)
                     for gid, group in f.kept.items() for s in group])

    async def stop(self) -> None:
        for task in list(self.running):
            task.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)

    async def evaluate(self, step: int) -> dict[str, float]:
        """The newest policy on the task's fixed eval split (`eval_samples` per prompt at `eval_temperature`;
        greedy by default): each reward check's mean as `eval_<check>` (the task's accuracy check as `eval_accuracy`).
        Prints the rates and three example completions."""
        cfg = self.config.controller
        samples = self.task.eval_samples()
        sampling = Sampling(n=cfg.eval_samples, temperature=cfg.eval_temperature, top_p=self.config.generator.top_p,
                            max_tokens=self.config.generator.max_tokens)
        groups = await asyncio.gather(*(self.run_group(i, s, sampling, "evaluate") for i, s in enumerate(samples)))
        scored = [s for g in groups for s in g.scored]
        rates = check_rates(scored, sum(g.completions for g in groups), "eval_", self.task.accuracy)  # failed: 0
        lines = [f"eval at step {step}: " + "  ".join(f"{k.removeprefix('eval_')} {v:.3f}" for k, v in rates.items())]
        for g in groups[:3]:
            reply = g.scored[0].completion.text.strip() if g.scored else "(its reward function failed)"
            lines += [f"  prompt: {samples[g.prompt_index].prompt}", f"  reply:  {reply!r}"]
        tqdm.write("\n".join(lines))
        return rates

    async def run_group(self, index: int, sample: Sample, sampling: Sampling, what: str) -> Group:
        """One prompt's completions (or, for an environment, conversations) from generator replicas (each
        first loads the newest weights), graded by grader replicas. A replica that fails is replaced and
        its call redone elsewhere."""
        launched = self.tracer.now()
        calls = []  # each generate call's span and the seconds it waited for a weight pull
        tokens, oldest = 0, math.inf

        async def generate(prompts: list[Prompt], sampling: Sampling) -> list[Completion]:
            nonlocal tokens, oldest

            async def on(replica: Replica):
                pull_time = await self._pull(replica)
                async with self.tracer.span("generator", what, replica.policy_version, replica.index,
                                            concurrent=True, timeout=self.timeouts.generate) as span:
                    return await replica.actor.generate.call_one(prompts, sampling=sampling), span, pull_time

            completions, span, pull_time = await self.generators.call(on)
            calls.append((span, pull_time))
            tokens += sum(len(c.token_ids) for c in completions)
            oldest = min(oldest, *(c.policy_version for c in completions))
            return completions

        def grade(endpoint: str, *args):  # a reward (score) or an environment's answer (step): a "grade" span
            async def on(replica: Replica):
                async with self.tracer.span("grader", "grade", replica=replica.index, timeout=self.timeouts.grade):
                    return await getattr(replica.actor, endpoint).call_one(*args)
            return self.graders.call(on)

        if is_environment(self.task):
            scored, failed = await converse(
                index, self.task.opening(sample), dataclasses.replace(sampling, stop=list(self.task.stop)),
                self.config.controller.max_turns, self.config.generator.max_model_len, self.tokenizer, generate,
                lambda conversations, last: grade("step", sample, conversations, last))
            completions = len(scored) + failed
        else:
            first = await generate([Prompt(index, self.tokenizer.encode_chat(sample.prompt))], sampling)
            scored, completions = await grade("score", first, sample.answer), len(first)
        return Group(index, scored, completions, tokens, oldest, launched, calls[0][0]["start"], calls[-1][0]["end"],
                     sum(pull_time for _, pull_time in calls))

    async def _pull(self, replica: Replica) -> float:
        """Bring `replica` to the newest published version; the seconds this call waited for it."""
        start = self.tracer.now()
        async with replica.pulling:
            if not replica.healthy:  # it failed while this call waited for it: the pool retries elsewhere
                raise RuntimeError(f"generator {replica.index} failed during another call's weight pull")
            if replica.policy_version < self.latest:
                async with self.tracer.span("generator", "pull", replica=replica.index,
                                            timeout=self.timeouts.pull) as span:
                    replica.policy_version = span["policy_version"] = await replica.actor.pull_weights.call_one()
        return self.tracer.now() - start
