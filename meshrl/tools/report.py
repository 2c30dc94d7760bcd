"""`meshrl report RUN_DIR [RUN_DIR ...]`: what runs did, side by side, from the files they wrote.

Reads metrics.jsonl (and summary.json, trace.jsonl where present), prints one column per run, and
draws the run's curves.png and timeline.png again from those files. Below, what each run settled at its start
(resolved.json against config.json: each `auto` and each value derived from others) and what final/ holds.
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


def settled(run_dir: Path) -> dict[str, str]:
    """The settings a run's resolved.json holds other than its config.json asked: {dotted name: "asked -> ran"}."""
    from meshrl.configs import _flat

    paths = Path(run_dir) / "config.json", Path(run_dir) / "resolved.json"
    if not all(p.is_file() for p in paths):  # a run from before resolved.json was written
        return {}
    asked, ran = (_flat(json.loads(p.read_text())) for p in paths)
    return {k: f"{asked.get(k)} -> {v}" for k, v in ran.items() if asked.get(k) != v}


def text_table(columns: dict[str, dict[str, str]]) -> str:
    """One row per key, one column per run, of text (a blank where a run lacks it)."""
    keys = list(dict.fromkeys(k for c in columns.values() for k in c))
    width = max(12, *(len(v) for c in columns.values() for v in c.values()), *(len(n) for n in columns))
    lines = [f"{'':34s}" + "".join(f"{n:>{width + 2}s}" for n in columns)]
    lines += [f"{k:34s}" + "".join(f"{columns[n].get(k, ''):>{width + 2}s}" for n in columns) for k in keys]
    return "\n".join(lines)


def report(run_dirs: list[Path]) -> str:
    """The side-by-side table of `run_dirs`, then what each settled and what its final/ holds; redraws each
    run's plots from its files."""
    figures, notes = {}, {}
    for run_dir in run_dirs:
        rows, summary = read_rows(run_dir), read_summary(run_dir)
        name = Path(run_dir).name if Path(run_dir).name not in figures else str(run_dir)
        figures[name] = summarize(rows, summary)
        final = summary.get("final_policy")
        notes[name] = {**settled(run_dir), **({"final/ holds": f"version {final['version']} from {final['source']}"}
                                              if final else {})}
        initial = {k.removesuffix("_initial"): v for k, v in summary.items() if k.endswith("_initial")}
        plot_curves(rows, initial, Path(run_dir) / "curves.png")
        if (Path(run_dir) / "trace.jsonl").is_file():
            plot_timeline(read_spans(Path(run_dir)), Path(run_dir) / "timeline.png", title=name)
    if not any(notes.values()):
        return table(figures)
    return table(figures) + "\n\nsettled at the start (resolved.json), and final/:\n" + text_table(notes)
