"""`meshrl chaos RUN_DIR`: SIGKILL the actor processes of a running `meshrl train`, one at a time, to see
that the run survives each (docs/running.md: Stopping a run, and processes that die).

Every role in turn, in a random order (then again, in another), a random serving process of it as the
run's `processes.json` names it: a generator or grader replica, a trainer rank, a reference rank, the
replay buffer, a weight relay ("relay0"...: replaced within seconds). A kill comes `every_s` seconds (or
`every_steps` logged steps) after the previous victim's replacement appeared in `processes.json`, so that
each failure is survived on its own. It
stops after `kills` kills (0: none more once the run has ended). The processes must be on this
machine (a `local` or `process` job).
"""

import json
import os
import random
import re
import signal
import time
from pathlib import Path


def role_of(name: str) -> str:
    """ "generator1" -> "generator"; "replay_buffer" -> "replay_buffer"."""
    return re.sub(r"\d+$", "", name)


def pids_of(value) -> list[int]:
    return value if isinstance(value, list) else [value]


def steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def serving(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "processes.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being rewritten
        return {}


def chaos(run_dir: Path, every_s: float = 0.0, every_steps: int = 0, kills: int = 0, seed: int = 0,
          ended=lambda: False, replaced_within_s: float = 600.0, say=print,
          roles: tuple[str, ...] = ()) -> list[dict]:
    """Kill as the module says until `kills` are made or `ended()`; returns each kill: {"name", "pid",
    "step" (steps logged when it was made), "replaced_s" (seconds until its replacement served, or None)}.
    `roles`: only these roles' processes (default every role)."""
    run_dir, rng, made, turn = Path(run_dir), random.Random(seed), [], []
    while not kills or len(made) < kills:
        since, at = time.monotonic(), steps_logged(run_dir)
        while (time.monotonic() - since < every_s or steps_logged(run_dir) - at < every_steps) and not ended():
            time.sleep(0.05)
        procs = {name: pids for name, pids in serving(run_dir).items() if not roles or role_of(name) in roles}
        if ended() or not procs:
            break
        if not turn:
            turn = sorted({role_of(name) for name in procs})
            rng.shuffle(turn)
        role = turn.pop(0)
        names = sorted(name for name in procs if role_of(name) == role)
        if not names:
            continue
        name = rng.choice(names)
        pid = rng.choice(pids_of(procs[name]))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        kill = {"name": name, "pid": pid, "step": steps_logged(run_dir), "replaced_s": None}
        made.append(kill)
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < replaced_within_s and not ended():
            now = serving(run_dir).get(name)
            if now is not None and pid not in pids_of(now):
                kill["replaced_s"] = time.monotonic() - killed_at
                break
            time.sleep(0.05)
        replaced = f"replaced in {kill['replaced_s']:.1f} s" if kill["replaced_s"] is not None else "not replaced"
        say(f"killed {name} (pid {pid}) after step {kill['step']}: {replaced}")
    return made
