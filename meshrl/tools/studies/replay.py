"""`meshrl study replay`: does training groups again (replay_buffer.impl replay) pay on the demo
workload, against training each group once (fifo), for the same number of steps?

Four arms, three seeds each, all on the async demo config (`sum_digits_smollm2_async`: the demo's first
recipe, `sum_digits_smollm2_v1`, the one docs/studies.md's report of 2026-11-25 was measured with, with
generation on core 0 and training on core 1):
`fifo` at max_policy_age 1 (the config as it is); `replay` with max_reuse 2 and with max_reuse 4, each
at the max_policy_age its reuse needs (2 and 4: a group trained again n steps after it was generated is
n versions old), generation free to run as far ahead (`controller.generate_ahead` 2 and 4, what
replay did when the study ran); and replay with max_reuse 2 at max_policy_age 2 with generation kept
in step with training (`controller.generate_ahead 0`, replay's default since). A replay batch has prompts_per_step groups, half of them
fresh (fresh_fraction 0.5), so a replay arm generates half the completions per step of fifo's and
trains as many. The first two replay arms also let generation run further ahead (their bound is
wider), which uses up the bound's room for training a group again: the comparison is of the whole
recipe, and the report gives the share of episodes trained again.
"""

import statistics
from pathlib import Path

from meshrl.tools.studies import curve_plot, mean_spread, read_rows, read_summary, table
from meshrl.tools.study import Study, StudyRun, register

STEPS, SEEDS = 10, (0, 1, 2)
COMMON = ["--controller.steps", str(STEPS), "--controller.eval_every", "5", "--checkpoint.every", "0"]
ARMS = {"fifo": ["--controller.max_policy_age", "1"],
        "replay_reuse2": ["--replay_buffer.impl", "replay", "--replay_buffer.max_reuse", "2",
                          "--controller.max_policy_age", "2", "--controller.generate_ahead", "2"],
        "replay_reuse4": ["--replay_buffer.impl", "replay", "--replay_buffer.max_reuse", "4",
                          "--controller.max_policy_age", "4", "--controller.generate_ahead", "4"],
        "replay_reuse2_ahead0": ["--replay_buffer.impl", "replay", "--replay_buffer.max_reuse", "2",
                                 "--controller.max_policy_age", "2", "--controller.generate_ahead", "0"]}
COLOURS = {"fifo": "tab:blue", "replay_reuse2": "tab:orange", "replay_reuse4": "tab:green",
           "replay_reuse2_ahead0": "tab:red"}
RUNS = [StudyRun(f"{arm}_seed{seed}", "sum_digits_smollm2_async",
                 COMMON + extra + ["--generator.seed", str(seed), "--trainer.seed", str(seed)])
        for seed in SEEDS for arm, extra in ARMS.items()]


def arm_figures(run_dir: Path) -> dict:
    """A run's held-out accuracy (before, at the evals, after), generated tokens, reuse and wall time."""
    rows, summary = read_rows(run_dir), read_summary(run_dir)
    generated = sum(r["tokens_generated"] for r in rows)
    gain = summary["eval_accuracy_final"] - summary["eval_accuracy_initial"]
    tokens = 0
    evals = [(0, summary["eval_accuracy_initial"])]
    for r in rows:
        tokens += r["tokens_generated"]
        if "eval_accuracy" in r:
            evals.append((tokens, r["eval_accuracy"]))
    return {"eval_final": summary["eval_accuracy_final"], "last_number_final": summary["eval_last_number_final"],
            "gain": gain, "generated": generated, "trained": sum(r["episodes_trained"] for r in rows), "tokens_per_point": generated / (100 * gain) if gain > 0 else None,
            "reused": sum(r.get("episodes_reused", 0) for r in rows) / max(sum(r["episodes_trained"] for r in rows), 1),
            "staleness": statistics.fmean(r["staleness_mean"] for r in rows),
            "wall_s": summary["wall_time_s"], "train_s": sum(r["step_time_s"] for r in rows), "evals": evals}


def report(directory: Path, runs: list[StudyRun]) -> str:
    done = {run.name for run in runs}
    figures = {arm: [arm_figures(directory / f"{arm}_seed{seed}") for seed in SEEDS if f"{arm}_seed{seed}" in done]
               for arm in ARMS}
    figures = {arm: f for arm, f in figures.items() if f}
    rows = [[arm, mean_spread([f["eval_final"] for f in fs]), mean_spread([f["last_number_final"] for f in fs]),
             f"{statistics.fmean(f['generated'] for f in fs):.0f}", f"{statistics.fmean(f['trained'] for f in fs):.0f}",
             mean_spread([f["tokens_per_point"] for f in fs if f["tokens_per_point"] is not None]),
             f"{statistics.fmean(f['reused'] for f in fs):.2f}", f"{statistics.fmean(f['staleness'] for f in fs):.2f}",
             f"{statistics.fmean(f['train_s'] for f in fs):.0f}", f"{statistics.fmean(f['wall_s'] for f in fs):.0f}"]
            for arm, fs in figures.items()]
    colours = {f"{arm} #{i}": COLOURS[arm] for arm in ARMS for i in range(len(SEEDS))}
    curve_plot({f"{arm} #{i}": f["evals"] for arm, fs in figures.items() for i, f in enumerate(fs)},
               directory / "eval_vs_generated.png", "completion tokens generated", "held-out accuracy (greedy)",
               "held-out accuracy at steps 0, 5 and 10 against tokens generated, each seed a line", colours)
    return "\n".join([
        f"## {len(SEEDS)} seeds per arm, {STEPS} steps each\n",
        table(["arm", "held-out accuracy after the last step (greedy, 128 prompts)",
               "held-out last-number accuracy", "completion tokens generated", "episodes trained",
               "tokens generated per point of accuracy gained", "share of trained episodes reused", "staleness mean", "training time (s)",
               "wall time (s)"], rows),
        "\nA point of accuracy is 0.01 of held-out accuracy gained over the untrained model's (0 here); a run "
        "that gained nothing has no figure there. Training time: the steps' wall time; wall time adds the start and the evals.",
        "\n![held-out accuracy against tokens generated](eval_vs_generated.png)"])


register(Study("replay", "Does training groups again (replay, max_reuse 2 and 4; generation ahead or in step) "
               "pay against training each once (fifo) on the demo workload, for the same steps? Three seeds per arm.",
               RUNS, report))
