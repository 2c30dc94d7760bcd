"""Episode building: a complete batch's groups become flat, trainer-ready Episodes with their group
advantages, together with the batch's rollout metrics and the records rollouts.jsonl keeps, and what the
steps' rows say of the replies whose reward function raised (a step's warning, the bound that stops a run,
the run's totals). Pure functions: the controller's side of the data, after the grader and before the
trainer."""

import json
import math
from array import array
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from meshrl.advantages import STEP_WISE, estimator, population_std, step_wise
from meshrl.types import LOGPROB, MASK, Completion, Episode, GroupEpisodes, ScoredCompletion, Trajectory, model_turns
from meshrl.work_buffer import Batch, Filling


def build_episodes(group: list[ScoredCompletion], group_id: int, cfg, temperature: float,
                   sequences: list[list[Completion]] | None = None) -> list[Episode]:
    """One prompt's scored completions (or trajectories) -> flat Episodes carrying the group advantage
    (`cfg.advantage`, with `cfg.advantage_eps`): one per completion, trained on all its model turns; with a
    `step_wise_` estimator one per model turn (everything before the turn as its prompt), each with its
    trajectory's advantage, divided by the trajectory's number of turns with `cfg.divide_by_turns`.
    `temperature`: the one they were sampled at; an episode's policy version is its sequence's, by the
    `cfg.staleness` rule (a step-wise episode's, its whole trajectory's). `cfg`: the run's controller
    section (meshrl.configs.ControllerConfig, whose defaults are the only ones). `sequences`: each one's
    model turns as whole Completions (the replay buffer's, taken from the generators); by default the scored
    ones' own, when they are whole Completions."""
    if sequences is None:
        sequences = [model_turns(s.completion) for s in group]
    return flatten(group_episodes(group, group_id, cfg, temperature), sequences)


def group_episodes(group: list[ScoredCompletion], group_id: int, cfg, temperature: float) -> GroupEpisodes:
    """`build_episodes`'s Episodes before they are flattened: the sequence and turns, advantage and version
    of each (no token list: the controller has none)."""
    advantage, eps, divide_by_turns, staleness = cfg.advantage, cfg.advantage_eps, cfg.divide_by_turns, cfg.staleness
    rewards = [s.reward for s in group]
    counts = [len(model_turns(s.completion)) for s in group]
    versions = [s.completion.sampled_version(staleness) for s in group]
    if advantage.startswith(STEP_WISE):
        per_turn = step_wise(rewards, counts, advantage.removeprefix(STEP_WISE), divide_by_turns, eps)
        each = [((i, j, j + 1), a, version) for i, (advantages, version) in enumerate(zip(per_turn, versions))
                for j, a in enumerate(advantages)]
    else:
        each = [((i, 0, n), a, v) for i, (n, a, v) in enumerate(zip(counts, estimator(advantage)(rewards, eps),
                                                                      versions))]
    return GroupEpisodes(group_id, [t for t, _, _ in each], [a for _, a, _ in each], [v for _, _, v in each], rewards,
                         temperature)


def flatten(group: GroupEpisodes, sequences: list[list[Completion]]) -> list[Episode]:
    """A group's flat, trainer-ready Episodes from its sequences' model turns (`sequences`, as the
    generators kept them), each trained on the turns `group.turns` names."""
    return [episode(sequences[s][first:end], a, group.group_id, group.temperature, version)
            for (s, first, end), a, version in zip(group.turns, group.advantages, group.versions)]


def episode(turns: list[Completion], advantage: float, group_id: int, temperature: float,
            version: int | None = None) -> Episode:
    """The last turn's prompt and tokens, trained on the tokens of each of `turns` (the environment's
    and the prompt's tokens are masked out); its version the oldest of its turns' unless given."""
    last = turns[-1]
    context = len(last.prompt_token_ids)
    loss_mask = array(MASK, [0]) * context + array(MASK, [1]) * len(last.token_ids)
    logprobs = array(LOGPROB, [0.0]) * context + last.logprobs
    for turn in turns[:-1]:  # the earlier turns of a trajectory, inside the last turn's prompt
        start, end = len(turn.prompt_token_ids), len(turn.prompt_token_ids) + len(turn.token_ids)
        loss_mask[start:end], logprobs[start:end] = array(MASK, [1]) * len(turn.token_ids), turn.logprobs
    if version is None:
        version = min(t.policy_version for t in turns)
    return Episode(last.prompt_token_ids + last.token_ids, loss_mask, logprobs, advantage, version, group_id,
                   temperature)


def check_rates(checks: list[dict[str, float]], total: int, prefix: str,
                accuracy: str = "correct") -> dict[str, float]:
    """The mean of each reward check over `total` completions (`checks`: the reward components of those
    scored; the others count as 0): the task's `accuracy` check as `{prefix}accuracy`, the others under
    their own names. A check of a part of the task, `<check>/<part>` (a dataset of a mix), is the mean
    over the completions that carry it (`{prefix}accuracy/<part>` for the accuracy check's)."""
    rates = {}
    for name in dict.fromkeys([accuracy, *(k for c in checks for k in c)]):
        check, slash, part = name.partition("/")
        carrying = [c for c in checks if name in c] if part else checks
        count = len(carrying) if part else total
        rates[prefix + ("accuracy" if check == accuracy else check) + slash + part] = (
            sum(c.get(name, 0.0) for c in carrying) / count if count else math.nan)
    return rates


def bootstrap_interval(values: list[float], level: float = 0.95, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float]:
    """The `level` interval of the mean of `values` (one per item: a prompt's accuracy over its samples) by
    the percentile bootstrap over items: `resamples` means of len(values) items drawn with replacement,
    their (1 - level) / 2 and (1 + level) / 2 quantiles. Seeded: the same interval for the same values."""
    if not values:
        return math.nan, math.nan
    rng, n = random.Random(seed), len(values)
    draws = rng.choices(values, k=n * resamples)  # the resamples one after another: one call, the same draws
    means = sorted(sum(draws[i:i + n]) / n for i in range(0, n * resamples, n))
    tail = (1 - level) / 2
    return means[int(tail * resamples)], means[min(resamples - 1, int((1 - tail) * resamples))]


def rollout_record(scored: ScoredCompletion, group_id: int, prompt: str, staleness: str) -> dict:
    """One completion as rollouts.jsonl keeps it (the recorder adds the step and the staleness, counted
    from `counted_version`: its oldest or newest token's by the `staleness` rule, as the bound and the
    step's metrics count it): with `versions`, [token offset, version] of each model turn's tokens where
    weights changed under them; `logprob`: the sum of its tokens' sampling logprobs. A single completion's
    text is not here (the controller never has it): the replay buffer, which holds it, fills it in."""
    c = scored.completion
    changed = [t.versions for t in model_turns(c) if t.versions]
    return {"prompt_index": c.prompt_index, "group": group_id, "prompt": prompt,
            **({"completion": c.text} if c.text is not None else {}),
            "logprob": sum(t.logprob_sum for t in model_turns(c)),
            "reward": scored.reward, "reward_components": scored.reward_components,
            "policy_version": c.policy_version, "counted_version": c.sampled_version(staleness),
            "finish_reason": c.finish_reason,
            **({"versions": [t.versions for t in model_turns(c)]} if changed else {}),
            **({"turns": len(c.turns)} if isinstance(c, Trajectory) else {}),
            **({"metadata": scored.metadata} if scored.metadata else {})}


class RolloutRecorder:
    """`rollouts.jsonl`: each trained completion (or a `fraction` of them, the same ones on a rerun)
    with the step that trained it, its prompt and reply, reward and checks, policy version,
    staleness (by controller.staleness, as the bound counts it) and finish reason: what the model
    really did."""

    def __init__(self, run_dir: Path, fraction: float, resumed_step: int | None = None):
        """`resumed_step`: a resumed run keeps the records of the steps up to its checkpoint's."""
        self.fraction = fraction
        path = run_dir / "rollouts.jsonl"
        kept = []
        if resumed_step is not None and path.is_file():
            kept = [line for line in path.read_text().splitlines(keepends=True)  # a last line cut short: dropped
                    if line.endswith("\n") and json.loads(line)["step"] <= resumed_step]
        self.file = open(path, "w") if fraction > 0 else None
        if self.file:
            self.file.writelines(kept)
            self.file.flush()  # the buffer's process may never write another record

    def write(self, step: int, trained_version: int, records: list[dict]) -> None:
        """Batch `trained_version`'s records, trained by step `step` (in the replay buffer's process, which
        holds their text)."""
        if self.file is None:
            return
        rng = random.Random(step)
        for record in records:
            if self.fraction >= 1 or rng.random() < self.fraction:
                # a batch checkpointed before records had counted_version: its oldest token's
                staleness = trained_version - record.get("counted_version", record["policy_version"])
                self.file.write(json.dumps({"step": step, **record, "staleness": staleness}) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


@dataclass
class Kept:
    """A kept group as the controller keeps it once its episodes are in the replay buffer: what its
    batch's metrics and rollouts.jsonl need, no tokens."""

    rewards: list[float]
    checks: list[dict[str, float]]  # each completion's reward components
    turns: list[int]  # each completion's model turns
    tokens_after_swap: int  # sampled under a newer version than the sequence's first tokens
    versions: list[int]  # its episodes' policy versions


def keep_group(group: list[ScoredCompletion], group_id: int, cfg, task,
               temperature: float) -> tuple[GroupEpisodes, Kept]:
    """A kept group's episodes and records (for the replay buffer, which holds its sequences) and what the
    controller keeps of it. `cfg`: the run's controller section (meshrl.configs.ControllerConfig, which
    composes these rules with the loop's: this module stays below it)."""
    episodes = group_episodes(group, group_id, cfg, temperature)
    prompt = task.train_sample(group_id).prompt
    episodes.records = [rollout_record(s, group_id, prompt, cfg.staleness) for s in group]
    return episodes, Kept(
        [s.reward for s in group], [s.reward_components for s in group],
        [len(model_turns(s.completion)) for s in group],
        sum(t.num_tokens - t.versions[1][0] for s in group for t in model_turns(s.completion) if t.versions),
        list(episodes.versions))


def batch_builder(cfg, now: Callable[[], float], accuracy: str = "correct"):
    """The work buffer's `build`: a complete Filling (its kept groups as `Kept`) -> its Batch. `now()`:
    the tracer's clock; `cfg`: the controller section, as in keep_group."""

    def build(f: Filling) -> Batch:
        # in prompt order, not the order the groups finished in (timing): the trainer sums the same
        # gradients in the same order on a rerun or after a resume, so it computes the same weights
        kept = sorted(f.kept.items(), key=lambda item: item[0])
        rewards = [r for _, k in kept for r in k.rewards]  # the rewards of the batch trained
        checks = [c for _, k in kept for c in k.checks]
        turns = [t for _, k in kept for t in k.turns]
        scored = len(kept) + (f.equal if cfg.drop_equal_reward_groups else 0)  # the groups given rewards
        stats = {
            "reward_mean": statistics.fmean(rewards) if rewards else math.nan,
            "reward_std": population_std(rewards) if rewards else math.nan,
            **check_rates(checks, len(checks), "", accuracy),
            # replies (completions, conversations) graded for this batch, its failed groups' included, and those
            # whose reward function or environment raised (left out; a group where most raised failed)
            "replies_graded": sum(g.completions for g in f.groups) + f.failed_graded,
            "reward_errors": sum(g.completions - len(g.scored) for g in f.groups) + f.failed_errors,
            "equal_reward_groups": f.equal,
            # the share of them whose rewards differ: the groups that teach anything (a stalled run's is low)
            "groups_with_signal": max(scored - f.equal, 0) / scored if scored else math.nan,
            "groups_dropped": f.equal if cfg.drop_equal_reward_groups else 0,
            "groups_stale": f.stale,
            "groups_failed": f.failed,
            "episodes": sum(len(k.versions) for _, k in kept),
            "turns_mean": statistics.fmean(turns) if turns else math.nan,
            # every token generated for this batch: its finished groups', failed ones' and stale ones'
            "tokens_generated": sum(g.tokens for g in f.groups) + f.failed_tokens + f.stale_tokens,
            # generated for this batch and not trained (a part of tokens_generated): its groups dropped
            # (equal rewards with dynamic sampling), failed (a call raised, or no completion scored), or stale
            "tokens_discarded_dropped": sum(g.tokens - g.lost_tokens for g in f.groups if g.prompt_index not in f.kept),
            # generated again: their first attempt's generator died holding them
            "tokens_discarded_lost": sum(g.lost_tokens for g in f.groups),
            "tokens_discarded_failed": f.failed_tokens,
            "tokens_discarded_stale": f.stale_tokens,
            "gen_time_s": max(g.gen_end for g in f.groups) - min(g.gen_start for g in f.groups),
            "rollout_time_s": now() - min(g.launched for g in f.groups),
            "tokens_after_swap": sum(k.tokens_after_swap for _, k in kept),
        }
        stats["tokens_discarded"] = sum(v for k, v in stats.items() if k.startswith("tokens_discarded_"))
        stats["reward_error_fraction"] = error_fraction(stats["reward_errors"], stats["replies_graded"])
        return Batch(f.index, [gid for gid, _ in kept], [v for _, k in kept for v in k.versions], stats)

    return build


def error_fraction(errors: int, graded: int) -> float:
    """The share of `graded` replies whose reward function raised (0 with none graded)."""
    return errors / graded if graded else 0.0


def reward_error_warning(row: dict, warn_fraction: float, first: str) -> str | None:
    """One warning line for a step's row whose share of replies the reward function raised on is above
    `warn_fraction` (`grader.warn_error_fraction`), naming the step, the count, the share and `first` (the
    first error the graders saw, "" if none said); None otherwise."""
    fraction = row.get("reward_error_fraction", 0.0)
    if not row.get("reward_errors") or fraction <= warn_fraction:
        return None
    return (f"step {row['step']}: the reward function raised on {row['reward_errors']} of {row['replies_graded']} "
            f"replies ({fraction:.1%}, above grader.warn_error_fraction {warn_fraction:g}); they are left out"
            + (f"; the first: {first}" if first else ""))


def reward_error_stop(rows: list[dict], max_fraction: float, max_steps: int, first: str = "") -> str | None:
    """The run's error when each of the last `max_steps` rows' share of replies the reward function raised on
    is above `max_fraction` (`grader.max_error_fraction`, `grader.max_error_steps`); None otherwise."""
    last = rows[-max_steps:]
    if len(last) < max_steps or any(r.get("reward_error_fraction", 0.0) <= max_fraction for r in last):
        return None
    shares = ", ".join(f"{r['reward_error_fraction']:.0%}" for r in last)
    return (f"the reward function raised on more than grader.max_error_fraction ({max_fraction:g}) of the replies "
            f"of {max_steps} steps in a row (grader.max_error_steps), steps {last[0]['step']} to {last[-1]['step']}: "
            f"{shares}" + (f"; the first: {first}" if first else ""))


def reward_error_totals(rows: list[dict]) -> dict[str, float]:
    """summary.json's `reward_errors` (the run's replies whose reward function raised, over the steps
    logged) and `reward_error_fraction` (their share of the replies graded)."""
    errors, graded = sum(r.get("reward_errors", 0) for r in rows), sum(r.get("replies_graded", 0) for r in rows)
    return {"reward_errors": errors, "reward_error_fraction": error_fraction(errors, graded)}


def reward_error_line(summary: dict) -> str | None:
    """The run's last word on its reward errors (summary.json's), if there were any."""
    if not summary.get("reward_errors"):
        return None
    return (f"meshrl: warning: the reward function raised on {summary['reward_errors']} replies over the run, "
            f"{summary['reward_error_fraction']:.1%} of those graded; they were left out (the log has the first "
            "traceback of each kind of error)")
