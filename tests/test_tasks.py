"""Tasks users bring: the dataset task's rewards (hand-checked) and its bad-data errors, the task API
that loads a `module:Class` task, and smoke runs of both (real actors, vLLM, torchtitan, tiny model)."""

import json
import subprocess
import sys
import time

import pytest
from assertions import assert_checks_are_the_means_of_the_records

from meshrl.configs.named import load_config
from meshrl.configs.recipe import recipe_hash
from meshrl.tasks import make_task, task_config
from meshrl.tasks.dataset import DatasetConfig, DatasetTask, exact, math_answer, numeric
from meshrl.tasks.sum_digits import SumDigits, SumDigitsConfig


@pytest.mark.parametrize("reward, text, answer, expected", [
    (exact, "  Paris. ", "paris", {"correct": 1.0}),
    (exact, "It is Paris", "Paris", {"correct": 0.0}),
    (numeric, "3 + 4 is 7, so 7.0", "7", {"correct": 1.0, "has_number": 1.0}),
    (numeric, "1,234 apples", "1234", {"correct": 1.0, "has_number": 1.0}),
    (numeric, "7 then 8", "7", {"correct": 0.0, "has_number": 1.0}),
    (numeric, "no idea", "7", {"correct": 0.0, "has_number": 0.0}),
])
def test_dataset_rewards_by_hand(reward, text, answer, expected):
    value, checks = reward(text, answer)
    assert checks == expected and value == expected["correct"]


@pytest.mark.processes
@pytest.mark.parametrize("text, answer, correct, found", [
    # equal forms the old regex reward (numbers only, last \boxed{} or "Answer:") got wrong
    (r"So the probability is \boxed{\frac{1}{2}}.", "0.5", 1, 1),
    (r"Solving gives \boxed{x=3}", "3", 1, 1),
    (r"The set is \boxed{\{1, 2\}}", r"\{2,1\}", 1, 1),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1, 1),
    (r"$\frac{3}{4}$ of it", "0.75", 1, 1),
    (r"\boxed{[0, 1)}", "[0,1)", 1, 1),
    ("Answer: x+1\nAnswer: **42**", "42", 1, 1),
    ("1,234 apples", "1234", 1, 1),
    # wrong ones it rejects, and replies without an answer
    (r"\boxed{\frac{1}{3}}", "0.5", 0, 1),
    (r"Solving gives \boxed{x=4}", "3", 0, 1),
    (r"\boxed{(0, 1)}", "[0,1)", 0, 1),
    (r"\boxed{\{1, 3\}}", r"\{1,2\}", 0, 1),
    ("so it is 41", "42", 0, 1),
    ("no idea", "7", 0, 0),
])
def test_math_rewards_compare_answers_with_math_verify(text, answer, correct, found):
    assert math_answer(text, answer) == (float(correct), {"correct": float(correct), "format": float(found)})


@pytest.mark.processes
def test_a_reply_that_keeps_math_verify_busy_is_cut_off_and_the_next_is_compared():
    from meshrl.tasks.math_reward import MathVerifier

    verifier = MathVerifier(timeout_s=1.0)
    try:
        assert verifier("warm: \\boxed{1}", "1") == {"found": True, "correct": True}  # the child has started
        start = time.monotonic()
        assert verifier(r"\boxed{9^{9^{9^{9}}}}", "5") is None  # sympy would work on it for minutes
        assert time.monotonic() - start < 2.0
        assert verifier(r"\boxed{\frac{1}{2}}", "0.5") == {"found": True, "correct": True}  # a new child
    finally:
        verifier.close()


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dataset_rows_split_cycle_in_a_seeded_order_and_take_a_users_reward(tmp_path):
    rows = [{"question": f"q{i}", "solution": i} for i in range(10)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    task = DatasetTask(DatasetConfig(path=path, eval_size=3, test_size=0, prompt_field="question",
                                     answer_field="solution", reward="user_task:longer_is_better"))
    assert [s.prompt for s in task.eval_samples()] == ["q7", "q8", "q9"]  # the last rows, never trained
    first_pass = {task.train_sample(i).prompt for i in range(7)}
    assert first_pass == {f"q{i}" for i in range(7)}  # each training row once per pass
    assert [task.train_sample(i).prompt for i in range(14)] != [f"q{i % 7}" for i in range(14)]  # shuffled
    again = DatasetTask(DatasetConfig(path=path, eval_size=3, test_size=0, prompt_field="question",
                                      answer_field="solution"))
    assert [again.train_sample(i) for i in range(20)] == [task.train_sample(i) for i in range(20)]  # seeded
    assert task.train_sample(0).answer == json.dumps(rows[int(task.train_sample(0).prompt[1:])]["solution"])
    assert task.reward("x" * 50, "1") == (0.5, {"correct": 0.5})


@pytest.mark.parametrize("content, message", [
    ("", "d.jsonl: no rows"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b"\n', "d.jsonl row 2: not a JSON object"),
    ('{"prompt": "a", "answer": "1"}\n[1, 2]\n', "d.jsonl row 2: not a JSON object"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n{"answer": "3"}\n',
     "d.jsonl row 3: no 'prompt'"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "  ", "answer": "2"}\n', "d.jsonl row 2: no 'prompt'"),
])
def test_bad_data_is_one_error_naming_the_file_and_row(content, message, tmp_path):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        DatasetTask(DatasetConfig(path=str(tmp_path / "d.jsonl"), eval_size=1))


def test_a_parquet_file_and_a_second_eval_file(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"prompt": f"p{i}", "answer": str(i)} for i in range(5)]).to_parquet(str(tmp_path / "t.parquet"))
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "e0", "answer": "0"}, {"prompt": "e1", "answer": "1"}])
    task = DatasetTask(DatasetConfig(path=str(tmp_path / "t.parquet"), eval_path=path, test_size=0, reward="numeric"))
    assert {task.train_sample(i).prompt for i in range(5)} == {f"p{i}" for i in range(5)}
    assert [s.prompt for s in task.eval_samples()] == ["e0", "e1"]


def test_module_class_tasks_take_their_config_from_task_args():
    config = load_config("smoke", ["--task", "user_task:Parity", "--task_args", '{"eval_size": 2}'])
    task = make_task(config.task, task_config(config))
    assert len(task.eval_samples()) == 2 and task.accuracy == "right"
    with pytest.raises(ValueError, match="task_args for user_task:Parity: .*(its fields: eval_size, largest)"):
        task_config(load_config("smoke", ["--task", "user_task:Parity", "--task_args", '{"size": 2}']))
    with pytest.raises(ValueError, match="task_args 'eval_size=2' is not JSON"):
        task_config(load_config("smoke", ["--task", "user_task:Parity", "--task_args", "eval_size=2"]))
    with pytest.raises(ValueError, match="cannot load task 'user_task:Nope'"):
        task_config(load_config("smoke", ["--task", "user_task:Nope"]))


def test_an_environment_whose_conversation_score_is_still_called_reward_is_one_error(tmp_path, monkeypatch):
    """An environment's whole-conversation score is `conversation_reward` (a single-turn task's `reward` takes a
    reply and an answer): one written with the old name is refused by name, not called with the wrong arguments."""
    (tmp_path / "old_env.py").write_text(
        "class OldEnv:\n"
        "    accuracy, stop = 'correct', []\n"
        "    def step(self, sample, messages):\n        return None\n"
        "    def reward(self, sample, messages):\n        return 1.0, {'correct': 1.0}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"environment old_env:OldEnv has no `conversation_reward\(sample, messages\)`"):
        make_task("old_env:OldEnv", None)
    from user_task import FakeTool

    assert make_task("user_task:FakeTool", FakeTool.Config()).conversation_reward  # the same shape, renamed: loads


def smoke(tmp_path, *args, stderr: list | None = None) -> list[dict]:
    run = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(tmp_path),
                          "--checkpoint.every", "0", *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    if stderr is not None:
        stderr.append(run.stderr)
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.processes
def test_meshrl_eval_scores_a_finished_runs_policy_on_a_held_out_split_in_a_directory_of_its_own(tmp_path):
    """One smoke step of sum_digits, then `meshrl eval RUN --split test`: the test split's prompts (none a
    validation prompt) through the run's generators and graders, the rates the eval during training
    reports, as a table and one JSON line; the training run's files left as they were."""
    run = tmp_path / "run"
    rows = smoke(run, "--controller.steps", "1")
    summary = (run / "summary.json").read_bytes()
    # the run records its recipe: smoke's settings with the overrides smoke() and this test gave
    assert json.loads(summary)["config_hash"] == recipe_hash(load_config("smoke", ["--checkpoint.every", "0",
                                                                                   "--controller.steps", "1"]))
    command = [sys.executable, "-m", "meshrl", "eval", str(run), "--split", "test"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    scored = json.loads(result.stdout.strip().splitlines()[-1])
    assert scored["split"] == "test" and scored["prompts"] == 8 and scored["policy"] == str((run / "final").absolute())
    assert list(scored["rates"]) == [k for k in rows[-1] if k.startswith("eval_")]  # the eval's own rates
    assert json.loads((run / "eval-test" / "eval.json").read_text()) == scored
    assert "\ntest split: 8 prompts x 1 (temperature 0), policy " in result.stdout and "| accuracy | " in result.stdout
    test = SumDigits(SumDigitsConfig(eval_size=8)).eval_samples("test")
    shown = [line.removeprefix("  prompt: ") for line in result.stdout.splitlines() if line.startswith("  prompt: ")]
    assert shown == [s.prompt for s in test[:3]]
    assert (run / "summary.json").read_bytes() == summary
    missing = subprocess.run([*command[:4], str(tmp_path / "nothing")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"meshrl: error: {tmp_path / 'nothing'} is not a run directory (no config.json)"


@pytest.mark.processes
def test_a_users_task_from_its_own_module_trains(dataset_run):
    """The dataset run's task is a user's class (user_task:SlippingDataset, built from --task_args), loaded in
    the grader's process from the user's module; user_task:Parity, a task written from scratch, is loaded and
    checked in process above."""
    rows, records = dataset_run["rows"], dataset_run["records"]
    # its accuracy check ("correct") is reported as accuracy; its other checks under their own names
    assert {"accuracy", "has_number", "eval_accuracy", "eval_has_number"} <= rows[-1].keys()
    assert "correct" not in rows[-1] and "eval_correct" not in rows[-1]
    assert_checks_are_the_means_of_the_records(rows, records, "correct")


@pytest.fixture(scope="module")
def dataset_run(tmp_path_factory) -> dict:
    """One smoke run of a JSONL file through the dataset task, as a user's subclass of it that lets one
    over-long prompt slip past the load's check (user_task:SlippingDataset lengthens training prompt 1);
    rows 2 and 5 are too long for the context and are skipped at load. 14 rows: the last 4 are the eval's."""
    tmp_path = tmp_path_factory.mktemp("dataset")
    rows = [{"q": ("Say it all again: " + "and so on " * 300) if i in (1, 4) else f"What is {i} + {i}?",
             "a": 2 * i} for i in range(14)]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    args = json.dumps({"path": path, "prompt_field": "q", "answer_field": "a", "reward": "numeric", "eval_size": 4,
                       "test_size": 0})
    stderr = []
    done = smoke(tmp_path / "run", "--task", "user_task:SlippingDataset", "--task_args", args,
                 "--controller.steps", "3", stderr=stderr)
    records = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    return {"rows": done, "records": records, "stderr": stderr[0]}


@pytest.mark.processes
def test_a_jsonl_file_trains_through_the_dataset_task_and_bad_data_stops_before_anything_starts(dataset_run, tmp_path,
                                                                                                 cli):
    rows, records = dataset_run["rows"], dataset_run["records"]
    assert [r["step"] for r in rows] == [1, 2, 3] and "eval_accuracy" in rows[-1]
    assert "has_number" in records[0]["reward_components"]
    trained = {r["prompt"] for r in records}
    # 3 steps of 2 groups, each a prompt of its own among the 8 short train rows: never an eval row
    assert len(trained) == 6 and trained <= {f"What is {i} + {i}?" for i in range(10) if i not in (1, 4)}
    (tmp_path / "bad.jsonl").write_text('{"q": "a", "a": 1}\n{"q": "b"}\n')
    code, _, err = cli("train", "--config", "smoke", "--run-dir", tmp_path / "bad", "--task", "dataset",
                       "--dataset.path", tmp_path / "bad.jsonl", "--dataset.prompt_field", "q",
                       "--dataset.answer_field", "a", "--dataset.eval_size", "1")
    assert code == 2
    assert err.strip().splitlines() == [f"meshrl: error: {tmp_path / 'bad.jsonl'} row 2: no 'a' (fields: q)"]
    assert not (tmp_path / "bad").exists()


def test_rows_too_long_for_the_generator_are_skipped_at_load_with_their_row_numbers(tmp_path, caplog):
    rows = [{"prompt": f"row{i} " + "word " * (300 if i in (2, 5) else 3), "answer": "1"} for i in range(10)]
    task = DatasetTask(DatasetConfig(path=write_jsonl(tmp_path / "d.jsonl", rows), eval_size=3, test_size=0))
    with caplog.at_level("WARNING"):
        task.keep_only(lambda prompt: len(prompt.split()) <= 100, "over 100 words")
    assert "d.jsonl: 2 of its 7 train rows skipped, their prompts over 100 words: rows 3, 6" in caplog.text
    assert "validation rows" not in caplog.text
    assert {len(task.train_sample(i).prompt.split()) for i in range(20)} == {4}
    with pytest.raises(ValueError, match="no train row has a prompt that fits: all are over 0 words"):
        task.keep_only(lambda prompt: False, "over 0 words")


@pytest.mark.processes
def test_a_dataset_with_over_long_prompts_trains_to_the_end_without_replacing_a_generator(dataset_run):
    """The rows too long for the context are reported at load and skipped; the prompt that slips through
    anyway is refused by vLLM: its group fails, is counted, and nothing else happens."""
    done, stderr = dataset_run["rows"], dataset_run["stderr"]
    assert "long.jsonl: 2 of its 10 train rows skipped, their prompts longer than generator.max_model_len (512) " \
           "less generator.max_tokens (16) tokens: rows 2, 5" in stderr
    assert "the group of prompt 1 failed and is not trained" in stderr and "maximum context length" in stderr
    assert [r["step"] for r in done] == [1, 2, 3]
    assert sum(r["groups_failed"] for r in done) == 1 and done[-1]["generator_restarts"] == 0
    trained = dataset_run["records"]
    assert 1 not in {r["prompt_index"] for r in trained} and not any("and so on" in r["prompt"] for r in trained)
