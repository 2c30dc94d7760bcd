"""`meshrl report RUN_DIR [RUN_DIR ...]`: what runs did, side by side, from the files they wrote.

Reads metrics.jsonl (and summary.json, trace.jsonl where present), prints one column per run, and
draws the run's curves.png and timeline.png again from those files.
"""

import json
import statistics
from pathlib import Path

from meshrl.actors.trace import plot_timeline, read_spans
from meshrl.runtime.plot import plot_curves


def read_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} is not a run directory: it has no metrics.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no steps yet")
    return rows


def read_summary(run_dir: Path) -> dict:
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


RESTARTS = ("generator_restarts", "grader_restarts", "trainer_restarts", "reference_restarts", "replay_buffer_restarts",
            "restart_seconds")


def summarize(rows: list[dict], summary: dict) -> dict:
    """A run's headline figures: throughput over the steps' wall time (the tokens the loss was taken over,
    every token of the sequences trained on, the tokens generated), first and last reward, the eval rates
    before and after (from summary.json), staleness, the loop's wait for the trainer's publish and the
    slowest generator load, and the processes restarted per role (the run's totals, where its rows count
    them). A run from before `tokens_processed` and `publish_wait_s` were recorded has no
    `trained_tokens_per_s` (its `tokens_trained` counted every token: `processed_tokens_per_s`) and no
    weight figures (its `weight_sync_s` added the two together)."""
    wall = sum(r["step_time_s"] for r in rows)
    old = "tokens_processed" not in rows[0]
    weights = {} if "publish_wait_s" not in rows[0] else {
        "publish_wait_s": statistics.fmean(r["publish_wait_s"] for r in rows),
        "longest_load_s": statistics.fmean(r["longest_load_s"] for r in rows)}
    return {
        "steps": len(rows),
        "wall_time_s": wall,
        **({} if old else {"trained_tokens_per_s": sum(r["tokens_trained"] for r in rows) / wall}),
        "processed_tokens_per_s": sum(r["tokens_trained" if old else "tokens_processed"] for r in rows) / wall,
        "generated_tokens_per_s": sum(r["tokens_generated"] for r in rows) / wall,
        "reward_first": rows[0]["reward_mean"],
        "reward_last": rows[-1]["reward_mean"],
        **{k: v for k, v in summary.items() if k.startswith("eval_")},
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in rows),
        "staleness_max": max(r["staleness_max"] for r in rows),
        **weights,
        **{k: rows[-1][k] for k in RESTARTS if k in rows[-1]},
    }


def table(figures: dict[str, dict]) -> str:
    """One row per figure, one column per run (a blank where a run lacks the figure)."""
    names = list(figures)
    keys = list(dict.fromkeys(k for f in figures.values() for k in f))
    width = max(12, *(len(n) for n in names))
    lines = [f"{'':26s}" + "".join(f"{n:>{width + 2}s}" for n in names)]
    for key in keys:
        cells = []
        for name in names:
            value = figures[name].get(key)
            text = "" if value is None else f"{value:d}" if isinstance(value, int) else f"{value:.3f}"
            cells.append(f"{text:>{width + 2}s}")
        lines.append(f"{key:26s}" + "".join(cells))
    return "\n".join(lines)


def report(run_dirs: list[Path]) -> str:
    """The side-by-side table of `run_dirs`; redraws each run's plots from its files."""
    figures = {}
    for run_dir in run_dirs:
        rows, summary = read_rows(run_dir), read_summary(run_dir)
        name = Path(run_dir).name if Path(run_dir).name not in figures else str(run_dir)
        figures[name] = summarize(rows, summary)
        initial = {k.removesuffix("_initial"): v for k, v in summary.items() if k.endswith("_initial")}
        plot_curves(rows, initial, Path(run_dir) / "curves.png")
        if (Path(run_dir) / "trace.jsonl").is_file():
            plot_timeline(read_spans(Path(run_dir)), Path(run_dir) / "timeline.png", title=name)
    return table(figures)
