"""`meshrl study demo-heldout`: which of demo-settings' three best recipes should the demo train with,
chosen on the validation split, and what does the chosen one score on the test split?

demo-settings (meshrl/tools/studies/demo_settings.py) chose its settings on the very prompts it
reported, which overlapped training. Here its final recipe and its two runners-up (by mean at step 20)
train again on the task's disjoint splits (meshrl/tasks/splits.py), three seeds each: the eval during
training is validation's, the ranking uses it alone (mean tagged-answer accuracy at step 20, then the
worst seed), and only then is the chosen recipe's final policy scored on test (`meshrl eval --split
test`), with the untrained model's test figures beside it.
"""

import json
import statistics
from pathlib import Path

from meshrl.models.model import resolve_checkpoint
from meshrl.tools.studies import cell, curve_plot, mean_spread, table
from meshrl.tools.studies.demo_settings import ARMS, COMMON, SEEDS, run_figures
from meshrl.tools.study import Study, StudyFailed, StudyRun, register, train_process

CANDIDATES = ("demo_recipe+dynamic_sampling", "lr_5e-5+format_0", "lr_7e-5+format_0+decay+zero_truncated")
RUNS = [StudyRun(f"{arm}_seed{seed}", "sum_digits_smollm2_v1", COMMON + ARMS[arm] + ["--generator.seed", str(seed),
                                                                                 "--trainer.seed", str(seed)])
        for seed in SEEDS for arm in CANDIDATES]


def test_rates(run_dir: Path, policy: Path | None = None) -> dict:
    """`meshrl eval RUN_DIR --split test` (with `--policy`), run once and kept in its eval.json."""
    out = run_dir / ("eval-test" if policy is None else f"eval-test-{policy.name}")
    if not (out / "eval.json").is_file():
        command = ["meshrl", "eval", str(run_dir), "--split", "test", *(["--policy", str(policy)] if policy else [])]
        out.mkdir(parents=True, exist_ok=True)
        if train_process(command, run_dir / f"{out.name}.log") != 0:
            raise StudyFailed(f"{' '.join(command)} failed; its output is in {run_dir / f'{out.name}.log'}")
    return json.loads((out / "eval.json").read_text())["rates"]


def ranked(figures: dict[str, list[dict]]) -> list[str]:
    """The arms by validation alone: mean accuracy at the last step, then the worst seed."""
    return sorted(figures, key=lambda arm: (-statistics.fmean(f["final"] for f in figures[arm]),
                                            -min(f["final"] for f in figures[arm])))


def heldout_report(directory: Path, runs: list[StudyRun], candidates, rank_seeds, test_seeds, validation_text: str,
                   test_text: str, target: float | None = None) -> str:
    """Rank `candidates` by validation alone on their `rank_seeds` runs, then score the chosen one's `test_seeds`
    runs on test (each once, kept in its eval-test/), beside the untrained model; `target`: the worst seed's
    test accuracy the study asks for, said met or not."""
    done = {run.name for run in runs}
    figures = {arm: [run_figures(directory / f"{arm}_seed{s}") for s in rank_seeds if f"{arm}_seed{s}" in done]
               for arm in candidates}
    figures = {arm: fs for arm, fs in figures.items() if fs}
    order = ranked(figures)
    rows = [[rank, arm, len(figures[arm]), " / ".join(cell(f["final"]) for f in figures[arm]),
             mean_spread([f["final"] for f in figures[arm]]), cell(min(f["final"] for f in figures[arm])),
             mean_spread([f["last_number"] for f in figures[arm]]), f"{statistics.fmean(f['wall_s'] for f in figures[arm]):.0f}"]
            for rank, arm in enumerate(order, 1)]
    chosen = order[0]
    chosen_dirs = [directory / f"{chosen}_seed{s}" for s in test_seeds if f"{chosen}_seed{s}" in done]
    tests = [test_rates(d) for d in chosen_dirs]
    untrained = test_rates(chosen_dirs[0], resolve_checkpoint("smollm2"))
    keys = [k for k in tests[0] if k.startswith("eval_")]
    test_rows = [[f"seed {d.name.rsplit('seed', 1)[1]}", *(cell(t[k]) for k in keys)] for d, t in zip(chosen_dirs, tests)]
    test_rows += [["worst seed", *(cell(min(t[k] for t in tests)) for k in keys)],
                  ["mean ± sd", *(mean_spread([t[k] for t in tests]) for k in keys)],
                  ["untrained model", *(cell(untrained[k]) for k in keys)]]
    worst = min(t["eval_accuracy"] for t in tests)
    verdict = ("" if target is None else f"\n\nWorst seed's test accuracy {worst:.3f} over {len(tests)} seeds: the target "
               f"({target} on every seed) is {'met' if worst >= target and len(tests) == len(test_seeds) else 'not met'}.")
    curve_plot({f"{arm} #{i}": f["by_step"] for arm, fs in figures.items() for i, f in enumerate(fs)},
               directory / "validation_by_step.png", "step", "validation tagged-answer accuracy (greedy)",
               "the demo's candidates on validation, each seed a line",
               {f"{arm} #{i}": f"C{n}" for n, arm in enumerate(figures) for i in range(len(rank_seeds))})
    return "\n".join([
        f"## Chosen on validation ({len(rank_seeds)} seed{'s' if len(rank_seeds) > 1 else ''} each)\n",
        table(["rank", "recipe", "seeds", f"validation accuracy at the last step, per seed", "mean ± sd", "worst seed",
               "validation last-number accuracy", "wall time (s)"], rows),
        f"\nChosen: **{chosen}** (highest mean validation accuracy at the last step, then worst seed). Validation: "
        f"{validation_text}, greedy. The test split was not looked at to choose.",
        f"\n## The chosen recipe on the test split, {len(tests)} seeds\n",
        table(["policy", *(k.removeprefix("eval_") for k in keys)], test_rows),
        f"\nTest: {test_text}, greedy, scored once after the choice with `meshrl eval RUN_DIR --split test` on each "
        f"seed's final policy.{verdict}",
        "\n![validation accuracy by step](validation_by_step.png)"])


def report(directory: Path, runs: list[StudyRun]) -> str:
    return heldout_report(directory, runs, CANDIDATES, SEEDS, SEEDS,
                          "the sum_digits split's 72 prompts (numbers no training prompt has, in the four training "
                          "wordings), every 5 steps",
                          "the sum_digits split's 128 prompts (numbers neither training nor validation has, in all five "
                          "wordings, one of them never trained on)")


register(Study("demo-heldout", "Which of demo-settings' three best recipes does the demo train with, chosen on "
               f"validation, and what does it score on the test split? {len(SEEDS)} seeds each.", RUNS, report))
