"""The replay buffer role's config section (`replay_buffer`): what any buffer implementation is given (`impl`:
fifo, replay or module:Class), its checks, and how many groups each batch generates afresh. A module of its
own beside meshrl/actors/replay_buffer.py, which imports Monarch. A run's config (meshrl/configs) composes it;
values that depend on other sections are filled in once by meshrl.configs.resolve before anything is spawned."""

from dataclasses import dataclass

from meshrl.checks import at_least, one_of


@dataclass
class ReplayBufferConfig:
    """The replay buffer between the controller and the trainer (meshrl/actors/replay_buffer.py): it
    holds the episodes of finished groups, collates each step's micro-batches, and hands them to the
    trainer's ranks."""

    impl: str = "fifo"  # fifo (each group trained once, in the batch it was generated for) | replay (groups trained again, see below) | module:Class
    max_reuse: int = 2  # replay: times a group may be trained again after its first, while within controller.max_policy_age
    fresh_fraction: float = 0.5  # replay: the share of each batch's prompts_per_step groups generated for it; old groups fill the rest
    priority: str = "reward_std"  # replay: which old groups first: reward_std (the widest spread of rewards: the most to learn) | newest
    cpus: str = ""  # pin its process to these cores; "" leaves placement to the OS
    hosts: str = ""  # the job.hosts group its process goes on; "": the controller's host
    timeout_s: float = 600.0  # one call (adding a group, a step's plan, a micro-batch): past it the buffer is restarted
    max_restarts: int = 3  # a dead or hung buffer is restarted empty, the groups it held for untrained batches generated again (meshrl/restarts.py); more failures than this in a row, each within controller.restart_window_s of its start, stop the run

    def check(self) -> None:
        at_least(self, "replay_buffer", max_restarts=0)
        if self.impl == "replay":
            if not 0 < self.fresh_fraction <= 1 or self.max_reuse < 1:
                raise ValueError("replay_buffer.fresh_fraction must be in (0, 1] and replay_buffer.max_reuse at least 1")
            one_of(self, "replay_buffer", priority=("reward_std", "newest"))

    def fresh_groups(self, prompts_per_step: int) -> int:
        """Groups generated for each batch: prompts_per_step, or with `replay` its fresh share (at least one)."""
        if self.impl != "replay":
            return prompts_per_step
        return max(1, round(prompts_per_step * self.fresh_fraction))
