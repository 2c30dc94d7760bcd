"""`meshrl bench sync-vs-async`: the same workload trained synchronously, then asynchronously.

Both runs use the same actors, placement and controller; only `controller.max_policy_age`
differs (0 for sync, the config's bound, at least 1, for async). The most that overlapping
generation with training can give is `ideal_speedup` = (t_gen + t_train) / max(t_gen, t_train),
from the phase times the sync run measured.
"""

import asyncio
import statistics
from pathlib import Path

from meshrl.configs import load_config
from meshrl.run import Run
from meshrl.report import read_rows, summarize


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
        "reward_vs_time": curve,
        "reward_per_step": [r["reward_mean"] for r in rows],
    }


def run(config_name: str, steps: int, run_dir: Path, overrides: list[str]) -> dict:
    result = {"config": config_name, "steps": steps}
    for mode in ("sync", "async"):
        config = load_config(config_name, [*overrides, "--controller.steps", str(steps)])
        age = 0 if mode == "sync" else max(config.controller.max_policy_age, 1)
        config.controller.max_policy_age = age
        summary = asyncio.run(Run(config, run_dir / mode).run())
        result[mode] = {"max_policy_age": age, **mode_figures(read_rows(run_dir / mode), summary)}
    sync = result["sync"]
    t_gen, t_train = sync["mean_rollout_time_s"], sync["mean_train_phase_s"]
    result["speedup"] = result["async"]["trained_tokens_per_s"] / sync["trained_tokens_per_s"]
    result["ideal_speedup"] = (t_gen + t_train) / max(t_gen, t_train)
    result["speedup_vs_ideal"] = result["speedup"] / result["ideal_speedup"]
    return result


def report(result: dict) -> str:
    lines = [f"sync vs async, {result['config']}, {result['steps']} steps each"]
    header = f"  {'':24s} {'sync':>10s} {'async':>10s}"
    lines.append(header)
    for key, fmt in [("max_policy_age", "d"), ("wall_time_s", ".1f"), ("trained_tokens_per_s", ".1f"),
                     ("generated_tokens_per_s", ".1f"), ("mean_step_time_s", ".2f"), ("generator_busy", ".2f"),
                     ("trainer_busy", ".2f"), ("staleness_max", "d"), ("eval_accuracy_final", ".3f")]:
        lines.append(f"  {key:24s} {result['sync'][key]:>10{fmt}} {result['async'][key]:>10{fmt}}")
    lines.append(f"  speedup {result['speedup']:.2f} (ideal {result['ideal_speedup']:.2f}, "
                 f"{result['speedup_vs_ideal']:.2f} of ideal; target >= 0.85: "
                 f"{'ok' if result['speedup_vs_ideal'] >= 0.85 else 'MISSED'})")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    for mode in ("sync", "async"):
        times, rewards = zip(*result[mode]["reward_vs_time"])
        left.plot(times, rewards, "o-", label=f"{mode} (max_policy_age={result[mode]['max_policy_age']})")
    left.set_xlabel("wall-clock time in training (s)")
    left.set_ylabel("reward mean")
    left.set_title(f"{result['config']}: reward against time")
    left.grid(alpha=0.3)
    left.legend()
    kinds = ["trained_tokens_per_s", "generated_tokens_per_s"]
    for i, mode in enumerate(("sync", "async")):
        right.bar([k + i * 0.4 for k in range(len(kinds))], [result[mode][k] for k in kinds], width=0.4, label=mode)
    right.set_xticks([k + 0.2 for k in range(len(kinds))], ["trained tokens/s", "generated tokens/s"])
    right.set_title(f"throughput: speedup {result['speedup']:.2f} (ideal {result['ideal_speedup']:.2f})")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
