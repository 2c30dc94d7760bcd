"""`meshrl train --supervise` (meshrl/runtime/supervise.py): a controller whose process is SIGKILLed comes
back by itself from its newest checkpoint and the run ends as if nothing happened (a real smoke run: exit 0,
every step once, the restart counted and said in one line, no process left behind). A stop asked for
(Ctrl-C, SIGTERM) reaches the controller once and is never undone by a restart, a controller killed again
and again is given up with one error line, and what a dead controller left running is killed: these with
small stand-in controllers, whose exits the tests choose."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from assertions import assert_each_prompt_trained_once, read_jsonl

pytestmark = pytest.mark.processes


def wait_for(condition, process: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{what}: never came (exit {process.poll()})")
        time.sleep(0.1)


def test_a_supervised_run_whose_controller_is_sigkilled_comes_back_and_ends_with_every_step_once(tmp_path):
    run_dir, out, err = tmp_path / "run", tmp_path / "stdout", tmp_path / "stderr"
    run = subprocess.Popen([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
                            "--controller.steps", "6", "--checkpoint.every", "2", "--supervise"],
                           stdout=out.open("w"), stderr=err.open("w"), start_new_session=True)
    family = set()  # every process the run ever had under the supervisor
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3, run, "step 3")
        killed = int((run_dir / "controller.pid").read_text())
        controller = psutil.Process(killed)
        assert controller.ppid() == run.pid and "--supervise" not in controller.cmdline()
        family.update(psutil.Process(run.pid).children(recursive=True))
        assert len(family) > 2  # the controller and its actors
        os.kill(killed, signal.SIGKILL)
        while run.poll() is None:
            family.update(psutil.Process(run.pid).children(recursive=True))
            time.sleep(0.5)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    stderr = err.read_text()
    assert run.returncode == 0, stderr[-3000:]
    said = re.findall(rf"meshrl: the controller \(pid {killed}\) was killed by SIGKILL after step (\d+); going on "
                      r"from checkpoint step (\d+) \((\d+) steps? redone\)", stderr)
    assert len(said) == 1 and stderr.count("was killed by") == 1, stderr[-3000:]
    step, saved, redone = (int(n) for n in said[0])
    assert step >= 3 and saved in (step - 1, step) and saved % 2 == 0 and redone == step - saved  # at most 1 interval
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{saved}'} (step {saved}" in out.read_text()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert_each_prompt_trained_once(read_jsonl(run_dir / "rollouts.jsonl"), range(12), group_size=4)  # 2 a step
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["controller_restarts"] == 1 and summary["steps"] == 6 and "stopped_by" not in summary
    assert (run_dir / "final" / "config.json").is_file()
    assert not (run_dir / "controller.pid").exists()
    time.sleep(1)
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_ctrl_c_stops_a_supervised_run_once_with_the_usual_line_and_no_restart(tmp_path):
    """SIGINT to the supervisor's whole process group, as a terminal's Ctrl-C sends it."""
    run_dir, out = tmp_path / "run", tmp_path / "stdout"
    run = subprocess.Popen([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
                            "--controller.steps", "1000", "--supervise"], stdout=out.open("w"), stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, run, "step 2")
        family = psutil.Process(run.pid).children(recursive=True)
        os.killpg(run.pid, signal.SIGINT)
        _, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("meshrl: stopped by SIGINT after "), stderr[-3000:]
    assert "was killed" not in stderr and "resumed from" not in out.read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT" and summary["controller_restarts"] == 0
    time.sleep(1)
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


STAND_IN = textwrap.dedent("""
    # a stand-in controller: logs its start, then does what the test's file says for this start
    import os, signal, subprocess, sys, time
    log = sys.argv[1]
    starts = len(open(log).read().splitlines()) if os.path.exists(log) else 0
    plan = open(log + ".plan").read().split()[min(starts, len(open(log + ".plan").read().split()) - 1)]
    signal.signal(signal.SIGINT, lambda s, f: open(log + ".signals", "a").write(f"{s}\\n"))
    signal.signal(signal.SIGTERM, lambda s, f: open(log + ".signals", "a").write(f"{s}\\n"))
    open(log, "a").write(f"{os.getpid()}\\n")
    if plan == "leave":  # a process it started outlives it
        left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        open(log + ".left", "w").write(str(left.pid))
        os.kill(os.getpid(), signal.SIGKILL)
    if plan == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if plan in ("stop", "killed_stopping"):  # a clean stop: 130 or 143 after the first signal, however many came
        open(log + ".ready", "w").write("")
        while not os.path.exists(log + ".signals"):
            time.sleep(0.05)
        time.sleep(1.0)
        if plan == "killed_stopping":  # the user's kill -9 after a Ctrl-C that seemed slow, say
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(128 + int(open(log + ".signals").read().split()[0]))
    sys.exit(int(plan))
""")


def supervise(tmp_path, plan: list[str]) -> tuple[subprocess.Popen, str]:
    """The supervisor (max 3 restarts) over the stand-in controller, which does plan[i] at its i-th start."""
    (tmp_path / "starts.plan").write_text(" ".join(plan))
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    command = [sys.executable, str(tmp_path / "stand_in.py"), str(tmp_path / "starts")]
    code = (f"import sys; from pathlib import Path; from meshrl.runtime.supervise import Supervisor; "
            f"sys.exit(Supervisor(Path({str(tmp_path / 'run')!r}), {command!r}, {command!r}, 3, 300).run())")
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True,
                            start_new_session=True), str(tmp_path / "starts")


def test_a_controller_killed_again_and_again_is_given_up_after_three_restarts_with_one_error_line(tmp_path):
    run, log = supervise(tmp_path, ["kill"])
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 1
    assert len(open(log).read().splitlines()) == 4  # the first start and 3 restarts
    lines = stderr.strip().splitlines()
    restarted = "no checkpoint yet: starting again from step 0 (0 steps redone)"
    assert len([line for line in lines if restarted in line]) == 3
    assert lines[-1].startswith("meshrl: error: the controller was killed 4 times, each within 300 s of its start")


def test_a_process_a_killed_controller_left_is_killed_before_it_starts_again(tmp_path):
    run, log = supervise(tmp_path, ["leave", "0"])
    _, stderr = run.communicate(timeout=60)
    left = int(open(log + ".left").read())
    try:
        assert run.returncode == 0, stderr
        assert len(open(log).read().splitlines()) == 2
        assert "(1 process it left killed)" in stderr
        assert not alive(left)
    finally:
        if alive(left):  # the test failed: leave nothing behind
            psutil.Process(left).kill()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_sent_to_the_supervisors_group_reaches_the_controller_once_and_is_not_undone(tmp_path, sig):
    """As a terminal's Ctrl-C: the signal goes to the supervisor's whole process group."""
    run, log = supervise(tmp_path, ["stop", "kill"])
    wait_for(lambda: os.path.exists(log + ".ready"), run, "the stand-in's start", timeout=60)
    os.killpg(run.pid, sig)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 128 + sig, stderr
    assert open(log + ".signals").read().split() == [str(int(sig))]  # once
    assert len(open(log).read().splitlines()) == 1 and "was killed" not in stderr


def test_a_controller_killed_while_it_stops_as_asked_is_not_started_again(tmp_path):
    run, log = supervise(tmp_path, ["killed_stopping", "kill"])
    wait_for(lambda: os.path.exists(log + ".ready"), run, "the stand-in's start", timeout=60)
    os.killpg(run.pid, signal.SIGINT)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 128 + signal.SIGKILL, stderr
    assert len(open(log).read().splitlines()) == 1
    assert stderr.strip().splitlines()[-1].endswith("was killed by SIGKILL after step 0 while it stopped as asked; "
                                                    "not starting it again"), stderr


def test_an_exit_the_controller_chose_is_the_runs_and_not_restarted(tmp_path):
    run, log = supervise(tmp_path, ["2", "0"])
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 2 and len(open(log).read().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # nothing was started: the directory made for controller.pid is gone
