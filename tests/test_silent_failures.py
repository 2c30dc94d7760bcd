"""No silent failure (issue 52): user code that raises is counted and named, a group with nothing scored
fails, a run whose reward function raises on most replies stops at once with one line, and a batch with
nothing to train steps no optimizer and no lr schedule. Hand-computed values; one real run."""

import asyncio
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from meshrl.actors.grader import TaskGrader, UserCodeFailed, failure, user_code
from meshrl.actors.trainer import TitanTrainer
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.configs import ControllerConfig
from meshrl.episodes import Kept, batch_builder
from meshrl.lr_schedule import LrScheduleConfig, lr_scheduler
from meshrl.tasks import Sample
from meshrl.tasks.dataset import DatasetConfig
from meshrl.train_step import train_updates
from meshrl.types import Completion, ScoredCompletion
from meshrl.work_buffer import Batch, Filling, Group, TooManyFailures, WorkBuffer

REWARD_MODULE = '''
def reward(text, answer):
    """Raises on a reply that starts with "bad", as a user's off-by-one would."""
    if text.startswith("bad"):
        return [][0]
    return 1.0
'''


def completion(text: str, index: int = 0) -> Completion:
    return Completion(index, [1], [2, 3], [-1.0, -1.0], text, 0, "stop")


def group(index: int, rewards=(1.0, 0.0), tokens: int = 4) -> Group:
    return Group(index, [ScoredCompletion(completion("x", index), r) for r in rewards], 2, tokens, 0)


def buffer(size: int = 4) -> WorkBuffer:
    build = lambda f: Batch(f.index, sorted(f.kept), [], {})  # noqa: E731
    return WorkBuffer(3, size, 0, build, 0, max_failed_fraction=0.5)


def test_a_group_with_no_scored_completion_fails_toward_max_failed_fraction():
    work = buffer(size=4)
    assert [work.start(0) for _ in range(4)] == [0, 1, 2, 3]
    assert work.finish(group(0, rewards=(), tokens=6)) is None  # every reward raised: failed, not finished
    f = work.filling[0]
    assert (f.failed, f.failed_tokens, f.groups, f.kept) == (1, 6, [], {})
    assert work.totals["groups_failed"] == 1 and work.start(0) == 4  # its slot goes to a new prompt
    assert work.finish(group(1)) is None and work.filling[0].failed == 1  # a scored group is kept
    work.finish(group(2, rewards=()))  # 2 failed of 4: not more than half yet
    with pytest.raises(TooManyFailures, match=r"3 groups of batch 0 failed, more than controller.max_failed_fraction "
                                              r"\(0.5\) of its 4; the first: prompt 0: none of its 2 completions "
                                              r"was scored"):
        work.finish(group(3, rewards=()))


def test_tokens_generated_counts_every_group_of_the_batch_and_tokens_discarded_is_part_of_it():
    f = Filling(0, groups=[group(0, tokens=10), group(1, tokens=3)], failed=1, failed_tokens=7, stale=1,
                stale_tokens=5)
    f.kept = {0: Kept([1.0, 0.0], [{}, {}], [1, 1], 0, [0, 0])}  # group 1 dropped (equal rewards)
    stats = batch_builder(ControllerConfig(), lambda: 0.0)(f).stats
    assert stats["tokens_generated"] == 10 + 3 + 7 + 5  # kept, dropped, failed, stale
    assert (stats["tokens_discarded_dropped"], stats["tokens_discarded_failed"], stats["tokens_discarded_stale"],
            stats["tokens_discarded"]) == (3, 7, 5, 15)
    assert stats["tokens_generated"] - stats["tokens_discarded"] == 10  # the kept group's: trained


def test_failure_names_the_code_only_when_it_raised_on_more_than_half():
    errors = [IndexError("list index out of range")] * 3
    assert failure("the reward function m:f", errors[:2], 4, "completions") is None  # half: left out, counted
    assert failure("the reward function m:f", errors, 4, "completions") == (
        "the reward function m:f raised on 3 of 4 completions; the first: IndexError: list index out of range")
    assert user_code("dataset", DatasetConfig(reward="mymodule:reward"), False) == "the reward function mymodule:reward"
    assert user_code("dataset", DatasetConfig(reward="exact"), False) == "the reward function dataset.reward exact"
    assert user_code("user_task:Parity", None, False) == "the reward function of task user_task:Parity"
    assert user_code("zorplex", None, True) == "the environment zorplex"


def test_the_grader_leaves_out_a_few_failures_and_fails_a_group_where_most_raised(tmp_path, monkeypatch, caplog):
    (tmp_path / "silent_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(6)))
    grader = TaskGrader("dataset", DatasetConfig(path=str(tmp_path / "d.jsonl"), eval_size=1, test_size=0,
                                             reward="silent_reward:reward"))
    sample = Sample("q0", "1")
    with caplog.at_level("ERROR"):
        rewards = grader.rewards([completion("good"), completion("bad 1"), completion("good")], sample)
        assert [r for r, _ in rewards] == [1.0, None, 1.0]  # one of three raised: left out, the caller counts it
        with pytest.raises(UserCodeFailed, match=r"^the reward function silent_reward:reward raised on 2 of 3 "
                                                 r"completions; the first: IndexError: list index out of range$"):
            grader.rewards([completion("bad 2"), completion("good"), completion("bad 3")], sample)
    # the first traceback is in the log; the repeats of the same error are not
    assert caplog.text.count("Traceback") == 1 and "'bad 1'" in caplog.text and "'bad 2'" not in caplog.text
    # the first error it saw, which a step's warning names (its `first_error` endpoint)
    assert grader.first == "the reward function silent_reward:reward: IndexError: list index out of range"


class NoTrainer:
    """A trainer mesh that must not be called: any endpoint raises."""

    def __getattr__(self, name):
        raise AssertionError(f"the trainer's {name} was called for a batch with nothing to train")


def test_a_batch_with_nothing_to_train_calls_no_optimizer_update():
    metrics = asyncio.run(train_updates(NoTrainer(), None, [[], []], TrainerConfig()))
    assert metrics["updates"] == 0 and metrics["updates_skipped"] == 0
    assert math.isnan(metrics["loss"]) and math.isnan(metrics["grad_norm"]) and "lr" not in metrics


def stub_trainer(schedule: LrScheduleConfig) -> SimpleNamespace:
    """What TitanTrainer._optim_step reads: a one-parameter model, its AdamW and lr scheduler."""
    model = torch.nn.Linear(1, 1, bias=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)

    async def published():
        return None

    return SimpleNamespace(model=model, optimizer=optimizer, scheduler=lr_scheduler(optimizer, schedule), updates=0,
                           config=SimpleNamespace(max_grad_norm=1.0), _published=published, copied=None)


def test_an_optimizer_step_with_no_gradient_applies_nothing_and_leaves_the_lr_schedule_where_it_was():
    # 4 updates decaying linearly to 0: 1, 2/3, 1/3, 0
    t = stub_trainer(LrScheduleConfig(decay="linear", total_updates=4))
    weight = t.model.weight.detach().clone()
    empty = asyncio.run(TitanTrainer._optim_step(t, False))  # no forward_backward since the last update
    assert (empty["updates"], empty["skipped"], empty["lr"]) == (0, False, 1.0) and math.isnan(empty["grad_norm"])
    assert torch.equal(t.model.weight, weight) and t.optimizer.param_groups[0]["lr"] == 1.0  # not advanced
    lrs = []
    for _ in range(4):
        t.model(torch.ones(1, 1)).sum().backward()
        lrs.append(asyncio.run(TitanTrainer._optim_step(t, False))["lr"])
        asyncio.run(TitanTrainer._optim_step(t, False))  # an empty one between every two: changes nothing
    assert lrs == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0]) and t.updates == 4  # the floor on the last update


@pytest.mark.processes
def test_a_run_whose_reward_function_raises_on_every_reply_stops_at_its_first_eval_on_its_error_line(tmp_path):
    """A real smoke run of the dataset task, 12 steps asked for, its reward `mymodule:reward` raising
    IndexError on every reply: its first eval fails on every prompt with that one error, said in one line
    with the count, and the run stops there, before any step, exit code 1, with one `meshrl: error:` line
    naming the function and its error as the last line of its whole output (nothing of the teardown after
    it), and the first traceback in the log."""
    (tmp_path / "mymodule.py").write_text("def reward(text, answer):\n    return [][0]\n")
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(12)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(tmp_path / "run"),
                          "--checkpoint.every", "0", "--controller.steps", "12", "--task", "dataset",
                          "--dataset.path", str(tmp_path / "d.jsonl"), "--dataset.reward", "mymodule:reward",
                          "--dataset.eval_size", "3", "--dataset.test_size", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, env=env)
    output = run.stdout
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("meshrl: error:")]
    assert run.returncode == 1, output[-3000:]
    assert len(errors) == 1 and lines[-1] == errors[0], output[-3000:]
    assert errors[0].startswith("meshrl: error: every one of the 3 validation eval prompts failed before training, "
                                "with the same error: ")
    assert "the reward function mymodule:reward raised on 1 of 1 completions" in errors[0]
    assert "IndexError: list index out of range" in errors[0]
    assert output.count("eval prompts failed (counted as wrong") == 1 and "3 of 3 eval prompts failed" in output
    assert "Traceback" in output and 'return [][0]' in output  # the first traceback, in the log
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no step trained


def broad_handlers_without_a_reason(root) -> list[str]:
    """`except Exception` / `except BaseException` / bare `except:` handlers of the package that neither
    re-raise, nor log, nor say in a comment (on the `try` or `except` line) which failure they handle."""
    import ast
    from pathlib import Path

    found = []
    for path in sorted(Path(root).rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Try):
                continue
            for handler in node.handlers:
                broad = handler.type is None or (isinstance(handler.type, ast.Name)
                                                 and handler.type.id in ("Exception", "BaseException"))
                if not broad:
                    continue
                body = [n for stmt in handler.body for n in ast.walk(stmt)]
                raises = any(isinstance(n, ast.Raise) for n in body)
                logs = any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "logger"
                           for n in body)
                said = "#" in lines[handler.lineno - 1] or "#" in lines[node.lineno - 1]
                if not (raises or logs or said):
                    found.append(f"{path.relative_to(Path(root).parent)}:{handler.lineno}")
    return found


def test_every_broad_except_in_the_package_re_raises_logs_or_names_its_failure():
    from pathlib import Path

    import meshrl

    assert broad_handlers_without_a_reason(Path(meshrl.__file__).parent) == []
