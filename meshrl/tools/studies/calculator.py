"""`meshrl study calculator`: is Zorplex level 2 learnt once the sum is a tool's answer?

The curriculum study (curriculum.py) taught SmolLM2-135M to look both words up, never to add their values
(held-out level-2 accuracy 0.000 to 0.016 after 30 steps). Here the recipe `zorplex_calc_smollm2` gives
it a calculator (CALC[a+b]) beside the lookup, five turns, a curriculum from level 1 and dynamic sampling;
three seeds (the generator's and the trainer's) train it. The eval during training is validation's; after
the last step each seed's final policy, and the untrained model, are scored once on the test split
(`meshrl eval RUN_DIR --split test`). Target (issue 55): test accuracy >= 0.5 on each seed.
"""

from pathlib import Path

from meshrl.models.model import resolve_checkpoint
from meshrl.tools.studies import cell, curve_plot, mean_spread, read_summary, table
from meshrl.tools.studies.curriculum import evals, example
from meshrl.tools.studies.demo_heldout import test_rates
from meshrl.tools.studies.difficulty import level2_steps
from meshrl.tools.study import Study, StudyRun, register

CONFIG, SEEDS = "zorplex_calc_smollm2", (0, 1, 2)
CHECKS = ("accuracy", "tool_call", "calculated", "tagged")  # the task's checks, `correct` reported as accuracy
RUNS = [StudyRun(f"seed{seed}", CONFIG, ["--generator.seed", str(seed), "--trainer.seed", str(seed)]) for seed in SEEDS]


def report(directory: Path, runs: list[StudyRun]) -> str:
    names = [run.name for run in runs]
    rows, curves, train, tests = [], {}, {}, []
    for name in names:
        run_dir = directory / name
        curves[name] = evals(run_dir)
        train[name] = [(step, acc) for step, (acc, _, _) in level2_steps(run_dir).items()]
        summary = read_summary(run_dir)
        rows.append([name, " / ".join(cell(v) for _, v in curves[name]),
                     *(cell(summary.get(f"eval_{c}_final")) for c in CHECKS[1:]), f"{summary['wall_time_s']:.0f}"])
        tests.append(test_rates(run_dir))
    untrained = test_rates(directory / names[0], resolve_checkpoint("smollm2"))
    keys = [f"eval_{c}" for c in CHECKS if f"eval_{c}" in tests[0]]
    test_rows = [[name, *(cell(t[k]) for k in keys)] for name, t in zip(names, tests)]
    test_rows += [["worst seed", *(cell(min(t[k] for t in tests)) for k in keys)],
                  ["mean ± sd", *(mean_spread([t[k] for t in tests]) for k in keys)],
                  ["untrained model", *(cell(untrained[k]) for k in keys)]]
    curve_plot(curves, directory / "validation_level2.png", "step", "validation level-2 accuracy (mean@4, temperature 1)",
               "Zorplex level 2 with the calculator on validation, each seed a line")
    curve_plot(train, directory / "train_level2.png", "step", "train accuracy on level-2 prompts",
               "train accuracy on level-2 prompts, each seed a line")
    last = max(step for _, v in train.items() for step, _ in v) if any(train.values()) else 0
    examples = [f"\n### {name}, step {last}\n\n```\n{example(directory / name, last)}\n```" for name in names]
    return "\n".join([
        f"## Validation during training ({CONFIG}, {len(names)} seeds)\n",
        table(["run", "validation accuracy at each eval", *(f"validation {c}, last" for c in CHECKS[1:]), "wall time (s)"],
              rows),
        "\nValidation: 32 level-2 prompts, 4 answers each at temperature 1; the recipe was fixed before the test "
        "split was scored.",
        "\n## Test split, each seed's final policy\n",
        table(["policy", *(k.removeprefix("eval_") for k in keys)], test_rows),
        "\nTest: the task's test split at level 2 (words and values no training or validation prompt has), "
        "scored once with `meshrl eval RUN_DIR --split test`.",
        "\n![validation level-2 accuracy](validation_level2.png)\n", "![train accuracy on level 2](train_level2.png)",
        "\n## Example conversations (the first right one of the last step, else its first)", *examples])


register(Study("calculator", f"Is Zorplex level 2 learnt with a calculator beside the lookup ({CONFIG}, "
               f"{len(SEEDS)} seeds), scored on the test split?", RUNS, report))
