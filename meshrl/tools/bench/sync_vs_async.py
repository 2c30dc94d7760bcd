"""`meshrl bench sync-vs-async`: the same workload trained three ways, one run each: synchronously,
asynchronously with generators that drain before they load new weights, and asynchronously with
weights loaded in flight.

The runs use the same actors, placement and controller; only `controller.max_policy_age` (0 for
sync, the config's bound, at least 1, for async) and `generator.weight_update` differ. The most that
overlapping generation with training can give is `ideal_speedup` = (t_gen + t_train) /
max(t_gen, t_train), from the phase times the sync run measured. `generator_idle` is the share of
the time the average replica's engine had no request to run.
"""

import asyncio
import statistics
from pathlib import Path

from meshrl.configs.named import load_config
from meshrl.runtime.run import Run
from meshrl.tools.report import read_rows, summarize


def mode_figures(rows: list[dict], summary: dict) -> dict:
    """`meshrl report`'s figures of a run, plus what the comparison needs: busy shares, phase times
    and reward against wall-clock time."""
    figures = summarize(rows, summary)
    wall = figures["wall_time_s"]
    elapsed, curve = 0.0, []
    for r in rows:
        elapsed += r["step_time_s"]
        curve.append([elapsed, r["reward_mean"]])
    return {
        **figures,
        "mean_step_time_s": wall / len(rows),
        "generator_busy": sum(r["generator_busy"] * r["step_time_s"] for r in rows) / wall,
        "trainer_busy": sum(r["trainer_busy"] * r["step_time_s"] for r in rows) / wall,
        "mean_rollout_time_s": statistics.fmean(r["rollout_time_s"] for r in rows),
        # everything a step does besides waiting for its batch: train, publish, bookkeeping
        "mean_train_phase_s": statistics.fmean(r["step_time_s"] - r["wait_time_s"] for r in rows),
        "groups_stale": sum(r["groups_stale"] for r in rows),
        # the share of the time the average replica's engine had no request to run
        "generator_idle": sum(r["generator_idle"] * r["step_time_s"] for r in rows) / wall,
        "weight_swaps_in_flight": rows[-1]["weight_swaps_in_flight"],
        "reward_vs_time": curve,
        "reward_per_step": [r["reward_mean"] for r in rows],
    }


# arm -> (max_policy_age: None for the config's own, at least 1; generator.weight_update)
ARMS = {"sync": (0, "drain"), "async_drain": (None, "drain"), "async_in_flight": (None, "in_flight")}


def run(config_name: str, steps: int, run_dir: Path, overrides: list[str]) -> dict:
    result = {"config": config_name, "steps": steps}
    for arm, (age, update) in ARMS.items():
        config = load_config(config_name, [*overrides, "--controller.steps", str(steps)])
        config.controller.max_policy_age = age if age is not None else max(config.controller.max_policy_age, 1)
        config.generator.weight_update = update
        summary = asyncio.run(Run(config, run_dir / arm).run())
        result[arm] = {"max_policy_age": config.controller.max_policy_age, "weight_update": update,
                       **mode_figures(read_rows(run_dir / arm), summary)}
    sync = result["sync"]
    t_gen, t_train = sync["mean_rollout_time_s"], sync["mean_train_phase_s"]
    result["ideal_speedup"] = (t_gen + t_train) / max(t_gen, t_train)
    for arm in ("async_drain", "async_in_flight"):
        result[f"speedup_{arm.removeprefix('async_')}"] = result[arm]["trained_tokens_per_s"] / sync["trained_tokens_per_s"]
    return result


def report(result: dict) -> str:
    lines = [f"sync vs async, {result['config']}, {result['steps']} steps each",
             f"  {'':24s}" + "".join(f" {arm:>16s}" for arm in ARMS)]
    for key, fmt in [("max_policy_age", "d"), ("wall_time_s", ".1f"), ("trained_tokens_per_s", ".1f"),
                     ("generated_tokens_per_s", ".1f"), ("mean_step_time_s", ".2f"), ("generator_busy", ".2f"),
                     ("generator_idle", ".2f"), ("trainer_busy", ".2f"), ("staleness_max", "d"),
                     ("weight_swaps_in_flight", "d"), ("eval_accuracy_final", ".3f")]:
        lines.append(f"  {key:24s}" + "".join(f" {result[arm][key]:>16{fmt}}" for arm in ARMS))
    lines.append(f"  speedup over sync: drain {result['speedup_drain']:.2f}, in flight {result['speedup_in_flight']:.2f} "
                 f"(ideal {result['ideal_speedup']:.2f})")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
    for arm in ARMS:
        times, rewards = zip(*result[arm]["reward_vs_time"])
        left.plot(times, rewards, "o-", label=f"{arm} (max_policy_age={result[arm]['max_policy_age']}, "
                                              f"{result[arm]['weight_update']})")
    left.set_xlabel("wall-clock time in training (s)")
    left.set_ylabel("reward mean")
    left.set_title(f"{result['config']}: reward against time")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    kinds = ["trained_tokens_per_s", "generated_tokens_per_s"]
    width = 0.8 / len(ARMS)
    for i, arm in enumerate(ARMS):
        right.bar([k + i * width for k in range(len(kinds))], [result[arm][k] for k in kinds], width=width, label=arm)
    right.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))], ["trained tokens/s", "generated tokens/s"])
    right.set_title(f"speedup: drain {result['speedup_drain']:.2f}, in flight {result['speedup_in_flight']:.2f}")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
