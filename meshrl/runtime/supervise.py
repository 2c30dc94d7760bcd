"""`meshrl train --supervise`: the controller's process is the one process of a run nothing else brings
back (the roles' actors are restarted by it, meshrl/restarts.py). Supervised, the controller runs as the
child of a small parent that starts it again, with `--resume RUN_DIR`, from its newest complete checkpoint
when it dies a death nobody asked for: SIGKILL (the OOM killer's, say), a segfault, an abort. Steps logged
after that checkpoint run again (metrics.jsonl keeps each step once, meshrl/runtime/loggers.py); one line
says how many.

A stop asked for is never undone: Ctrl-C, SIGTERM and SIGHUP sent to the parent are passed on to the
controller once each (it runs in a process group of its own, so a terminal's Ctrl-C reaches it only this
way, once), and whatever it ends with then is the run's end, its exit status the parent's. An exit the
controller chose (0, a failure's 1, bad input's 2, a stop's 130/143) is passed on as it is.

The parent is made the subreaper of everything under it (Linux), so the actor processes a dead controller
leaves are its children: it waits a few seconds for them to end by themselves (Monarch's do), then kills
what is left before starting a new controller. RUN_DIR/controller.pid names the controller's process, and
the run's summary.json counts the restarts (`controller_restarts`). Restarts are bounded like the roles':
more than MAX_RESTARTS controllers each killed within WINDOW_S of its start end the run with one error line.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

MAX_RESTARTS = 3  # controllers killed soon after their start, one after another, before the parent gives up
WINDOW_S = 300.0  # a controller that ran longer than this before it was killed starts the count afresh
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # stops asked for: passed on, never restarted
RESTARTED = (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE)
LEFT_GRACE_S = 5.0  # how long a dead controller's processes have to end by themselves before they are killed


def train_commands(config: str | None, run_dir: Path, resume: Path | None, overrides: list[str]) -> tuple:
    """The controller's first command and the one that goes on from the newest checkpoint."""
    meshrl = [sys.executable, "-m", "meshrl", "train"]
    again = [*meshrl, "--resume", str(run_dir), *overrides]
    return (again if resume else [*meshrl, "--config", config, "--run-dir", str(run_dir), *overrides]), again


class Supervisor:
    """Runs one controller after another in `run_dir` until one ends by itself or is stopped."""

    def __init__(self, run_dir: Path, first: list[str], again: list[str], max_restarts: int = MAX_RESTARTS,
                 window_s: float = WINDOW_S):
        self.run_dir, self.first, self.again = Path(run_dir), first, again
        self.max_restarts, self.window_s = max_restarts, window_s
        self.child: subprocess.Popen | None = None
        self.asked: list[int] = []  # the signals passed on (or to pass on to a controller about to start)
        self.sent = 0  # how many of them the current controller got
        self.restarts = 0

    def run(self) -> int:
        """The exit status of the run: the last controller's, or 1 when restarts ran out."""
        _become_subreaper()
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        created = not self.run_dir.exists()
        try:
            return self._supervise()
        finally:
            (self.run_dir / "controller.pid").unlink(missing_ok=True)
            if created and self.run_dir.is_dir() and not any(self.run_dir.iterdir()):
                self.run_dir.rmdir()  # bad input: the controller started nothing

    def _supervise(self) -> int:
        command, soon = self.first, 0  # soon: controllers killed one after another, each within window_s
        while True:
            started, started_at = time.monotonic(), time.time()
            code = self._run_child(command)
            pid = self.child.pid
            left = _end_left_over()
            if code >= 0 or -code not in RESTARTED:  # it ended, or was stopped as asked
                self._count_restarts(started_at)
                return code if code >= 0 else 128 - code
            soon = soon + 1 if time.monotonic() - started < self.window_s else 1
            step, saved = _steps_logged(self.run_dir), _newest_checkpoint(self.run_dir)
            name = signal.Signals(-code).name
            resume = f"; go on with: meshrl train --resume {self.run_dir}" if saved is not None else ""
            if self.asked:  # a stop was asked for: it is not undone
                print(f"meshrl: the controller (pid {pid}) was killed by {name} after step {step} while it stopped "
                      f"as asked; not starting it again{resume}", file=sys.stderr, flush=True)
                return 128 - code
            if soon > self.max_restarts:
                print(f"meshrl: error: the controller was killed {soon} times, each within {self.window_s:g} s of "
                      f"its start (the last, pid {pid}, by {name} after step {step}); not starting it again"
                      f"{resume}", file=sys.stderr, flush=True)
                return 1
            self.restarts += 1
            killed = f" ({left} process{'es' if left > 1 else ''} it left killed)" if left else ""
            redone = step - (saved or 0)
            redone = f"{redone} step{'' if redone == 1 else 's'} redone"
            where = (f"going on from checkpoint step {saved} ({redone})" if saved is not None else
                     f"no checkpoint yet: starting again from step 0 ({redone})")
            print(f"meshrl: the controller (pid {pid}) was killed by {name} after step {step}; {where}{killed}",
                  file=sys.stderr, flush=True)
            command = self.again if saved is not None else self.first

    def _run_child(self, command: list[str]) -> int:
        """Start `command` in a process group of its own, wait for it (reaping orphans adopted meanwhile)
        and return its exit code (-N: killed by signal N)."""
        self.sent = 0
        self.child = subprocess.Popen(command, process_group=0)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "controller.pid").write_text(f"{self.child.pid}\n")
        for sig in self.asked[self.sent:]:  # asked for while it started
            self._send(sig)
        while True:
            try:
                pid, status = os.waitpid(-1, 0)  # a signal's handler runs meanwhile; the wait goes on after it
            except ChildProcessError:
                return self.child.returncode if self.child.returncode is not None else 1
            if pid == self.child.pid:
                self.child.returncode = os.waitstatus_to_exitcode(status)
                return self.child.returncode

    def _forward(self, sig: int, frame) -> None:
        self.asked.append(sig)
        if self.child is not None and self.child.returncode is None:
            self._send(sig)

    def _send(self, sig: int) -> None:
        self.sent += 1
        try:
            os.kill(self.child.pid, sig)
        except ProcessLookupError:
            pass

    def _count_restarts(self, started_at: float) -> None:
        """`controller_restarts` into the summary.json the last controller wrote, if it wrote one."""
        path = self.run_dir / "summary.json"
        try:
            if path.stat().st_mtime < started_at - 1:
                return  # an earlier run's
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        path.write_text(json.dumps({**summary, "controller_restarts": self.restarts}, indent=2))


def _become_subreaper() -> None:
    """Orphans of the processes under this one become its children (Linux's PR_SET_CHILD_SUBREAPER),
    instead of init's: the actor processes of a dead controller stay within reach."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # elsewhere they are init's; processes.json still names them


def _end_left_over() -> int:
    """Wait up to LEFT_GRACE_S for the processes a dead controller left (now this process's children) to
    end, then kill the rest; every one reaped. How many had to be killed."""
    deadline, killed = time.monotonic() + LEFT_GRACE_S, set()
    while time.monotonic() < deadline + LEFT_GRACE_S:  # then one that ignores SIGKILL (stuck in the kernel) stays
        _reap()
        left = [p for p in psutil.Process().children(recursive=True) if _alive(p)]
        if not left:
            break
        for p in left if time.monotonic() > deadline else []:
            try:
                p.kill()
                killed.add(p.pid)
            except psutil.Error:
                pass
        time.sleep(0.2)
    return len(killed)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _steps_logged(run_dir: Path) -> int:
    """The last step metrics.jsonl holds (a line cut short by the kill does not count)."""
    step = 0
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            pass
    return step


def _newest_checkpoint(run_dir: Path) -> int | None:
    """The step of the run's newest complete checkpoint, None if there is none (or no config.json)."""
    if not (run_dir / "config.json").is_file():
        return None
    from meshrl.checkpoint import checkpoints  # torch: imported once a restart needs it

    done = checkpoints(run_dir)
    return done[-1][0] if done else None
