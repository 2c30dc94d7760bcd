"""Errors counted and said (issue 67): replies whose reward function raised are counted in each step's row with
their share (a failed group's too), a step above `grader.warn_error_fraction` gets one warning line, a share
above `grader.max_error_fraction` for `grader.max_error_steps` steps stops the run, the run ends with its totals
(summary.json and one line), repeated eval failures are one line, and a run that fails ends on its error line.
Hand-computed values; real runs for what the user sees."""

import asyncio
import io
import json
import logging
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from assertions import log_messages

from meshrl.actors.grader import failed_counts, failure
from meshrl.actors.replicas import CallFailed
from meshrl.configs import ControllerConfig
from meshrl.episodes import (Kept, batch_builder, reward_error_line, reward_error_stop, reward_error_totals,
                             reward_error_warning)
from meshrl.rollout import RolloutCollector
from meshrl.tasks import Sample, math_reward
from meshrl.types import Completion, ScoredCompletion
from meshrl.work_buffer import Batch, Group, TooManyFailures, WorkBuffer

# Raises on replies 0 and 2 of every 5 the grader scores (40%): never on more than 2 of 4 consecutive ones, so
# no group of 4 fails and each step's 8 training replies have 3 or 4 errors whatever the eval took before.
SOMETIMES = '''
import itertools

replies = itertools.count()


def reward(text, answer):
    if next(replies) % 5 in (0, 2):
        raise KeyError("no score for this reply")
    return float(len(text) % 2)
'''


def scored_group(index: int, scored: int, completions: int) -> Group:
    replies = [ScoredCompletion(Completion(index, [1], [2], [-1.0], "x", 0, "stop"), float(i % 2))
               for i in range(scored)]
    return Group(index, replies, completions, 2, 0)


def test_a_failed_groups_line_says_how_many_replies_raised_and_other_errors_say_none():
    line = failure("the reward function m:f", [IndexError("list index out of range")] * 3, 4, "completions")
    as_received = f"Actor call grader.score failed.: meshrl.actors.grader.UserCodeFailed: {line}"
    assert failed_counts(as_received) == (3, 4)
    assert failed_counts("Actor call generator.generate failed.: ValueError: prompt too long") == (0, 0)


def test_a_batch_counts_the_reward_errors_of_kept_and_failed_groups_and_their_share():
    def keep(batch, group):
        n = len(group.scored)
        return Kept([s.reward for s in group.scored], [s.reward_components for s in group.scored], [1] * n, 0, [0] * n)

    work = WorkBuffer(2, 3, 0, batch_builder(ControllerConfig(), lambda: 0.0), 0, max_failed_fraction=1.0, keep=keep)
    assert [work.start(0) for _ in range(3)] == [0, 1, 2]
    work.fail(0, "the reward function m:f raised on 3 of 4 completions; the first: ...", 8, (3, 4))
    assert work.start(0) == 3
    assert work.finish(scored_group(1, scored=3, completions=4)) is None  # 1 of 4 raised: kept
    assert work.finish(scored_group(2, scored=0, completions=4)) is None  # all raised: failed, 4 of 4 counted
    assert work.start(0) == 4
    assert work.finish(scored_group(3, scored=4, completions=4)) is None
    batch = work.finish(scored_group(4, scored=2, completions=4))  # 2 of 4 raised: kept
    assert isinstance(batch, Batch)
    stats = batch.stats
    assert (stats["reward_errors"], stats["replies_graded"]) == (3 + 1 + 4 + 0 + 2, 20)
    assert stats["reward_error_fraction"] == pytest.approx(10 / 20)
    assert stats["groups_failed"] == 2


def test_a_step_above_the_warning_share_gets_one_line_naming_step_count_share_and_first_error():
    row = {"step": 3, "reward_errors": 5, "replies_graded": 16, "reward_error_fraction": 5 / 16}
    first = "the reward function m:f: KeyError: 'x'"
    assert reward_error_warning(row, 0.1, first) == (
        "step 3: the reward function raised on 5 of 16 replies (31.2%, above grader.warn_error_fraction 0.1); "
        "they are left out; the first: the reward function m:f: KeyError: 'x'")
    assert reward_error_warning(row, 0.5, first) is None  # below the share asked for
    assert reward_error_warning({**row, "reward_errors": 0, "reward_error_fraction": 0.0}, 0.0, first) is None


def test_the_run_stops_only_after_max_steps_in_a_row_above_the_bound():
    def rows(*shares):
        return [{"step": i + 1, "reward_error_fraction": s} for i, s in enumerate(shares)]

    assert reward_error_stop(rows(0.6, 0.6), 0.5, 3) is None  # not yet 3 steps
    assert reward_error_stop(rows(0.6, 0.4, 0.6, 0.6), 0.5, 3) is None  # broken by step 2
    assert reward_error_stop(rows(0.6, 0.6, 0.5), 0.5, 3) is None  # at the bound is not above it
    assert reward_error_stop(rows(0.1, 0.6, 0.7, 0.8), 0.5, 3, "KeyError: 'x'") == (
        "the reward function raised on more than grader.max_error_fraction (0.5) of the replies of 3 steps in a "
        "row (grader.max_error_steps), steps 2 to 4: 60%, 70%, 80%; the first: KeyError: 'x'")


def test_the_runs_totals_and_its_end_line_come_from_the_steps_rows():
    rows = [{"reward_errors": 3, "replies_graded": 8}, {"reward_errors": 1, "replies_graded": 12}, {}]
    totals = reward_error_totals(rows)
    assert totals == {"reward_errors": 4, "reward_error_fraction": pytest.approx(0.2)}
    assert reward_error_line(totals) == (
        "meshrl: warning: the reward function raised on 4 replies over the run, 20.0% of those graded; they were "
        "left out (the log has the first traceback of each kind of error)")
    assert reward_error_line(reward_error_totals([{"reward_errors": 0, "replies_graded": 8}])) is None


def fake_eval_collector(failing: dict[int, str], prompts: int) -> RolloutCollector:
    """A collector whose groups are faked: prompt i fails with failing[i], the others score 1."""
    collector = RolloutCollector.__new__(RolloutCollector)
    collector.controller, collector.generator = ControllerConfig(), SimpleNamespace(max_tokens=8)
    collector.task = SimpleNamespace(eval_samples=lambda split: [Sample(f"q{i}", "1") for i in range(prompts)],
                                     accuracy="correct")
    collector.latest = 0

    async def run_group(index, sample, sampling, what):
        if index in failing:
            raise CallFailed(failing[index])
        reply = ScoredCompletion(Completion(index, [1], [2], [-1.0], "1", 0, "stop"), 1.0, {"correct": 1.0})
        return Group(index, [reply], 1, 1, 0)

    collector.run_group = run_group
    return collector


def test_eval_failures_with_one_error_are_one_line_and_a_first_eval_failing_on_every_prompt_stops(caplog):
    same = "the reward function m:f raised on 1 of 1 completions; the first: KeyError: 'x'"
    with caplog.at_level(logging.WARNING, logger="meshrl.rollout"):
        rates = asyncio.run(fake_eval_collector({1: same, 2: same, 4: "vLLM refused it"}, 6).evaluate(step=0))
    assert rates["eval_accuracy"] == pytest.approx(3 / 6)
    assert log_messages(caplog) == [
        f"2 of 6 eval prompts failed (counted as wrong; the first, 1) with: {same}",
        "eval prompt 4 failed (counted as wrong): vLLM refused it"]
    every = {i: same for i in range(5)}
    with pytest.raises(TooManyFailures, match=r"^every one of the 5 validation eval prompts failed before training, "
                                              r"with the same error: the reward function m:f raised on 1 of 1"):
        asyncio.run(fake_eval_collector(every, 5).evaluate(step=0))
    assert asyncio.run(fake_eval_collector(every, 5).evaluate(step=4))["eval_accuracy"] == 0.0  # later: counted
    assert asyncio.run(fake_eval_collector({0: same, 1: "other"}, 2).evaluate(step=0))["eval_accuracy"] == 0.0


def test_math_verify_raising_in_the_child_is_raised_by_the_parent(monkeypatch, capsys):
    def compare(text, answer):
        if text == "boom":
            raise ValueError("sympy broke")
        return {"found": True, "correct": text == answer}

    monkeypatch.setattr(math_reward, "compare", compare)
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(["1", "1"]) + "\n" + json.dumps(["boom", "1"]) + "\n"))
    math_reward._serve()
    assert capsys.readouterr().out.splitlines() == [
        "ready", '{"found": true, "correct": true}', '{"error": "ValueError: sympy broke"}']

    read, write = os.pipe()
    os.write(write, b'{"error": "ValueError: sympy broke"}\n')
    verifier = math_reward.MathVerifier(timeout_s=1.0)
    verifier.child = SimpleNamespace(stdin=io.StringIO(), stdout=os.fdopen(read), poll=lambda: None)
    with pytest.raises(RuntimeError, match=r"^math-verify raised on a reply: ValueError: sympy broke$"):
        verifier("boom", "1")
    verifier.child.stdout.close()
    os.close(write)


def smoke_run(tmp_path, reward: str, *overrides: str) -> tuple[subprocess.CompletedProcess, list[dict], dict]:
    """`python -m meshrl train --config smoke` on a dataset whose reward is the module `reward`'s: its run (stdout
    and stderr as one stream, in order), its metrics rows and summary.json."""
    (tmp_path / "errs.py").write_text(reward)
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(24)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(tmp_path / "run"),
               "--checkpoint.every", "0", "--task", "dataset", "--dataset.path", str(tmp_path / "d.jsonl"),
               "--dataset.reward", "errs:reward", "--dataset.eval_size", "4", "--dataset.test_size", "0", *overrides]
    run = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, env=env)
    metrics, summary = tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "summary.json"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return run, steps, json.loads(summary.read_text()) if summary.exists() else {}


@pytest.mark.processes
def test_a_reward_raising_on_40_percent_of_replies_warns_each_step_and_ends_with_the_share(tmp_path):
    run, rows, summary = smoke_run(tmp_path, SOMETIMES, "--controller.steps", "3")
    assert run.returncode == 0, run.stdout[-3000:]
    warnings = [line for line in run.stdout.splitlines() if "grader.warn_error_fraction" in line]
    steps = [re.search(r"step (\d+): the reward function raised on [34] of 8 replies", w) for w in warnings]
    assert [s and s[1] for s in steps] == ["1", "2", "3"], run.stdout[-3000:]
    assert all("the first: the reward function errs:reward: KeyError: 'no score for this reply'" in w
               for w in warnings)
    assert len(rows) == 3 and all(r["reward_errors"] in (3, 4) for r in rows)  # of each step's 8
    assert all(r["replies_graded"] == 8 and r["groups_failed"] == 0 for r in rows)
    errors = sum(r["reward_errors"] for r in rows)
    assert summary["reward_errors"] == errors and summary["reward_error_fraction"] == pytest.approx(errors / 24)
    assert (f"meshrl: warning: the reward function raised on {errors} replies over the run, "
            f"{errors / 24:.1%} of those graded") in run.stdout


@pytest.mark.processes
def test_a_share_of_errors_above_the_bound_for_two_steps_stops_the_run_on_its_error_line(tmp_path):
    run, rows, summary = smoke_run(tmp_path, SOMETIMES, "--controller.steps", "5", "--grader.max_error_fraction",
                                   "0.3", "--grader.max_error_steps", "2")
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert run.returncode == 1, run.stdout[-3000:]
    assert lines[-1].startswith("meshrl: error: the reward function raised on more than grader.max_error_fraction "
                                "(0.3) of the replies of 2 steps in a row (grader.max_error_steps), steps 1 to 2: ")
    assert len(rows) == 2 and summary["reward_errors"] == sum(r["reward_errors"] for r in rows)
