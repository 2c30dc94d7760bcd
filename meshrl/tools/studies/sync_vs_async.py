"""`meshrl study sync-vs-async`: does async training reach the accuracy sync training reaches, and how
much sooner, on the demo workload, with seeds?

Three arms, three seeds each (the engine's and the trainer's seed; the prompts are the same): sync,
the demo's first recipe as it is (`sum_digits_smollm2_v1`: each phase uses both cores in turn), and
async at `max_policy_age` 1 and 2, the registered async config (`sum_digits_smollm2_async`, v1's
recipe with generation on core 0, training on core 1, overlapping; weights loaded in flight). Each arm
in the placement a user would pick for it on this machine. v1 is the recipe of the report in
docs/studies.md (2026-11-24), so a run of the study reproduces it; the demo's later recipes
(`sum_digits_smollm2_v2` to `_v4`) were never run here.
"""

import itertools
import json
import math
import statistics
from pathlib import Path

from meshrl.tools.report import summarize
from meshrl.tools.studies import cell, curve_plot, mean_spread, read_rows, read_summary, table, time_to_reach
from meshrl.tools.study import Study, StudyRun, register

STEPS, SEEDS = 10, (0, 1, 2)
COMMON = ["--controller.steps", str(STEPS), "--controller.eval_every", "5", "--checkpoint.every", "0"]
ARMS = {"sync": ("sum_digits_smollm2_v1", []),
        "async_age1": ("sum_digits_smollm2_async", ["--controller.max_policy_age", "1"]),
        "async_age2": ("sum_digits_smollm2_async", ["--controller.max_policy_age", "2"])}
COLOURS = {"sync": "tab:blue", "async_age1": "tab:orange", "async_age2": "tab:green"}
THRESHOLDS = (0.05, 0.1, 0.25, 0.5, 0.7)
RUNS = [StudyRun(f"{arm}_seed{seed}", config, COMMON + extra + ["--generator.seed", str(seed), "--trainer.seed",
                                                                  str(seed)])
        for seed in SEEDS for arm, (config, extra) in ARMS.items()]


def arm_figures(run_dir: Path) -> dict:
    """A run's figures for the report: `meshrl report`'s (summarize), the step's split (medians), the
    train accuracy against training time, and the held-out accuracy at the steps that evaluated."""
    rows, summary = read_rows(run_dir), read_summary(run_dir)
    figures = summarize(rows, summary)
    wall = figures["wall_time_s"]
    times = list(itertools.accumulate(r["step_time_s"] for r in rows))
    accuracy = [r["accuracy"] for r in rows]
    evals = [(0.0, summary.get("eval_accuracy_initial"))] + [(t, r["eval_accuracy"]) for t, r in zip(times, rows)
                                                             if "eval_accuracy" in r]
    return {"eval_final": summary.get("eval_accuracy_final"), "format_final": summary.get("eval_format_final"),
            "train_acc_last3": statistics.fmean(accuracy[-3:]), "wall_s": wall,
            # a run from before the split of tokens_trained and weight_sync_s (2026-11-27) has neither figure: n/a
            "trained_tps": figures.get("trained_tokens_per_s", math.nan), "generated_tps": figures["generated_tokens_per_s"],
            "step_s": statistics.median(r["step_time_s"] for r in rows),
            "wait_s": statistics.median(r["wait_time_s"] for r in rows),
            "train_s": statistics.median(r["train_time_s"] for r in rows),
            "publish_wait_s": statistics.median(r.get("publish_wait_s", math.nan) for r in rows),
            "longest_load_s": statistics.median(r.get("longest_load_s", math.nan) for r in rows),
            "generator_idle": sum(r["generator_idle"] * r["step_time_s"] for r in rows) / wall,
            "staleness": figures["staleness_mean"],
            "reach": {th: time_to_reach(times, accuracy, th) for th in THRESHOLDS},
            "curve": list(zip(times, accuracy)), "evals": evals}


def report(directory: Path, runs: list[StudyRun]) -> str:
    done = {run.name for run in runs}
    figures = {arm: [arm_figures(directory / f"{arm}_seed{seed}") for seed in SEEDS if f"{arm}_seed{seed}" in done]
               for arm in ARMS}
    figures = {arm: runs_ for arm, runs_ in figures.items() if runs_}  # an arm with no finished run yet: left out
    rows = []
    for arm, runs_ in figures.items():
        reach = []
        for th in THRESHOLDS:
            times = [f["reach"][th] for f in runs_ if f["reach"][th] is not None]
            reach.append(f"{statistics.fmean(times):.0f} s ({len(times)}/{len(runs_)})" if times
                         else f"not reached (0/{len(runs_)})")
        rows.append([arm, mean_spread([f["eval_final"] for f in runs_]), mean_spread([f["format_final"] for f in runs_]),
                     mean_spread([f["train_acc_last3"] for f in runs_]), *reach])
    parts = [f"## Accuracy: {len(SEEDS)} seeds per arm, {STEPS} steps each\n",
             table(["arm", "held-out accuracy after the last step (greedy, 128 prompts)", "held-out format",
                    "train accuracy, last 3 steps", *(f"time to train accuracy {th}" for th in THRESHOLDS)], rows),
             "\nTime to a threshold: training time (the steps' wall time, not start-up or eval) until the mean "
             "train-sample accuracy of 3 steps in a row reaches it, averaged over the seeds that reached it.\n"]
    rows = []
    for arm, runs_ in figures.items():
        rows.append([arm] + [cell(statistics.fmean(f[k] for f in runs_), fmt) for k, fmt in (
            ("wall_s", ".0f"), ("step_s", ".1f"), ("wait_s", ".1f"), ("train_s", ".1f"),
            ("publish_wait_s", ".2f"), ("longest_load_s", ".2f"),
            ("trained_tps", ".0f"), ("generated_tps", ".0f"), ("generator_idle", ".2f"), ("staleness", ".2f"))])
    parts += ["## Throughput and the step's time (means over seeds; per step: medians)\n",
              table(["arm", "training wall time (s)", "step (s)", "waiting for the batch (s)", "training (s)",
                     "waiting for the publish (s)", "slowest weight load (s)", "trained (loss) tokens/s",
                     "generated tokens/s", "generator idle", "staleness mean"],
                    rows),
              _against_sync(figures)]
    colours = {f"{arm} #{i}": COLOURS[arm] for arm in ARMS for i in range(len(SEEDS))}
    curve_plot({f"{arm} #{i}": f["curve"] for arm, runs_ in figures.items() for i, f in enumerate(runs_)},
               directory / "accuracy_vs_time.png", "training wall time (s)", "train-sample accuracy",
               "accuracy against time, each seed a line", colours)
    curve_plot({f"{arm} #{i}": f["evals"] for arm, runs_ in figures.items() for i, f in enumerate(runs_)},
               directory / "eval_vs_time.png", "training wall time (s)", "held-out accuracy (greedy)",
               "held-out accuracy at steps 0, 5 and 10, each seed a line", colours)
    parts += ["\n![train accuracy against time](accuracy_vs_time.png)\n", "![held-out accuracy against time]"
              "(eval_vs_time.png)", _prediction()]
    return "\n".join(parts)


def _against_sync(figures: dict[str, list[dict]]) -> str:
    if "sync" not in figures:
        return ""
    sync_tps = statistics.fmean(f["trained_tps"] for f in figures["sync"])
    return "\nTrained (loss) tokens per second against sync: " + ", ".join(
        f"{arm} {cell(statistics.fmean(f['trained_tps'] for f in runs_) / sync_tps, '.2f')} x"
        for arm, runs_ in figures.items() if arm != "sync")


def _prediction() -> str:
    """The controller bench's cost-model prediction for a GPU placement, where one was written."""
    path = Path(__file__).resolve().parents[3] / "docs" / "bench_controller_gpu_placement.json"
    if not path.is_file():
        return ""
    p = json.loads(path.read_text())["placement"]
    c = p["costs"]
    return (f"\n## What a GPU placement would do (a prediction, not a measurement)\n\n`meshrl bench controller`'s cost "
            f"model (docs/bench_controller_gpu_placement.json), for {p['replicas']} generator GPUs and {p['ranks']} "
            f"trainer GPU, {p['prompts']} prompts a step, with assumed costs ({c['generate_per_token'] * 1000:g} ms per "
            f"decode step, {c['train_per_token'] * 1e6:g} us per trained token, {c['publish']:g} s per publish and "
            f"per pull): a step of {p['sync_step_s']:.1f} s sync, {p['async_drain_step_s']:.1f} s async draining and "
            f"{p['async_step_s']:.1f} s async loading in flight ({p['async_speedup']:.2f} x sync).")


register(Study("sync-vs-async", "Does async training (max_policy_age 1 and 2) reach sync's accuracy on the demo "
               "workload, and how much sooner? Three seeds per arm.", RUNS, report))
