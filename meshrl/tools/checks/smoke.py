"""Section `smoke` of `meshrl check gpu`: `meshrl train --config smoke` end to end on this machine's GPU
(generator, trainer and reference; vLLM and Monarch for real), where both are installed; otherwise, and
in the dry mode, skipped with the reason (on the CPU, tests/test_train_smoke.py trains the same config).
"""

import json
import subprocess
import sys
import time

from meshrl.tools.checks import standins

KEPT = ("steps", "stopped_by", "reward_initial", "reward_final", "seconds")


def run(check) -> dict:
    if check.dry:
        return {"status": "skipped", "reason": "dry mode: on the CPU tests/test_train_smoke.py trains this config"}
    missing = [m for m in ("vllm", "monarch") if not standins.available(m)]
    if missing:
        return {"status": "skipped", "reason": f"{' and '.join(missing)} not installed here (or stood in)"}
    run_dir = check.tmp / "smoke"
    command = [sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=check.smoke_timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        return {"status": "fail", "reason": f"no end within {check.smoke_timeout:.0f} s",
                "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    out = {"command": " ".join(command[1:]), "exit_code": done.returncode, "run_s": time.perf_counter() - start,
           "stderr_tail": done.stderr[-2000:]}
    summary = run_dir / "summary.json"
    if summary.is_file():
        figures = json.loads(summary.read_text())
        out["summary"] = {k: v for k, v in figures.items() if k in KEPT or k.endswith(("_initial", "_final"))}
    out["status"] = "pass" if done.returncode == 0 and "summary" in out else "fail"
    return out


def report(section: dict) -> list[str]:
    lines = [f"exit code {section.get('exit_code')}, {section.get('run_s', 0):.0f} s: {section.get('summary')}"]
    if section["status"] == "fail":
        lines += section.get("stderr_tail", "").splitlines()[-5:]
    return lines
