"""The assertions many tests share, each in one place: the staleness bound and exactly-once training,
recomputed from what a run wrote (its metrics rows and rollouts.jsonl) rather than read back from the
figures the rules themselves computed."""

import json
from collections import Counter, defaultdict
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def assert_staleness_bound(rows: list[dict], records: list[dict], age: int, reached: bool = False,
                           fifo: bool = True) -> None:
    """No trained sequence was older than `age` versions. Each rollouts.jsonl record's age is recomputed
    from the step that trained it (step s trains on version s - 1) and the version its tokens count as,
    and must equal the age the recorder wrote; each step's `staleness_max` row figure (the replay
    buffer's) must be its records' oldest (`fifo`; a replay buffer's reused episodes may be older
    than those recorded, never younger). `reached`: an async run reaches the bound (it overlapped)."""
    ages = defaultdict(list)
    for r in records:
        mine = r["step"] - 1 - r.get("counted_version", r["policy_version"])
        assert mine == r["staleness"], r
        ages[r["step"]].append(mine)
    assert ages and all(0 <= a <= age for step in ages.values() for a in step), dict(ages)
    for row in rows:
        if row["step"] in ages:
            oldest = max(ages[row["step"]])
            assert row["staleness_max"] == oldest if fifo else row["staleness_max"] >= oldest, row["step"]
        assert 0 <= row["staleness_max"] <= age, row
    if reached:
        assert max(max(a) for a in ages.values()) == age


def assert_each_prompt_trained_once(records: list[dict], prompts, group_size: int) -> None:
    """rollouts.jsonl: every prompt of `prompts` was trained in exactly one step, its whole group of
    `group_size` completions, and no other prompt was."""
    steps, sizes = defaultdict(set), Counter()
    for r in records:
        steps[r["prompt_index"]].add(r["step"])
        sizes[r["prompt_index"]] += 1
    assert sorted(steps) == sorted(prompts), sorted(steps)
    assert all(len(s) == 1 for s in steps.values()), {p: s for p, s in steps.items() if len(s) > 1}
    assert set(sizes.values()) == {group_size}, sizes


def assert_each_group_trained_once(updates: list[list[int]], prompts, group_size: int) -> None:
    """A fake trainer's updates (each the prompt of every sequence it trained): every prompt of
    `prompts` trained `group_size` times in all (its group, once), no other prompt."""
    assert Counter(p for update in updates for p in update) == {p: group_size for p in prompts}


def assert_checks_are_the_means_of_the_records(rows: list[dict], records: list[dict], accuracy: str) -> None:
    """Each step's reward-check rates are the means over the completions it trained (rollouts.jsonl, all
    recorded): the task's `accuracy` check as `accuracy`, the others under their own names."""
    import pytest

    for row in rows:
        checks = [r["reward_components"] for r in records if r["step"] == row["step"]]
        assert checks, row["step"]
        for name in {k for c in checks for k in c if "/" not in k}:
            mean = sum(c.get(name, 0.0) for c in checks) / len(checks)
            assert row["accuracy" if name == accuracy else name] == pytest.approx(mean), (row["step"], name)


def assert_final_policy_is_the_trained_one(run_dir: Path, source: str = "tiny") -> None:
    """final/ is the policy the run trained from `source`: the same tensors, changed if and only if an
    update of a step it logged had a gradient and was applied (the tiny models earn no reward)."""
    import torch

    from meshrl.models.model import load_hf_weights, resolve_checkpoint

    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    final, initial = load_hf_weights(Path(run_dir) / "final"), load_hf_weights(resolve_checkpoint(source))
    assert final.keys() == initial.keys()
    moved = any(r["grad_norm"] > 0 and not r["updates_skipped"] for r in rows)
    assert moved == any(not torch.equal(final[k], initial[k].to(final[k].dtype)) for k in final)


def log_messages(caplog) -> list[str]:
    """The captured log records' messages, without the "[actor=<root>] " Monarch puts before each message once
    its runtime has started in the process (a test's order decides whether it has)."""
    import re

    return [re.sub(r"^(\[actor=[^]]*\] )+", "", r.getMessage()) for r in caplog.records]
