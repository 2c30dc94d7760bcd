"""`meshrl study difficulty`: how does difficulty change learning, and does a curriculum give the
harder level a learning signal that training on it alone does not have?

Zorplex level 1 (one word's value, looked up with the tool) and level 2 (the sum of two words'),
and level 2 under a curriculum (`zorplex.curriculum`: level-1 prompts first, level 2 mixed in over
the middle of the run, all level 2 at the end); sum_digits with two and with three terms, on the
demo's first recipe (`sum_digits_smollm2_v1`, that of docs/studies.md's report of 2026-11-24; the
Zorplex runs' config is built on it too). The same budget for each. The curriculum run is evaluated
on level 2, as the level-2 run is.
"""

import json
import statistics
from pathlib import Path

from meshrl.configs import from_dict
from meshrl.tasks.zorplex import Zorplex, ZorplexConfig
from meshrl.tools.studies import cell, curve_plot, read_json_lines, read_rows, read_summary, table
from meshrl.tools.study import Study, StudyRun, register

STEPS = 10
CURRICULUM = "16-47"  # steps 1-2 level 1; level 2's share rising over steps 3-6; steps 7-10 level 2 only
COMMON = ["--controller.steps", str(STEPS), "--controller.eval_every", "5", "--checkpoint.every", "0"]
RUNS = [StudyRun("zorplex_level1", "zorplex_smollm2", COMMON),
        StudyRun("zorplex_level2", "zorplex_smollm2", COMMON + ["--zorplex.level", "2"]),
        StudyRun("zorplex_curriculum", "zorplex_smollm2", COMMON + ["--zorplex.level", "2", "--zorplex.curriculum",
                                                                    CURRICULUM]),
        StudyRun("sum_digits_2terms", "sum_digits_smollm2_v1", COMMON),
        StudyRun("sum_digits_3terms", "sum_digits_smollm2_v1", COMMON + ["--sum_digits.num_terms", "3"])]


def level2_records(run_dir: Path, steps: range | None = None) -> tuple[Zorplex, list[dict]]:
    """The run's task (by its own config) and its level-2 conversations trained (at `steps`, else at any)."""
    task = Zorplex(from_dict(ZorplexConfig, json.loads((run_dir / "config.json").read_text())["zorplex"]))
    return task, [r for r in read_json_lines(run_dir / "rollouts.jsonl")
                  if (steps is None or r["step"] in steps) and task.train_level(r["prompt_index"]) == 2]


def level2_steps(run_dir: Path) -> dict[int, tuple[float, float, float]]:
    """Per step, over the level-2 prompts only (of a zorplex run at level 2): the train accuracy, the
    share of their groups whose rewards were not all equal (a learning signal), and the share of
    conversations that looked up both words. Which prompts were level 2: the run's own task config."""
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in level2_records(run_dir)[1]:
        groups.setdefault((r["step"], r["prompt_index"]), []).append(r)
    out = {}
    for step in sorted({step for step, _ in groups}):
        mine = [g for (s, _), g in groups.items() if s == step]
        accuracy = statistics.fmean(r["reward_components"]["correct"] for g in mine for r in g)
        looked_up = statistics.fmean(r["reward_components"]["tool_call"] for g in mine for r in g)
        out[step] = (accuracy, statistics.fmean(len({r["reward"] for r in g}) > 1 for g in mine), looked_up)
    return out


def report(directory: Path, runs: list[StudyRun]) -> str:
    rows, evals, train = [], {}, {}
    for run in runs:
        run_dir = directory / run.name
        steps, summary = read_rows(run_dir), read_summary(run_dir)
        prompts = json.loads((run_dir / "config.json").read_text())["controller"]["prompts_per_step"]
        signal = [1 - r["equal_reward_groups"] / prompts for r in steps]
        rows.append([run.name, cell(summary.get("eval_accuracy_initial")), cell(summary.get("eval_accuracy_final")),
                     cell(statistics.fmean(r["accuracy"] for r in steps[:3])),
                     cell(statistics.fmean(r["accuracy"] for r in steps[-3:])),
                     cell(statistics.fmean(signal[:3]), ".2f"), cell(statistics.fmean(signal[-3:]), ".2f")])
        evals[run.name] = [(0, summary.get("eval_accuracy_initial"))] + [(r["step"], r["eval_accuracy"]) for r in steps
                                                                          if "eval_accuracy" in r]
        if run.name.startswith("zorplex"):
            train[f"{run.name}: all prompts"] = [(r["step"], r["accuracy"]) for r in steps]
    parts = [f"## Learning at each difficulty, {STEPS} steps each\n",
             table(["run", "held-out accuracy untrained", f"after {STEPS} steps", "train accuracy, steps 1-3",
                    f"steps {STEPS - 2}-{STEPS}", "groups with a signal, steps 1-3", f"steps {STEPS - 2}-{STEPS}"], rows),
             "\nHeld-out accuracy: zorplex the mean of 4 sampled answers (temperature 1) per prompt over 64 "
             "prompts at the run's level (level 2 for the curriculum); sum_digits greedy over 128 prompts. A group "
             "has a signal when its completions' rewards are not all equal (GRPO learns nothing from the others)."]
    level2 = {}
    for name in ("zorplex_level2", "zorplex_curriculum"):
        if name in {run.name for run in runs}:
            level2[name] = level2_steps(directory / name)
            train[f"{name}: level-2 prompts"] = [(step, acc) for step, (acc, _, _) in level2[name].items()]
    if len(level2) == 2:
        alone, mixed = level2["zorplex_level2"], level2["zorplex_curriculum"]
        rows = [[step, *(cell(run[step][k], ".3f" if k == 0 else ".2f") if step in run else "n/a"
                         for run in (alone, mixed) for k in (0, 1, 2))] for step in range(1, STEPS + 1)]
        parts += ["\n## Level 2 alone against the curriculum, on level-2 prompts only\n",
                  table(["step", "level 2 alone: train accuracy", "groups with a signal", "looked up both words",
                         f"curriculum {CURRICULUM}: train accuracy", "groups with a signal", "looked up both words"],
                        rows),
                  "\nn/a: the curriculum had no level-2 prompt that step."]
    curve_plot(evals, directory / "eval_curves.png", "step", "held-out accuracy", "held-out accuracy per difficulty")
    curve_plot(train, directory / "zorplex_train_accuracy.png", "step", "train accuracy",
               "zorplex: train accuracy, and on level-2 prompts alone")
    parts += ["\n![held-out accuracy per difficulty](eval_curves.png)\n",
              "![zorplex train accuracy](zorplex_train_accuracy.png)"]
    return "\n".join(parts)


register(Study("difficulty", "How does difficulty (zorplex level 1 vs 2, sums of 2 vs 3 terms) change learning, "
               "and does a level-1-first curriculum give level 2 a learning signal it lacks alone?", RUNS, report))
