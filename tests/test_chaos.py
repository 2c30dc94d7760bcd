"""A chaos run on real processes (tiny model): `meshrl chaos`'s kills of every role in turn (a generator
and a grader replica of two each, the trainer, the reference, the replay buffer) during one `meshrl
train`, which survives each: every step logged once, versions continuous, every prompt trained once,
each kill counted in the metrics. Once every victim's replacement serves and a few more steps are
logged, SIGTERM stops the run as a user would: a clean stop after the step in progress, a checkpoint of the
whole steps done and the policy saved, no actor process left behind (replacements included).

One run shows both: a stop after processes were replaced is the harder case of the two. The run must be
stopped: how many steps its kills take is not known ahead (each kill waits for the previous victim's
replacement to serve, and the steps go on meanwhile: a vLLM replica's replacement takes tens of seconds),
so a step count sure to hold all five would run on long after them. It then ends by itself as a user's
run would: resumed for two more steps, it exits 0 with its final eval in summary.json, every step logged
once and every prompt trained once over the whole run. The second signal's stop is tested in
test_clean_stop.py; where the loops stop and what the checkpoint holds at each of their await points,
with fake actors in test_controller.py. A last test kills a weight relay (processes.json names relays too)
and sees another serve."""

import json
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
from assertions import assert_each_prompt_trained_once, assert_final_policy_is_the_trained_one, read_jsonl

from meshrl.tools.chaos import chaos, role_of, steps_logged

pytestmark = pytest.mark.processes

AFTER = 3  # steps logged after the last replacement served, before the SIGTERM


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict:
    """The chaos run, stopped by SIGTERM: its directory, kills, stderr, exit code, seconds the stop took,
    and every actor process it ever had."""
    run_dir = tmp_path_factory.mktemp("chaos") / "run"
    run = subprocess.Popen(
        [sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
         "--controller.steps", "1000", "--checkpoint.every", "20", "--generator.replicas", "2",
         "--generator.num_threads", "1", "--generator.cpus", "0;1", "--grader.replicas", "2",
         "--trainer.loss.kl_coef", "0.05", "--trainer.loss.entropy_coef", "0.01"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    actors = set()
    try:
        made = chaos(run_dir, every_steps=2, kills=5, seed=1, ended=lambda: run.poll() is not None,
                     replaced_within_s=300, say=lambda line: actors.update(psutil.Process(run.pid).children(True)))
        at = steps_logged(run_dir)
        while steps_logged(run_dir) < at + AFTER and run.poll() is None:
            time.sleep(0.05)
        actors.update(psutil.Process(run.pid).children(recursive=True))
        run.send_signal(signal.SIGTERM)
        at_signal = steps_logged(run_dir)
        _, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    time.sleep(1)
    return {"run_dir": run_dir, "made": made, "stderr": stderr, "returncode": run.returncode, "at_signal": at_signal,
            "actors": actors}


def test_a_run_survives_a_kill_of_every_role_in_turn(stopped):
    run_dir, made, stderr = stopped["run_dir"], stopped["made"], stopped["stderr"]
    assert stopped["returncode"] == 128 + signal.SIGTERM, stderr[-3000:]
    for role in ("trainer", "reference", "replay buffer"):  # one line for each failure, one when it is back
        assert stderr.count(f"the {role} failed (") == 1 and "Killed(sig=9)" in stderr, role
    assert [stderr.count(f"the {role} is back") for role in ("trainer", "reference", "replay buffer")] == [1, 1, 1]
    assert sorted(role_of(k["name"]) for k in made) == ["generator", "grader", "reference", "replay_buffer", "trainer"]
    assert all(k["replaced_s"] is not None for k in made), made
    assert [k["step"] for k in made] == sorted(k["step"] for k in made), made
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = len(rows)
    assert steps >= made[-1]["step"] + AFTER
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    # the reference answered every step, and its restart kept the initial policy: the policy (moved by the
    # entropy bonus: the tiny model earns no reward) is the reference at step 1 only
    assert rows[0]["kl"] < 1e-6 and all(r["kl"] > 1e-6 for r in rows[1:])
    last = rows[-1]
    assert [last[f"{role}_restarts"] for role in ("generator", "grader", "trainer", "reference", "replay_buffer")] \
        == [1, 1, 1, 1, 1], last
    restarts = [s["role"] for s in read_jsonl(run_dir / "trace.jsonl") if s["what"] == "restart"]
    assert sorted(restarts) == ["reference", "replay_buffer", "trainer"]
    assert_each_prompt_trained_once(read_jsonl(run_dir / "rollouts.jsonl"), range(2 * steps), 4)


def test_a_signal_mid_run_checkpoints_saves_the_policy_and_leaves_no_process(stopped):
    run_dir, stderr = stopped["run_dir"], stopped["stderr"]
    assert stopped["returncode"] == 128 + signal.SIGTERM
    # it stopped after the step the trainer was on, and no call of the stop ran into its bound (events, not
    # seconds: under load every part of the stop takes longer, none of them may be skipped or hang)
    steps = len(read_jsonl(run_dir / "metrics.jsonl"))
    assert stopped["at_signal"] <= steps <= stopped["at_signal"] + 1, (stopped["at_signal"], steps)
    assert "did not finish within" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("meshrl: stopped by SIGTERM after ") and f"--resume {run_dir}" in last, last
    # every actor process the run had, the replacements and the processes they replaced, is gone
    assert len(stopped["actors"]) > 5
    assert not [p for p in stopped["actors"] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["steps"] == steps
    # the stop's checkpoint holds every step logged, and the groups still generating are to be redone
    at_stop = json.loads((run_dir / "checkpoints" / f"step-{steps}" / "checkpoint.json").read_text())
    assert at_stop["step"] == at_stop["policy_version"] == steps
    assert (run_dir / "trace.json").is_file()
    assert_final_policy_is_the_trained_one(run_dir)


def test_the_stopped_chaos_run_resumed_ends_by_itself_with_its_final_eval(stopped, tmp_path):
    """A copy of the stopped run (the tests above read the original) resumed for 2 more steps."""
    run_dir = tmp_path / "run"
    shutil.copytree(stopped["run_dir"], run_dir)
    steps = len(read_jsonl(run_dir / "metrics.jsonl"))
    result = subprocess.run([sys.executable, "-m", "meshrl", "train", "--resume", str(run_dir), "--controller.steps",
                             str(steps + 2)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps + 2 and "stopped_by" not in summary, summary
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert 0 <= summary["eval_accuracy_final"] == rows[-1]["eval_accuracy"] <= 1  # the last step evaluated
    assert [r["step"] for r in rows] == [r["policy_version"] for r in rows] == list(range(1, steps + 3))
    assert_each_prompt_trained_once(read_jsonl(run_dir / "rollouts.jsonl"), range(2 * (steps + 2)), 4)


def test_chaos_kills_a_weight_relay_and_the_run_starts_another(tmp_path):
    """`weight_sync.relay on` on a local job: the relay is named in processes.json ("relay0") and placement.json;
    `meshrl chaos` picks it and kills it; the run starts another within seconds (processes.json names its new
    pid) and ends by itself with exit 0 and every step logged once."""
    run_dir = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
         "--controller.steps", "6", "--weight_sync.relay", "on"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        made = chaos(run_dir, every_steps=1, kills=1, roles=("relay",), ended=lambda: run.poll() is not None,
                     replaced_within_s=60, say=lambda line: None)
        _, stderr = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr[-3000:]
    assert [k["name"] for k in made] == ["relay0"] and made[0]["replaced_s"] is not None, made
    assert stderr.count("the weight relay of generator host 0 failed (") == 1, stderr[-3000:]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert "relay0" in json.loads((run_dir / "placement.json").read_text())
