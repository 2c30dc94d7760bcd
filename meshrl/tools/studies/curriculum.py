"""`meshrl study curriculum`: does Zorplex level 2 (the sum of two looked-up values) get learnt through a
curriculum from level 1, where training on level 2 alone finds no signal?

The difficulty study's 10 steps left the question open: its curriculum created groups with a signal on
level 2 and conversations that looked up both words, but no right level-2 answer within three turns.
Here both arms have four turns (two lookups, an answer and one to spare) and three times the budget:
level 2 alone, and the curriculum (steps 1-3 level 1, level 2's share rising over steps 4-12, level 2 only
from step 13), two seeds each (the generator's and the trainer's; the prompts and the eval split are
the same). Both are evaluated on the same held-out level-2 split.
"""

import statistics
from collections import Counter
from pathlib import Path

from meshrl.tasks.zorplex import ANSWER
from meshrl.tools.studies import cell, curve_plot, mean_spread, read_rows, read_summary, table
from meshrl.tools.studies.difficulty import level2_records, level2_steps
from meshrl.tools.study import Study, StudyRun, register

STEPS, EVAL_EVERY, SEEDS = 30, 10, (0, 1)
CURRICULUM = "24-95"  # 8 prompts a step: steps 1-3 level 1, level 2's share rising over steps 4-12, then level 2 only
EVAL_SIZE = 32  # held-out level-2 prompts, 4 answers each: half the config's, the evals being a third of a run's time
COMMON = ["--controller.steps", str(STEPS), "--controller.eval_every", str(EVAL_EVERY), "--checkpoint.every", "0",
          "--controller.max_turns", "4", "--zorplex.level", "2", "--zorplex.eval_size", str(EVAL_SIZE),
          "--trainer.micro_batch_size", "8"]  # four-turn conversations: 16 a pass took 7.8 GB of the trainer's memory
ARMS = {"curriculum": ["--zorplex.curriculum", CURRICULUM], "level2_alone": []}
COLOURS = {"curriculum": "tab:orange", "level2_alone": "tab:blue"}
RUNS = [StudyRun(f"{arm}_seed{seed}", "zorplex_smollm2",
                 COMMON + extra + ["--generator.seed", str(seed), "--trainer.seed", str(seed)])
        for seed in SEEDS for arm, extra in ARMS.items()]


def evals(run_dir: Path, check: str = "accuracy") -> list[tuple[int, float]]:
    """(step, held-out rate of `check`) from before the first step to after the last."""
    summary = read_summary(run_dir)
    return [(0, summary[f"eval_{check}_initial"])] + [(r["step"], r[f"eval_{check}"]) for r in read_rows(run_dir)
                                                        if f"eval_{check}" in r]


def answers(run_dir: Path, steps: range) -> Counter:
    """Level-2 conversations trained at `steps` by their last tagged answer: right, one of the two looked-up
    values, another number, or none."""
    task, mine = level2_records(run_dir, steps)
    kinds = Counter()
    for r in mine:
        tagged = ANSWER.findall(r["completion"])
        values = task.train_sample(r["prompt_index"]).info["values"].values()
        kinds["none" if not tagged else "right" if r["reward_components"]["correct"] == 1.0
              else "a value" if int(tagged[-1]) in values else "another number"] += 1
    return kinds


def example(run_dir: Path, step: int) -> str:
    """One level-2 conversation trained at `step`: the first right one, else the first."""
    _, mine = level2_records(run_dir, range(step, step + 1))
    if not mine:
        return "(no level-2 conversation at this step)"
    chosen = next((r for r in mine if r["reward_components"]["correct"] == 1.0), mine[0])
    verdict = "right" if chosen["reward_components"]["correct"] == 1.0 else "not right"
    return f"{chosen['prompt']}\n{chosen['completion'].strip()}\n-> reward {chosen['reward']:.2f} ({verdict})"


def report(directory: Path, runs: list[StudyRun]) -> str:
    done = {run.name for run in runs}
    arms = {arm: [f"{arm}_seed{seed}" for seed in SEEDS if f"{arm}_seed{seed}" in done] for arm in ARMS}
    arms = {arm: names for arm, names in arms.items() if names}
    curves, both, train, rows, kinds = {}, {}, {}, [], []
    last = range(STEPS - 4, STEPS + 1)
    for arm, names in arms.items():
        finals, looked, tagged, last_train, pooled = [], [], [], [], Counter()
        for i, name in enumerate(names):
            run_dir = directory / name
            curves[f"{arm} #{i}"] = evals(run_dir)
            finals.append(curves[f"{arm} #{i}"][-1][1])
            looked.append(read_summary(run_dir)["eval_tool_call_final"])
            tagged.append(read_summary(run_dir)["eval_tagged_final"])
            pooled += answers(run_dir, last)
            steps = level2_steps(run_dir)
            both[f"{arm} #{i}"] = [(step, looked_up) for step, (_, _, looked_up) in steps.items()]
            train[f"{arm} #{i}"] = [(step, acc) for step, (acc, _, _) in steps.items()]
            last_train.append(statistics.fmean(acc for step, (acc, _, _) in steps.items() if step > STEPS - 5))
        best = max(max(v for _, v in curves[f"{arm} #{i}"]) for i in range(len(names)))
        rows.append([arm, len(names), mean_spread([curves[f"{arm} #{i}"][0][1] for i in range(len(names))]),
                     mean_spread(finals), cell(best), mean_spread(looked), mean_spread(tagged),
                     mean_spread(last_train)])
        total = sum(pooled.values())
        kinds.append([arm, total, *(f"{pooled[k] / total:.3f}" if total else "n/a"
                                    for k in ("right", "a value", "another number", "none"))])
    colours = {f"{arm} #{i}": COLOURS[arm] for arm in ARMS for i in range(len(SEEDS))}
    curve_plot(curves, directory / "eval_level2.png", "step", "held-out level-2 accuracy (mean@4, temperature 1)",
               "held-out level-2 accuracy, each seed a line", colours)
    curve_plot(both, directory / "looked_up_both.png", "step", "share of level-2 conversations",
               "level-2 conversations trained that looked up both words", colours)
    curve_plot(train, directory / "train_level2.png", "step", "train accuracy on level-2 prompts",
               "train accuracy on level-2 prompts, each seed a line", colours)
    examples = []
    for arm, names in arms.items():
        run_dir, seed = directory / names[0], names[0].rsplit("_seed", 1)[1]  # the arm's first finished seed
        first = min(level2_steps(run_dir))
        examples += [f"\n### {arm}, seed {seed}: step {first} (its first level-2 prompts)\n",
                     f"```\n{example(run_dir, first)}\n```", f"\n### {arm}, seed {seed}: step {STEPS}\n",
                     f"```\n{example(run_dir, STEPS)}\n```"]
    return "\n".join([
        f"## Level 2 alone against the curriculum ({CURRICULUM}), {STEPS} steps, max_turns 4\n",
        table(["arm", "seeds", "held-out level-2 accuracy untrained", f"after step {STEPS}",
               "best at any eval", "held-out: looked up both words", "held-out: tagged an answer",
               f"train accuracy on level 2, steps {STEPS - 4}-{STEPS}"], rows),
        f"\nHeld-out: {EVAL_SIZE} level-2 prompts, 4 answers each at temperature 1, every {EVAL_EVERY} steps. Target: "
        "0.5 through the curriculum.",
        f"\n## What the level-2 conversations of steps {STEPS - 4}-{STEPS} answered (seeds pooled)\n",
        table(["arm", "conversations", "right", "tagged one of the looked-up values", "tagged another number",
               "no tagged answer"], kinds),
        "\n![held-out level-2 accuracy](eval_level2.png)\n", "![looked up both words](looked_up_both.png)\n",
        "![train accuracy on level 2](train_level2.png)",
        "\n## Example conversations (the first right one of the step, else its first)", *examples])


register(Study("curriculum", "Does Zorplex level 2 get learnt through a curriculum from level 1 (max_turns 4, "
               f"{STEPS} steps), against level 2 alone? Two seeds each.", RUNS, report))
