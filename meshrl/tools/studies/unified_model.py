"""`meshrl study unified-model`: the learning dynamics with and without a unified model, the A/B the design
discussion meshrl comes from asks for. One model code for sampling and training (the torch generator on the
trainer's own torchtitan model, meshrl/actors/torch_generator.py), with its behaviour logprobs equal to the
trainer's to the bit (`generator.exact`) or not, against vLLM's kernels sampling a policy the trainer
recomputes with its own.

Three arms, three seeds each, on the demo's recipe as it is (`sum_digits_smollm2`: nothing is chosen here,
the recipe is fixed): `vllm` (the recipe), `torch` (`--generator.impl torch`), `torch_exact` (and
`--generator.exact true`, which also scores the trainer's sequences one at a time). Each seed's final
policy is scored once on the test split (`meshrl eval RUN_DIR --split test`); the training rows give the
logprob mismatch, the clip fraction, the behaviour KL, the generated tokens per second and the wall time
per step.
"""

import statistics
from pathlib import Path

from meshrl.tools.studies import cell, mean_spread, read_rows, table
from meshrl.tools.studies.demo_heldout import test_rates
from meshrl.tools.study import Study, StudyRun, register

CONFIG, SEEDS = "sum_digits_smollm2", (0, 1, 2)
ARMS = {"vllm": [], "torch": ["--generator.impl", "torch"],
        "torch_exact": ["--generator.impl", "torch", "--generator.exact", "true"]}
RUNS = [StudyRun(f"{arm}_seed{seed}", CONFIG, extra + ["--generator.seed", str(seed), "--trainer.seed", str(seed)])
        for seed in SEEDS for arm, extra in ARMS.items()]


def arm_figures(run_dir: Path) -> dict:
    """A run's test accuracy and its training rows' means."""
    rows = read_rows(run_dir)
    trained = [r for r in rows if r.get("tokens_trained")]

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in trained) if trained else float("nan")

    wall = sum(r["step_time_s"] for r in rows)
    return {"test": test_rates(run_dir)["eval_accuracy"], "mismatch": mean("logprob_mismatch"),
            "clip": statistics.fmean(r["clip_fraction_low"] + r["clip_fraction_high"] for r in trained) if trained
            else float("nan"), "behaviour_kl": mean("behaviour_kl"),
            "tokens_per_s": sum(r["tokens_generated"] for r in rows) / wall if wall else float("nan"),
            "step_s": wall / len(rows) if rows else float("nan")}


def report(directory: Path, runs: list[StudyRun]) -> str:
    done = {run.name for run in runs}
    figures = {arm: [arm_figures(directory / f"{arm}_seed{s}") for s in SEEDS if f"{arm}_seed{s}" in done]
               for arm in ARMS}
    rows = [[arm, len(fs), mean_spread([f["test"] for f in fs]), cell(min(f["test"] for f in fs)),
             mean_spread([f["mismatch"] for f in fs]), mean_spread([f["clip"] for f in fs]),
             mean_spread([f["behaviour_kl"] for f in fs]), f"{statistics.fmean(f['tokens_per_s'] for f in fs):.0f}",
             f"{statistics.fmean(f['step_s'] for f in fs):.1f}"] for arm, fs in figures.items() if fs]
    return "\n".join([
        f"## {CONFIG}, {len(SEEDS)} seeds per arm\n",
        table(["arm", "seeds", "test accuracy (greedy)", "worst seed", "logprob mismatch (nats/token)",
               "clip fraction", "behaviour KL", "generated tokens/s", "wall time per step (s)"], rows),
        "\nTest: the sum_digits split's 128 prompts, scored once on each seed's final policy with `meshrl eval RUN_DIR "
        "--split test`. The other columns are means over the training steps (a step's figure is its loss tokens' "
        "mean); generated tokens/s are the steps' tokens over their wall time."])


register(Study("unified-model", "The learning dynamics with and without a unified model: vLLM against the torch "
               "generator on the trainer's own model, exact off and on, on the demo's recipe. Three seeds each.",
               RUNS, report))
