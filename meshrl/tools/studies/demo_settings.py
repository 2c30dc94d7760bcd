"""`meshrl study demo-settings`: under which settings does the demo (SmolLM2-135M, sum_digits, 20 steps)
learn to tag its sums fastest without losing the arithmetic it already has?

One factor at a time from the demo's config when the study began (`sum_digits_smollm2_v1`): the
learning rate (1e-5 to 1e-4), the loss (DAPO) and its aggregation (per sequence), the reward paid for
the format alone (`sum_digits.format_weight` 0 and 0.5), and prompts per step against group size at
the same 64 samples a step; then the two changes that did best on their first seed, together, and
with a decaying learning rate, zero reward for replies cut off at the token limit, a little for the
format, and dynamic sampling (the arms after it, each tried because the one before fell short). Three
seeds each (the engine's and the trainer's; the prompts and the eval split are the same). The demo's
own eval: greedy, 128 held-out prompts, every 5 steps.
"""

import itertools
import statistics
from pathlib import Path

from meshrl.tools.studies import cell, curve_plot, mean_spread, read_rows, read_summary, table
from meshrl.tools.study import Study, StudyRun, register

STEPS, SEEDS, TARGET = 20, (0, 1, 2), 0.9
COMMON = ["--controller.steps", str(STEPS), "--controller.eval_every", "5", "--checkpoint.every", "0"]
# the parts of the arms after the single changes (the flags' order is part of a run's recipe: kept as run)
PEAK_7E5 = ["--trainer.lr", "7e-5"]
DECAY = ["--trainer.lr_schedule.decay", "linear", "--trainer.lr_schedule.decay_ratio", "0.5",
         "--trainer.lr_schedule.min_lr_factor", "0.1"]  # linear over the second half, down to 0.1 of the peak
ZERO_TRUNCATED = ["--grader.zero_truncated", "true"]
# the demo's recipe before dynamic sampling: an arm of its own, the 30-step budget's, and under dynamic sampling's
RECIPE = PEAK_7E5 + ["--sum_digits.format_weight", "0"] + DECAY + ZERO_TRUNCATED
ARMS = {"demo": [],
        "lr_1e-5": ["--trainer.lr", "1e-5"],
        "lr_5e-5": ["--trainer.lr", "5e-5"],
        "lr_1e-4": ["--trainer.lr", "1e-4"],
        "dapo": ["--trainer.loss.name", "dapo"],
        "seq_mean": ["--trainer.loss.aggregation", "seq_mean"],
        "format_0": ["--sum_digits.format_weight", "0"],
        "format_0.5": ["--sum_digits.format_weight", "0.5"],
        "16x4": ["--controller.prompts_per_step", "16", "--controller.group_size", "4"],
        "4x16": ["--controller.prompts_per_step", "4", "--controller.group_size", "16"],
        # the two single changes that did best on their first seed (2026-11-26), together
        "lr_5e-5+format_0": ["--trainer.lr", "5e-5", "--sum_digits.format_weight", "0"],
        # that pair peaked at step 15 or 20 and fell back: a higher lr for the first half, decaying over the second
        "lr_7e-5+format_0+decay": PEAK_7E5 + ["--sum_digits.format_weight", "0"] + DECAY,
        # and replies cut off at max_tokens score 0: it had learnt to babble on after its answer
        "lr_7e-5+format_0+decay+zero_truncated": RECIPE,
        # its seeds that found the format late (step 8-10, nothing paid until a right tagged sum) ended
        # below 0.9: a little for the format alone, so that every tagged reply is a signal from step 1
        "lr_7e-5+format_0.1+decay+zero_truncated": PEAK_7E5 + ["--sum_digits.format_weight", "0.1"] + DECAY
        + ZERO_TRUNCATED,
        # that paid for the format with the sums: back to format 0, and instead a step trains only groups
        # with a signal, more prompts sampled in their place (DAPO's dynamic sampling): the seeds that found
        # the format late had trained whole steps on 0 to 2 groups of 8
        "demo_recipe+dynamic_sampling": RECIPE + ["--controller.drop_equal_reward_groups", "true"]}
# The budget: the recipe before dynamic sampling (the arm before format_0.1) over more steps, its decay
# stretched with them
BUDGET_STEPS = 30
BUDGET = {f"demo_recipe_{BUDGET_STEPS}_steps": RECIPE + ["--controller.steps", str(BUDGET_STEPS)]}
RUNS = [StudyRun(f"{arm}_seed{seed}", "sum_digits_smollm2_v1", COMMON + extra + ["--generator.seed", str(seed),
                                                                            "--trainer.seed", str(seed)])
        for arms in (ARMS, BUDGET) for seed in SEEDS for arm, extra in arms.items()]  # every arm's first seed first


def run_figures(run_dir: Path) -> dict:
    """A run's held-out rates before and after, its eval curve against the step and against training
    time (the steps' wall time, evals left out), and the share of groups with a learning signal."""
    rows, summary = read_rows(run_dir), read_summary(run_dir)
    times = dict(zip((r["step"] for r in rows), itertools.accumulate(r["step_time_s"] for r in rows)))
    evals = [(0, summary["eval_accuracy_initial"])] + [(r["step"], r["eval_accuracy"]) for r in rows
                                                       if "eval_accuracy" in r]
    return {"final": summary["eval_accuracy_final"], "last_number": summary["eval_last_number_final"],
            "last_number_untrained": summary["eval_last_number_initial"],
            "copied": summary.get("eval_copied_final"), "truncated": summary.get("eval_truncated_final"),
            "signal": statistics.fmean(r["groups_with_signal"] for r in rows),
            "wall_s": summary["wall_time_s"], "by_step": evals,
            "by_time": [(times.get(step, 0.0), value) for step, value in evals]}


def keeps_arithmetic(f: dict) -> bool:
    return f["last_number"] >= f["last_number_untrained"]


def report(directory: Path, runs: list[StudyRun]) -> str:
    done = {run.name for run in runs}
    every = {arm: [run_figures(directory / f"{arm}_seed{seed}") for seed in SEEDS if f"{arm}_seed{seed}" in done]
             for arm in [*ARMS, *BUDGET]}
    every = {arm: fs for arm, fs in every.items() if fs}
    figures = {arm: fs for arm, fs in every.items() if arm in ARMS}
    rows = [[arm, len(fs), mean_spread([f["final"] for f in fs]), cell(min(f["final"] for f in fs)),
             mean_spread([f["last_number"] for f in fs]), mean_spread([f["last_number_untrained"] for f in fs]),
             f"{sum(keeps_arithmetic(f) for f in fs)} of {len(fs)}", mean_spread([f["copied"] for f in fs]),
             mean_spread([f["truncated"] for f in fs]),
             f"{statistics.fmean(f['signal'] for f in fs):.2f}", f"{statistics.fmean(f['wall_s'] for f in fs):.0f}"]
            for arm, fs in figures.items()]
    kept = {arm: fs for arm, fs in figures.items() if all(keeps_arithmetic(f) for f in fs)}
    best = max(kept, key=lambda arm: min(f["final"] for f in kept[arm])) if kept else None
    verdict = ("No setting kept the untrained model's last-number accuracy on every seed." if best is None else
               f"Best setting that kept the arithmetic on every seed, by its worst seed: **{best}** (worst seed "
               f"{min(f['final'] for f in kept[best]):.3f}; target {TARGET} on every seed: "
               f"{'met' if min(f['final'] for f in kept[best]) >= TARGET else 'not met'}).")
    colours = dict(zip([*ARMS, *BUDGET], [f"C{i}" for i in range(10)]  # matplotlib's cycle has ten
                       + ["black", "magenta", "lime", "navy", "darkviolet", "saddlebrown"]))
    line_colours = {f"{arm} #{i}": colours[arm] for arm in colours for i in range(len(SEEDS))}
    for key, path, xlabel in (("by_step", "eval_by_step.png", "step"),
                              ("by_time", "eval_by_time.png", "training time (s): the steps' wall time")):
        curve_plot({f"{arm} #{i}": f[key] for arm, fs in every.items() for i, f in enumerate(fs)},
                   directory / path, xlabel, "held-out tagged-answer accuracy (greedy)",
                   "the demo's held-out accuracy, each seed a line", line_colours)
    return "\n".join([
        f"## One setting changed at a time from the demo's, {STEPS} steps, {len(SEEDS)} seeds each\n",
        table(["setting", "seeds", f"tagged-answer accuracy at step {STEPS}", "worst seed",
               "last-number accuracy", "untrained last-number", "seeds keeping the arithmetic",
               "tagged a number of the question (copied)", "cut off at max_tokens (truncated; n/a: not yet measured)",
               "groups with a signal (mean over steps)",
               "wall time (s)"], rows),
        f"\n{verdict}",
        "\nHeld-out: the demo's 128 prompts, greedy. A seed keeps the arithmetic when its last-number accuracy "
        "after the last step is not below its untrained model's. Settings: the demo's when the study began "
        "(`demo`: `sum_digits_smollm2_v1`, lr 2e-5, ppo_clip averaged per token, format_weight 0.2, 8 prompts x 8 "
        "samples), each other row changes one; "
        "`lr_5e-5+format_0` makes the two changes that did best on their first seed together; "
        "`lr_7e-5+format_0+decay` starts higher and decays linearly over the second half of the run to 0.1 of "
        "its peak (`trainer.lr_schedule`); `+zero_truncated` scores a reply cut off at max_tokens 0 "
        "(`grader.zero_truncated`); `format_0.1` pays 0.1 for a tagged number of any value; "
        "`demo_recipe+dynamic_sampling` (the demo's config since 2026-11-26) is `lr_7e-5+format_0+decay+zero_truncated` "
        "training only groups with a signal, up to 4 blocks of 8 prompts sampled a step to fill its 8 "
        "(`controller.drop_equal_reward_groups`).",
        *budget_section({arm: fs for arm, fs in every.items() if arm in BUDGET}),
        "\n![held-out accuracy by step](eval_by_step.png)\n", "![held-out accuracy by training time](eval_by_time.png)"])


def budget_section(figures: dict) -> list[str]:
    """Each seed of the longer runs: its accuracy every 5 steps, where it first reached the target, and
    whether it was still there at the end."""
    if not figures:
        return []
    rows = []
    for arm, fs in figures.items():
        for i, f in enumerate(fs):
            reached = next((step for step, value in f["by_step"] if value >= TARGET), None)
            rows.append([arm, i, " / ".join(cell(v) for step, v in f["by_step"] if step % 5 == 0 and step >= 10),
                         reached if reached is not None else "never", f"{f['last_number']:.3f}",
                         f"{f['last_number_untrained']:.3f}", f"{f['wall_s']:.0f}"])
    return [f"\n## The budget: the same recipe over {BUDGET_STEPS} steps\n",
            table(["run", "seed", f"tagged-answer accuracy at steps 10 / 15 / ... / {BUDGET_STEPS}",
                   f"first step at {TARGET} or above", "last-number accuracy at the end", "untrained last-number",
                   "wall time (s)"], rows),
            f"\n`demo_recipe_{BUDGET_STEPS}_steps`: `lr_7e-5+format_0+decay+zero_truncated` with "
            f"`--controller.steps {BUDGET_STEPS}` (its decay spans the second half of the {BUDGET_STEPS} steps)."]


register(Study("demo-settings", "Which settings (learning rate, loss and aggregation, format reward, prompts x "
               f"group size) teach the demo's format and sums fastest without losing arithmetic? {len(SEEDS)} seeds "
               "each.", RUNS, report))
