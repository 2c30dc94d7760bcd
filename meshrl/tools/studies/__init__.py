"""The named studies of `meshrl study` (meshrl/tools/study.py), each a module that registers itself, and what
their reports share: a run's rows and summary, means with their spread, tables and line plots."""

import importlib
import json
import math
import statistics
from pathlib import Path

from meshrl.tools.report import read_rows, read_summary
from meshrl.tools.study import STUDIES

__all__ = ["STUDIES", "cell", "curve_plot", "mean_spread", "read_rows", "read_summary", "table", "time_to_reach"]


def mean_spread(values: list[float]) -> str:
    """"m ± sd (min-max, n)" of the values that are numbers."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.3f} (one run)"
    return (f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f} "
            f"({min(values):.3f}-{max(values):.3f}, n={len(values)})")


def cell(value, fmt: str = ".3f") -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def time_to_reach(times: list[float], values: list[float], threshold: float, window: int = 3) -> float | None:
    """The first time the mean of the last `window` values is at least `threshold`; None if never."""
    for i in range(len(values)):
        if i + 1 >= window and statistics.fmean(values[i + 1 - window:i + 1]) >= threshold:
            return times[i]
    return None


def curve_plot(curves: dict[str, list[tuple[float, float]]], path: Path, xlabel: str, ylabel: str, title: str,
               colours: dict[str, str] | None = None) -> None:
    """One line per label (labels sharing a colour are seeds of one arm, drawn alike, in the legend once
    under the label's part before " #")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = set()
    for label, points in curves.items():
        colour = (colours or {}).get(label)
        shown = label.split(" #")[0] if colour is None or colour not in drawn else None
        drawn.add(colour)
        if points:
            ax.plot(*zip(*points), "o-", ms=3, color=colour, label=shown, alpha=0.85)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


for _name in ("weight_sync_equivalence", "sync_vs_async", "difficulty", "replay", "curriculum", "demo_settings", "demo_heldout", "demo_recipe",
              "calculator", "unified_model"):
    importlib.import_module(f"meshrl.tools.studies.{_name}")
