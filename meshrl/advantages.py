"""Advantage estimators: how a group of rewards for one prompt becomes one advantage per completion.

The run picks one by name (`controller.advantage`); meshrl/episodes.py's `group_episodes` gives each kept group its
advantages as the group finishes (the controller's `keep_group`), and the replay buffer's Episodes carry them to
the trainer, which never sees rewards.
"""

import math
import statistics


def population_std(values: list[float]) -> float:
    """The population standard deviation in floats (statistics.pstdev computes it exactly in fractions:
    a tenth of a millisecond per group, which the controller pays for every group)."""
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def grpo(rewards: list[float], eps: float) -> list[float]:
    """GRPO (Shao et al. 2024): distance from the group mean, in units of the group's std."""
    mean = statistics.fmean(rewards)
    std = population_std(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


def dr_grpo(rewards: list[float], eps: float) -> list[float]:
    """Dr. GRPO (Liu et al. 2025): the mean baseline only; dividing by the std biases toward easy and
    hard prompts."""
    mean = statistics.fmean(rewards)
    return [r - mean for r in rewards]


def rloo(rewards: list[float], eps: float) -> list[float]:
    """RLOO (Ahmadian et al. 2024): each reward minus the mean of the others (0 for a group of one)."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


ESTIMATORS = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}


def estimator(name: str):
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


STEP_WISE = "step_wise_"  # controller.advantage step_wise_<estimator>: one Episode per turn (meshrl/episodes.py)


def step_wise(final_rewards: list[float], steps_per_run: list[int], name: str, divide_by_steps: bool,
              eps: float) -> list[list[float]]:
    """Multi-step runs of one group (as Trinity-RFT's step-wise GRPO): the group advantage comes from
    each run's last-step reward and is given to every step of that run, optionally divided by the
    run's number of steps so long runs do not outweigh short ones."""
    advantages = estimator(name)(final_rewards, eps)
    return [[a / (n if divide_by_steps else 1)] * n for a, n in zip(advantages, steps_per_run)]


def all_equal(rewards: list[float]) -> bool:
    """A group with one reward value has no learning signal (DAPO drops such groups)."""
    return max(rewards) - min(rewards) == 0
