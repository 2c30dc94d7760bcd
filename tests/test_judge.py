"""The model-judged grader: its verdict read from the judge's first-token log-probabilities, rubric
checks, and a smoke run with it as the grader (tiny policy, the embedded SmolLM2 as the judge, real
actors and vLLM) on a mix of two reasoning-gym datasets, whose rewards mix the judge's P(yes) with
the task's own reward as configured and whose metrics give each dataset's accuracy."""

import json
import math
import subprocess
import sys

import pytest

from meshrl.actors.judge import RUBRIC, check_rubric, p_yes


def test_the_verdict_is_p_yes_against_no_over_the_first_tokens_alternatives():
    lp = math.log
    assert p_yes({" Yes": lp(0.6), "yes": lp(0.1), "No": lp(0.1), "Maybe": lp(0.2)}) == pytest.approx(0.875)
    assert p_yes({"no": lp(0.5), "The": lp(0.5)}) == 0.0
    assert p_yes({"The": lp(0.9), "A": lp(0.1)}) is None  # neither: the judge did not answer


def test_a_rubric_must_show_the_reply_and_name_only_known_fields():
    check_rubric(RUBRIC)
    check_rubric("Is this right? {reply} Say yes or no.")
    with pytest.raises(ValueError, match=r"must show the judge the \{reply\}"):
        check_rubric("Is {reference} the answer to {question}?")
    with pytest.raises(ValueError, match=r"only \{question\}, \{reference\} and \{reply\}"):
        check_rubric("{reply} vs {gold}")


def test_a_reasoning_gym_mix_graded_by_a_judge_model_trains_and_reports_each_datasets_accuracy(tmp_path, cli):
    run = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(tmp_path / "run"),
                          "--checkpoint.every", "0", "--task", "reasoning_gym", "--reasoning_gym.datasets",
                          "chain_sum:1,leg_counting:1", "--reasoning_gym.eval_size", "6", "--reasoning_gym.format_weight",
                          "0.1", "--grader.impl", "meshrl.actors.judge:JudgeGrader", "--grader.judge.rule_weight", "0.5"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rollouts = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts
    for r in rollouts:
        checks = r["reward_components"]
        rule = checks["score"] + 0.1 * checks["format"]  # the reasoning-gym task's own reward
        assert r["reward"] == pytest.approx(0.5 * checks["judge_yes"] + 0.5 * rule)
        assert checks["judge_parsed"] == 1.0 or checks["judge_yes"] == 0.0  # no yes or no: scored 0
        # the judge agrees with the task's accuracy check (`correct`) when both say the same
        assert checks["judge_agrees"] == float((checks["judge_yes"] > 0.5) == (checks["correct"] >= 0.5))
    assert any(r["reward_components"]["judge_parsed"] for r in rollouts)  # SmolLM2 answers yes or no
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"judge_yes", "judge_agrees", "eval_judge_yes"} <= rows[-1].keys()
    evaluated = {k for row in rows for k in row if k.startswith("eval_accuracy/")}
    assert evaluated == {"eval_accuracy/chain_sum", "eval_accuracy/leg_counting"}
    assert {k for row in rows for k in row if k.startswith("accuracy/")} <= {"accuracy/chain_sum", "accuracy/leg_counting"}
    for row in rows:  # each dataset's accuracy and the judge's figures: the means over the step's replies
        checks = [r["reward_components"] for r in rollouts if r["step"] == row["step"]]
        for dataset in ("chain_sum", "leg_counting"):
            mine = [c[f"correct/{dataset}"] for c in checks if f"correct/{dataset}" in c]
            assert (f"accuracy/{dataset}" in row) == bool(mine), (row["step"], dataset)
            assert not mine or row[f"accuracy/{dataset}"] == pytest.approx(sum(mine) / len(mine))
        assert row["judge_yes"] == pytest.approx(sum(c["judge_yes"] for c in checks) / len(checks))
    code, _, err = cli("train", "--config", "smoke", "--run-dir", tmp_path / "bad", "--grader.impl",
                       "meshrl.actors.judge:JudgeGrader", "--grader.judge.rubric", "{answer}?")
    assert code == 2 and not (tmp_path / "bad").exists()
    assert err.strip().splitlines() == [
        "meshrl: error: grader.judge.rubric may use only {question}, {reference} and {reply} (KeyError('answer'))"]
