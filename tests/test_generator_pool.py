"""`meshrl train` with two generator replicas (real actors, vLLM, torchtitan, tiny model): a replica
killed mid-run is replaced without losing or repeating a group, and a dead trainer ends the run with
one line. The staleness bound across replicas is tested with fake actors (test_controller.py)."""

import json
import signal
import subprocess
import sys
import time

import psutil
from assertions import (assert_each_prompt_trained_once, assert_final_policy_is_the_trained_one, assert_staleness_bound,
                        read_jsonl)

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


def test_a_dead_trainer_out_of_restarts_ends_the_run_with_one_line_and_keeps_what_was_written(tmp_path):
    """With trainer.max_restarts 0 (a restarted trainer: tests/test_checkpoint.py; the replay buffer's death
    there too)."""
    role = "trainer"
    run = train(tmp_path, "--controller.steps", "1000", "--trainer.max_restarts", "0")
    try:
        wait_for_steps(run, tmp_path, 2)
        actors = psutil.Process(run.pid).children(recursive=True)
        psutil.Process(json.loads((tmp_path / "processes.json").read_text())[role]).send_signal(signal.SIGKILL)
        _, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("meshrl: error: the trainer failed 1 times in a row") and "max_restarts 0" in last, last
    assert f"are in {tmp_path}" in last and "Killed(sig=9)" in last, last
    assert "Traceback" not in stderr
    steps = len(read_jsonl(tmp_path / "metrics.jsonl"))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == steps >= 2 and role in summary["failed"]
    assert (tmp_path / "trace.json").is_file() and (tmp_path / "curves.png").is_file()
    time.sleep(1)
    assert not [p for p in actors if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

