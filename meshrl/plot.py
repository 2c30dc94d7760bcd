"""The reward and accuracy curves of a run, as a PNG."""

from pathlib import Path


def plot_curves(rows: list[dict], initial_eval: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    evals = [(0, initial_eval)] + [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward_mean"] for r in rows], label="reward mean (train samples)")
    ax.plot(steps, [r["accuracy"] for r in rows], label="accuracy (train samples)")
    ax.plot(*zip(*evals), "o--", label="eval accuracy (held-out prompts)")
    ax.set_xlabel("optimizer step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
