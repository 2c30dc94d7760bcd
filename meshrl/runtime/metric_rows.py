"""Each step's metrics row (the controller makes it: what its batch held, what training did, how long
each phase took, the replicas' and work buffer's counters) is kept here and written on. The rows go to
metrics.jsonl, TensorBoard and W&B (meshrl/runtime/loggers.py); they are what a checkpoint keeps and a
resumed run goes on from. (The trained completions go to rollouts.jsonl from the replay buffer.)"""

from tqdm import tqdm

from meshrl.runtime.loggers import MetricLoggers


class MetricRows:
    """The rows so far (a resumed run's first), and where each new one is written."""

    def __init__(self, loggers: MetricLoggers | None, rows: list[dict] = (), progress: bool = True):
        """`progress`: a progress bar on stderr."""
        self.loggers, self.show = loggers, progress
        self.rows = list(rows)
        self.bad_steps = 0  # steps in a row with an update not applied (NaN or infinite)
        self.bar: tqdm | None = None

    @property
    def done(self) -> int:
        """Steps logged."""
        return len(self.rows)

    def progress(self, steps: int):
        """The steps after those logged up to `steps`, with a progress bar."""
        with tqdm(range(self.done + 1, steps + 1), initial=self.done, total=steps, unit="step",
                  disable=not self.show) as self.bar:
            yield from self.bar

    def log(self, row: dict) -> None:
        """Add step `row`: counts a step with an update not applied, writes the row everywhere."""
        self.bad_steps = self.bad_steps + 1 if row["updates_skipped"] else 0
        row["steps_skipped"] = (self.rows[-1]["steps_skipped"] if self.rows else 0) + bool(self.bad_steps)
        self.rows.append(row)
        if self.loggers:
            self.loggers.log(row)
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{row['reward_mean']:.2f}", acc=f"{row.get('accuracy', float('nan')):.2f}",
                                 signal=f"{row.get('groups_with_signal', float('nan')):.2f}")  # groups that teach

    def close(self) -> None:
        if self.loggers:
            self.loggers.close()
