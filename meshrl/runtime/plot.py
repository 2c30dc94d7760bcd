"""The reward and accuracy curves of a run, as a PNG."""

from pathlib import Path


def plot_curves(rows: list[dict], initial_eval: dict[str, float], path: Path) -> None:
    """Training reward and accuracy per step, and every eval rate (`eval_*`) from step 0 on (the eval accuracy
    with its 95% interval as a band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward_mean"] for r in rows], label="reward mean (groups trained)")
    ax.plot(steps, [r["accuracy"] for r in rows], label="accuracy (groups trained)")
    for key in (k for k in initial_eval if not k.endswith("95")):
        evals = [(0, initial_eval[key])] + [(r["step"], r[key]) for r in rows if key in r]
        line, = ax.plot(*zip(*evals), "o--", label=f"{key.removeprefix('eval_').replace('_', ' ')} (eval, held out)")
        if f"{key}_low95" in initial_eval:  # its 95% interval over prompts, as a band
            band = [(0, initial_eval)] + [(r["step"], r) for r in rows if key in r]
            ax.fill_between([s for s, _ in band], [e.get(f"{key}_low95", e[key]) for _, e in band],
                            [e.get(f"{key}_high95", e[key]) for _, e in band], color=line.get_color(), alpha=0.15)
    ax.set_xlabel("step (= policy version)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
