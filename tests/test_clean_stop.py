"""A second Ctrl-C (SIGINT) while `meshrl train` stops: it ends the process within seconds whatever the
stop is doing, leaving no half-written checkpoint and no process (real actors, vLLM, torchtitan).
The first signal's clean stop (a checkpoint of the whole steps done, the policy saved, no actor process
left) is the end of the chaos run in test_chaos.py; where the loops stop and what the checkpoint holds
at each of their await points is tested with fake actors (test_controller.py)."""

import json
import signal
import subprocess
import sys
import time

import pytest
import psutil

pytestmark = pytest.mark.processes


def start(run_dir, *args) -> tuple[subprocess.Popen, list]:
    """`meshrl train --config smoke` for 1000 steps, once it has logged 2 steps: the run, its actor processes."""
    train = subprocess.Popen([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
                              "--controller.steps", "1000", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 300
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):  # mid-run
        if train.poll() is not None or time.monotonic() > deadline:
            train.kill()
            raise AssertionError(f"the run ended or never got going: {train.communicate()[1][-3000:]}")
        time.sleep(0.5)
    actors = psutil.Process(train.pid).children(recursive=True)
    assert actors, "the run has no actor processes"
    return train, actors


def ended(train: subprocess.Popen, actors: list, sent: float) -> tuple[float, str]:
    """Seconds from `sent` to the run's exit, and its stderr; no actor process left."""
    try:
        _, stderr = train.communicate(timeout=60)
    finally:
        if train.poll() is None:
            train.kill()
    took = time.monotonic() - sent
    time.sleep(1)
    assert not [p for p in actors if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return took, stderr


def test_a_second_sigint_during_the_stops_checkpoint_ends_the_process_within_5_s(tmp_path):
    run_dir = tmp_path / "run"
    train, actors = start(run_dir, "--checkpoint.every", "0", "--trainer.impl", "faulty_actors:SlowSaveTrainer")
    train.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 120
    while not list((run_dir / "checkpoints").glob(".step-*.partial")):  # the stop's checkpoint is being written
        assert train.poll() is None and time.monotonic() < deadline, "the stop's checkpoint never started"
        time.sleep(0.2)
    time.sleep(1)
    train.send_signal(signal.SIGINT)
    took, stderr = ended(train, actors, time.monotonic())
    assert took < 5, f"the second SIGINT took {took:.1f} s to end the process"
    assert train.returncode == 130
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("meshrl: stopped at once by a second SIGINT after ") and str(run_dir) in last, last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT"
    assert summary["steps"] == len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 2
    assert not list((run_dir / "checkpoints").glob("step-*"))  # the checkpoint was never completed
    assert (run_dir / "trace.json").is_file()
