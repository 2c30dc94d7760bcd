"""Section `smoke` of `meshrl check gpu`: a whole RL loop on this machine, by whichever path it can run.

- Where vLLM and Monarch are both installed (and not stood in), outside the dry mode: `meshrl train --config
  smoke` in a subprocess (generator, trainer and reference; vLLM and Monarch for real).
- Otherwise (a lent GPU machine has torch and CUDA only), and in the dry mode: the loop in this process over
  the stand-ins, the torch generator sampling with the trainer's own model (meshrl/tools/checks/torch_loop.py):
  a few asynchronous steps of sum_digits, each version the trainer publishes loaded by the generator.
The result names the path that ran (`path`) and the report's first line says it.
"""

import json
import subprocess
import sys
import time

from meshrl.tools.checks import standins, torch_loop

SUBPROCESS = "meshrl train subprocess"
KEPT = ("steps", "stopped_by", "reward_initial", "reward_final", "seconds")


def run(check) -> dict:
    missing = [m for m in ("vllm", "monarch") if not standins.available(m)]
    if check.dry or missing:
        out = torch_loop.run(check)
        out["why"] = "dry mode" if check.dry else f"{' and '.join(missing)} not installed here (or stood in)"
        return out
    return train(check)


def train(check) -> dict:
    """`meshrl train --config smoke` in a subprocess, within the check's --smoke-timeout."""
    run_dir = check.tmp / "smoke"
    command = [sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=check.smoke_timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        return {"path": SUBPROCESS, "status": "fail", "reason": f"no end within {check.smoke_timeout:.0f} s",
                "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    out = {"path": SUBPROCESS, "command": " ".join(command[1:]), "exit_code": done.returncode,
           "run_s": time.perf_counter() - start, "stderr_tail": done.stderr[-2000:]}
    summary = run_dir / "summary.json"
    if summary.is_file():
        figures = json.loads(summary.read_text())
        out["summary"] = {k: v for k, v in figures.items() if k in KEPT or k.endswith(("_initial", "_final"))}
    out["status"] = "pass" if done.returncode == 0 and "summary" in out else "fail"
    return out


def report(section: dict) -> list[str]:
    if section.get("path") != SUBPROCESS:
        lines = torch_loop.report(section)
        return [f"{lines[0]} ({section['why']})", *lines[1:]]
    lines = [f"{SUBPROCESS}: exit code {section.get('exit_code')}, {section.get('run_s', 0):.0f} s: "
             f"{section.get('summary')}"]
    if section["status"] == "fail":
        lines += section.get("stderr_tail", "").splitlines()[-5:]
    return lines
