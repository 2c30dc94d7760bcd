"""`meshrl train` with two generator replicas (real actors, vLLM, torchtitan, tiny model): a replica
killed mid-run is replaced without losing or repeating a group, and a dead trainer ends the run with
one line. The staleness bound across replicas is tested with fake actors (test_controller.py)."""

import json
import math
import signal
import subprocess
import sys
import time

import psutil
import pytest
from assertions import (assert_each_prompt_trained_once, assert_final_policy_is_the_trained_one, assert_staleness_bound,
                        read_jsonl)

from meshrl.weight_sync.disk import versions

pytestmark = pytest.mark.processes

TWO_REPLICAS = ["--generator.replicas", "2", "--generator.num_threads", "1", "--generator.cpus", "0;1"]


def train(run_dir, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
                             *TWO_REPLICAS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_steps(run, run_dir, steps: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never got going"
        time.sleep(0.2)


def test_a_killed_replica_is_replaced_and_every_group_is_trained_exactly_once(tmp_path):
    # long completions keep the replicas busy, so the one killed has groups in flight
    run = train(tmp_path, "--controller.steps", "4", "--controller.prompts_per_step", "4",
                "--controller.group_size", "8", "--generator.max_tokens", "96", "--controller.max_policy_age", "1")
    try:
        wait_for_steps(run, tmp_path, 2)
        victim = psutil.Process(json.loads((tmp_path / "processes.json").read_text())["generator1"])
        deadline = time.monotonic() + 60
        while victim.cpu_percent(interval=0.1) < 50:  # generating, not waiting for weights
            assert time.monotonic() < deadline, "the replica never got busy"
        victim.send_signal(signal.SIGKILL)
        _, stderr = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr[-3000:]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 5))
    assert rows[-1]["generator_restarts"] == 1 and rows[-1]["generator_calls_retried"] >= 1
    records = read_jsonl(tmp_path / "rollouts.jsonl")
    assert_staleness_bound(rows, records, 1)
    # each trained group's prompt appears in one step only, with its whole group
    assert_each_prompt_trained_once(records, {r["prompt_index"] for r in records}, 8)
    assert len({r["prompt_index"] for r in records}) == 4 * 4
    # processes.json names live actors only: the replacement, or none if the run ended before it served
    assert json.loads((tmp_path / "processes.json").read_text()).get("generator1") != victim.pid
    assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
    assert_final_policy_is_the_trained_one(tmp_path)


# The tiny random model never earns a reward: DAPO's dynamic sampling drops every group (2 rounds of 2
# prompts a step), and the trainer still steps (on nothing) so the loop goes on.
DAPO_ON_DISK = ["--trainer.loss.name", "dapo", "--controller.drop_equal_reward_groups", "true",
                "--controller.max_sample_rounds", "2", "--weight_sync.transport", "disk"]


@pytest.fixture(scope="module")
def dead_trainer(tmp_path_factory) -> dict:
    """A run whose trainer is killed after step 2, with trainer.max_restarts 0 (a restarted trainer:
    tests/test_checkpoint.py; the replay buffer's death there too). It also runs DAPO's dynamic sampling,
    and its weights go by the plain path (saved, loaded from the file)."""
    run_dir = tmp_path_factory.mktemp("dead_trainer")
    run = train(run_dir, "--controller.steps", "1000", "--trainer.max_restarts", "0", *DAPO_ON_DISK)
    try:
        wait_for_steps(run, run_dir, 2)
        actors = psutil.Process(run.pid).children(recursive=True)
        psutil.Process(json.loads((run_dir / "processes.json").read_text())["trainer"]).send_signal(signal.SIGKILL)
        _, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    time.sleep(1)
    return {"dir": run_dir, "code": run.returncode, "stderr": stderr, "actors": actors}


def test_a_dead_trainer_out_of_restarts_ends_the_run_with_one_line_and_keeps_what_was_written(dead_trainer):
    run_dir, stderr = dead_trainer["dir"], dead_trainer["stderr"]
    assert dead_trainer["code"] == 1
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("meshrl: error: the trainer failed 1 times in a row") and "max_restarts 0" in last, last
    assert f"are in {run_dir}" in last and "Killed(sig=9)" in last, last
    assert "Traceback" not in stderr
    steps = len(read_jsonl(run_dir / "metrics.jsonl"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps >= 2 and "trainer" in summary["failed"]
    assert (run_dir / "trace.json").is_file() and (run_dir / "curves.png").is_file()
    assert not [p for p in dead_trainer["actors"] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_dynamic_sampling_drops_groups_without_signal_and_weights_go_by_the_plain_path(dead_trainer):
    run_dir = dead_trainer["dir"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert all(r["groups_dropped"] == r["equal_reward_groups"] == 4 and r["tokens_trained"] == 0
               and math.isnan(r["reward_mean"]) and math.isnan(r["accuracy"]) for r in rows)
    # each version a file (the newest kept); the generators loaded each version the steps sampled with (step s
    # samples version s - 1: the last step's own version may still be being written when the kill comes)
    steps = [r["step"] for r in rows]
    assert versions(run_dir / "weights") and max(versions(run_dir / "weights")) >= steps[-1] - 1
    placement = json.loads((run_dir / "placement.json").read_text())
    assert placement["generator0"]["weight_transport"] == placement["generator1"]["weight_transport"] == "disk"
    pulls = [s for s in read_jsonl(run_dir / "trace.jsonl") if s["role"] == "generator" and s["what"] == "pull"]
    assert {s["policy_version"] for s in pulls} >= set(steps[:-1])
