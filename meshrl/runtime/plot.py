"""The reward and accuracy curves of a run, as a PNG."""

from pathlib import Path


def plot_curves(rows: list[dict], initial_eval: dict[str, float], path: Path) -> None:
    """Training reward and accuracy per step, and every eval rate (`eval_*`) from step 0 on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward_mean"] for r in rows], label="reward mean (groups trained)")
    ax.plot(steps, [r["accuracy"] for r in rows], label="accuracy (groups trained)")
    for key in initial_eval:
        evals = [(0, initial_eval[key])] + [(r["step"], r[key]) for r in rows if key in r]
        ax.plot(*zip(*evals), "o--", label=f"{key.removeprefix('eval_').replace('_', ' ')} (eval, held out)")
    ax.set_xlabel("step (= policy version)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
