"""Ctrl-C (SIGINT) or SIGTERM in the middle of `meshrl train`: a clean stop within seconds, a checkpoint
of the whole steps done and the policy saved, everything written kept, no actor process left behind
(real actors, vLLM, torchtitan)."""

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_run_saves_the_policy_and_leaves_no_process(tmp_path, sig):
    run_dir = tmp_path / "run"
    train = subprocess.Popen([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
                              "--controller.steps", "1000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):  # mid-run
            assert train.poll() is None and time.monotonic() < deadline, "the run ended or never got going"
            time.sleep(0.5)
        actors = psutil.Process(train.pid).children(recursive=True)
        assert actors, "the run has no actor processes"
        train.send_signal(sig)
        sent = time.monotonic()
        _, stderr = train.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if train.poll() is None:
            train.kill()
    assert took < 15, f"stopping took {took:.1f} s"
    assert train.returncode == 128 + sig
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"meshrl: stopped by {sig.name} after ") and f"--resume {run_dir}" in last, last
    time.sleep(1)
    assert not [p for p in actors if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    steps = len(metrics.read_text().splitlines())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == sig.name and summary["steps"] == steps >= 3
    # the stop's checkpoint holds every step logged, and the groups still generating are to be redone
    at_stop = json.loads((run_dir / "checkpoints" / f"step-{steps}" / "checkpoint.json").read_text())
    assert at_stop["step"] == at_stop["policy_version"] == steps
    assert (run_dir / "final" / "model.safetensors").is_file() and (run_dir / "trace.json").is_file()


def test_a_second_sigint_during_the_stops_checkpoint_ends_the_process_within_5_s(tmp_path):
    run_dir = tmp_path / "run"
    train = subprocess.Popen([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
                              "--controller.steps", "1000", "--checkpoint.every", "0",
                              "--trainer.impl", "faulty_actors:SlowSaveTrainer"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert train.poll() is None and time.monotonic() < deadline, "the run ended or never got going"
            time.sleep(0.5)
        actors = psutil.Process(train.pid).children(recursive=True)
        train.send_signal(signal.SIGINT)
        while not list((run_dir / "checkpoints").glob(".step-*.partial")):  # the stop's checkpoint is being written
            assert train.poll() is None and time.monotonic() < deadline, "the stop's checkpoint never started"
            time.sleep(0.2)
        time.sleep(1)
        train.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, stderr = train.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if train.poll() is None:
            train.kill()
    assert took < 5, f"the second SIGINT took {took:.1f} s to end the process"
    assert train.returncode == 130
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("meshrl: stopped at once by a second SIGINT after ") and str(run_dir) in last, last
    time.sleep(1)
    assert not [p for p in actors if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT" and summary["steps"] == len(metrics.read_text().splitlines()) >= 2
    assert not list((run_dir / "checkpoints").glob("step-*"))  # the checkpoint was never completed
