"""`meshrl study NAME`: a named question answered by several training runs and one report.

A study (meshrl/tools/studies/) is a list of runs, each a `meshrl train` command with its own run
directory under the study's, and a function that turns their files into `report.md` with tables
and plots. A run whose summary.json says it trained every step of the recipe the study has now (its
config and overrides, study_run.json, and its resolved config's hash, summary.json's `config_hash`) is
finished and never redone; one whose recipe has changed since is stale, redone when the study runs and
named as such in a report written without it: a study
stopped midway (Ctrl-C, a crash, a machine taken away) goes on from the first unfinished run when
started again; that run starts over. A finished run's checkpoints are removed (its final policy
stays). Each run is a process of its own, so one that fails leaves its log and stops the study with
one line. The report names the machine and repeats the commands.
"""

import fnmatch
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from meshrl.configs.named import load_config
from meshrl.configs.recipe import recipe_hash


@dataclass
class StudyRun:
    name: str  # its run directory, under the study's
    config: str  # a named config
    overrides: list[str] = field(default_factory=list)

    def command(self, run_dir: Path) -> list[str]:
        return ["meshrl", "train", "--config", self.config, "--run-dir", str(run_dir), *self.overrides]

    def steps(self) -> int:
        return load_config(self.config, self.overrides).controller.steps

    def config_hash(self) -> str:
        return recipe_hash(load_config(self.config, self.overrides))

    def recipe(self) -> dict:
        """What the run trains (its config and overrides; not where): kept in its directory as study_run.json."""
        return {"config": self.config, "overrides": self.overrides}


@dataclass
class Study:
    name: str
    question: str  # one line: what it answers
    runs: list[StudyRun]
    report: Callable[[Path, list[StudyRun]], str]  # the study directory -> report.md's body (plots beside it)


STUDIES: dict[str, Study] = {}


def register(study: Study) -> Study:
    STUDIES[study.name] = study
    return study


def finished(run_dir: Path, run: StudyRun) -> bool:
    """Whether `run` trained all its steps in `run_dir` and ended on its own (not stopped, not failed),
    with the recipe the study has now (a study whose runs were changed since runs them again)."""
    return ended(run_dir, run) and not stale(run_dir, run)


def ended(run_dir: Path, run: StudyRun) -> bool:
    """Whether a run trained all its steps in `run_dir` and ended on its own, whatever its recipe."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return False
    summary = json.loads(path.read_text())
    return summary.get("steps") == run.steps() and "stopped_by" not in summary and "failed" not in summary


def stale(run_dir: Path, run: StudyRun) -> bool:
    """Whether the run in `run_dir` trained another recipe than `run`'s now: other config or overrides, or
    the same ones resolving to other settings (a named config changed, or a default), or no hash at all."""
    recipe, summary = run_dir / "study_run.json", run_dir / "summary.json"
    if not (recipe.is_file() and summary.is_file()) or json.loads(recipe.read_text()) != run.recipe():
        return True
    return json.loads(summary.read_text()).get("config_hash") != run.config_hash()


def train_process(command: list[str], log: Path) -> int:
    """One run as a process of its own (`meshrl train ...`), its output into `log`; its exit code. The
    run has a session of its own, so a Ctrl-C reaches the study alone, which passes it on once: the run
    stops as it does on its own Ctrl-C (between steps, its files written, no process left behind); a
    second one stops it at once."""
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, "-m", "meshrl", *command[1:]], stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            return child.wait()
        except KeyboardInterrupt:
            child.send_signal(signal.SIGINT)
            try:
                child.wait()
            except KeyboardInterrupt:
                child.send_signal(signal.SIGINT)
                child.wait()
            raise
        finally:  # whatever else ended the wait (a third Ctrl-C): the run is not left behind
            if child.poll() is None:
                child.terminate()
                child.wait()


class StudyFailed(RuntimeError):
    pass


def selected(study: Study, patterns: str | None) -> list[StudyRun]:
    """The study's runs whose names match one of `patterns` (shell patterns, comma separated: `lr_*_seed0,demo_*`),
    in the study's order; all of them for None. StudyFailed for a pattern that matches no run."""
    if patterns is None:
        return study.runs
    matches = {p.strip(): fnmatch.filter([run.name for run in study.runs], p.strip())
               for p in patterns.split(",") if p.strip()}
    if unmatched := [p for p, names in matches.items() if not names]:
        raise StudyFailed(f"no run of study {study.name} matches {', '.join(unmatched)}; its runs: "
                          f"{', '.join(run.name for run in study.runs)}")
    wanted = {name for names in matches.values() for name in names}
    return [run for run in study.runs if run.name in wanted]


def run_study(study: Study, directory: Path, train: Callable[[list[str], Path], int] = train_process,
              say: Callable[[str], None] = print, runs: list[StudyRun] | None = None) -> Path:
    """Every run of `study` (or of `runs`, a part of it) not finished yet, one after the other, then report.md
    from all the study's finished runs; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    runs = study.runs if runs is None else runs
    for i, run in enumerate(runs, 1):
        run_dir = directory / run.name
        if finished(run_dir, run):
            say(f"[{i}/{len(runs)}] {run.name}: finished before, kept")
            continue
        if run_dir.exists():  # stopped midway: it starts over
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        (run_dir / "study_run.json").write_text(json.dumps(run.recipe()))
        command = run.command(run_dir)
        say(f"[{i}/{len(runs)}] {run.name}: {' '.join(command)}")
        start = time.monotonic()
        code = train(command, run_dir / "train.log")
        if code != 0 or not finished(run_dir, run):
            raise StudyFailed(f"run {run.name} ended with exit code {code} before its last step; its output is in "
                              f"{run_dir / 'train.log'}; `meshrl study {study.name} --dir {directory}` goes on from it")
        # its checkpoints serve only a resume, which a finished run never needs: a SmolLM2 run's is 1.7 GB,
        # and thirty of them filled this machine's disk; its final policy (final/) stays
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        say(f"[{i}/{len(runs)}] {run.name}: done in {time.monotonic() - start:.0f} s")
    return write_report(study, directory)


def write_report(study: Study, directory: Path) -> Path:
    """report.md from the study's finished runs (all of them, after `run_study`; with `--report-only`,
    those finished so far, the others named as left out). StudyFailed if none has finished."""
    done = [run for run in study.runs if finished(directory / run.name, run)]
    if not done:
        raise StudyFailed(f"no run of study {study.name} has finished in {directory} yet: "
                          f"`meshrl study {study.name} --dir {directory}` runs them")
    body = study.report(directory, done)
    stale_runs = [run.name for run in study.runs if ended(directory / run.name, run) and run not in done]
    if stale_runs:
        body += (f"\n\nStale, left out of this report (they trained another recipe than the study's now): "
                 f"{', '.join(stale_runs)}.")
    if left_out := [run.name for run in study.runs if run not in done and run.name not in stale_runs]:
        body += f"\n\nNot finished yet, left out of this report: {', '.join(left_out)}."
    commands = "\n".join(" ".join(run.command(directory / run.name)) for run in study.runs)
    text = (f"# Study: {study.name}\n\n{study.question}\n\n{body}\n\n## How it was run\n\n"
            f"`meshrl study {study.name} --dir {directory}` ran, one after the other:\n\n```bash\n{commands}\n```\n\n"
            f"Machine: {machine()}. Report written {time.strftime('%Y-%m-%d %H:%M %Z')}.\n")
    path = directory / "report.md"
    path.write_text(text)
    return path


def machine() -> str:
    """The CPU model, its cores, memory, GPUs and the stack's versions."""
    import torch
    import vllm

    from meshrl.actors import cpu_name, has_bf16_math

    bf16 = ("with native bf16 (AVX512-BF16 or AMX)" if has_bf16_math(torch.device("cpu"))
            else "without native bf16 (fp32)")  # what each role chose is in its run's summary.json
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpus = f"{torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} cores of {cpu_name()} {bf16}, {memory:.0f} GiB, {gpus}; "
            f"Python {platform.python_version()}, torch {torch.__version__}, vLLM {vllm.__version__}")
