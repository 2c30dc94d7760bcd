"""The trainer's learning rate over a run's optimizer updates: a linear warmup, then constant or decaying.

A run whose accuracy peaks and then falls back (the demo at a constant lr 5e-5, docs/studies.md) needs
a smaller lr at its end than at its start. The schedule is torchtitan's (`LRSchedulersContainer`, torch's
`LambdaLR` over warmup, stable and decay phases), counted in optimizer updates, not controller steps:
a step takes `trainer.mini_batches` of them. Built over one update fewer than the run has, so that the
run's last update is applied at exactly the floor (`min_lr_factor` × trainer.lr); over the run's own
count torchtitan's last update would stay one decay step above it (1.0e-5, not 7e-6, in the demo). It is a function of the updates applied so far alone, so a
resumed or restarted trainer continues it exactly.
"""

from dataclasses import dataclass

DECAYS = ("none", "linear", "sqrt", "cosine")


@dataclass
class LrScheduleConfig:
    """trainer.lr over the run's optimizer updates (torchtitan's lr scheduler, in updates)."""

    warmup_updates: int = 0  # the first updates' lr rises linearly to trainer.lr: update i (from 0) takes (i + 1) / warmup_updates of it
    decay: str = "none"  # after the warmup: none (constant) | linear | sqrt | cosine, from trainer.lr down to min_lr_factor × it at the run's end
    decay_ratio: float = 1.0  # the share of the updates the decay takes, the last ones; before it the lr holds at its peak (warmup-stable-decay)
    min_lr_factor: float = 0.0  # the decay's end, as a share of trainer.lr: the lr of the run's last update
    total_updates: int = 0  # the updates the schedule spans; 0: the run's, controller.steps × trainer.mini_batches

    def check(self) -> None:
        if self.decay not in DECAYS:
            raise ValueError(f"unknown trainer.lr_schedule.decay {self.decay!r}; known: {', '.join(DECAYS)}")
        if self.warmup_updates < 0 or self.total_updates < 0:
            raise ValueError("trainer.lr_schedule.warmup_updates and total_updates must be at least 0")
        for name in ("min_lr_factor", "decay_ratio"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"trainer.lr_schedule.{name} must be between 0 and 1, not {getattr(self, name)}")

    @property
    def constant(self) -> bool:
        return self.warmup_updates == 0 and self.decay == "none"


def lr_scheduler(optimizer, config: LrScheduleConfig):
    """torchtitan's scheduler of `optimizer` for `config` (its total_updates filled in), stepped once
    after each applied update; None for a constant lr."""
    if config.constant:
        return None
    if config.total_updates < 1:
        raise ValueError("trainer.lr_schedule.total_updates must be set (the run's updates) before a scheduler is built")
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    schedule = LRSchedulersContainer.Config(
        warmup_steps=config.warmup_updates, decay_ratio=0.0 if config.decay == "none" else config.decay_ratio,
        decay_type="linear" if config.decay == "none" else config.decay, min_lr_factor=config.min_lr_factor)
    # update i (from 0) is applied at torchtitan's factor for step i: over total_updates - 1 steps the
    # last one, i = total_updates - 1, is the decay's end (with no decay, the peak: over all of them)
    steps = config.total_updates - (config.decay != "none")
    return schedule.build(optimizers=[optimizer], training_steps=max(steps, 1))
