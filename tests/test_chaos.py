"""A chaos run on real processes (tiny model): `meshrl chaos`'s kills of every role in turn (a generator
and a grader replica of two each, the trainer, the reference, the replay buffer) during one `meshrl
train`, which ends by itself with every step logged once, versions continuous, every prompt trained
once, the held-out eval at the end, and each kill counted in the metrics."""

import subprocess
import sys

from assertions import assert_each_prompt_trained_once, read_jsonl

from meshrl.tools.chaos import chaos, role_of

STEPS = 100  # a kill 8 steps after the previous one was replaced (steps go on while a replica restarts): 5 by step 80 or so


def test_a_run_survives_a_kill_of_every_role_in_turn(tmp_path):
    run_dir = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
         "--controller.steps", str(STEPS), "--checkpoint.every", "20", "--generator.replicas", "2",
         "--generator.num_threads", "1", "--generator.cpus", "0;1", "--grader.replicas", "2",
         "--trainer.loss.kl_coef", "0.05", "--trainer.loss.entropy_coef", "0.01"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        made = chaos(run_dir, every_steps=8, kills=5, seed=1, ended=lambda: run.poll() is not None,
                     replaced_within_s=300, say=lambda line: None)
        _, stderr = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr[-3000:]
    for role in ("trainer", "reference", "replay buffer"):  # one line for each failure, one when it is back
        assert stderr.count(f"the {role} failed (") == 1 and "Killed(sig=9)" in stderr, role
    assert [stderr.count(f"the {role} is back") for role in ("trainer", "reference", "replay buffer")] == [1, 1, 1]
    assert sorted(role_of(k["name"]) for k in made) == ["generator", "grader", "reference", "replay_buffer", "trainer"]
    assert all(k["replaced_s"] is not None for k in made), made
    assert [k["step"] for k in made] == sorted(k["step"] for k in made) and made[-1]["step"] < STEPS, made
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["policy_version"] for r in rows] == list(range(1, STEPS + 1))
    # the reference answered every step, and its restart kept the initial policy: the policy (moved by the
    # entropy bonus: the tiny model earns no reward) is the reference at step 1 only
    assert "eval_accuracy" in rows[-1] and rows[0]["kl"] < 1e-6 and all(r["kl"] > 1e-6 for r in rows[1:])
    last = rows[-1]
    assert [last[f"{role}_restarts"] for role in ("generator", "grader", "trainer", "reference", "replay_buffer")] \
        == [1, 1, 1, 1, 1], last
    restarts = [s["role"] for s in read_jsonl(run_dir / "trace.jsonl") if s["what"] == "restart"]
    assert sorted(restarts) == ["reference", "replay_buffer", "trainer"]
    assert_each_prompt_trained_once(read_jsonl(run_dir / "rollouts.jsonl"), range(2 * STEPS), 4)
