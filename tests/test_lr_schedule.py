"""The trainer's learning-rate schedule (meshrl/configs/lr_schedule.py): torchtitan's scheduler counted
in optimizer updates, checked against factors computed by hand, and its length filled in from the run's
steps."""

import math

import pytest
import torch

from meshrl.configs import load_config
from meshrl.configs.lr_schedule import LrScheduleConfig, lr_scheduler
from meshrl.runtime.launch import trainer_config


def lrs(config: LrScheduleConfig, lr: float = 1.0) -> list[float]:
    """The lr each of the schedule's updates is applied with, an AdamW on one parameter stepped through them."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    scheduler = lr_scheduler(optimizer, config)
    applied = []
    for _ in range(config.total_updates):
        applied.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return applied


def test_a_linear_decay_falls_by_one_share_of_the_updates_each_update_and_stops_above_the_floor():
    # 4 updates, no warmup: 1, then 1 - 1/4, 1 - 2/4, 1 - 3/4 (the end, 0, comes after the last update)
    assert lrs(LrScheduleConfig(decay="linear", total_updates=4), lr=2.0) == pytest.approx([2.0, 1.5, 1.0, 0.5])


def test_a_warmup_rises_linearly_then_a_cosine_decays_to_the_min_lr_factor():
    # warmup 2: 1/2, 2/2; one update at the peak; then update k takes progress (k - 2) / 8 of a half cosine,
    # scaled between 0.1 and 1
    expected = [0.5, 1.0, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (k - 2) / 8)) for k in range(3, 10)]
    got = lrs(LrScheduleConfig(warmup_updates=2, decay="cosine", min_lr_factor=0.1, total_updates=10))
    assert got == pytest.approx(expected)
    assert got[-1] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 7 / 8)))  # 0.134, above the floor


def test_a_decay_over_the_last_half_holds_the_peak_until_then():
    # 8 updates, decay_ratio 0.5: 4 decay updates at the end, the 4 before at the peak (torchtitan counts one
    # more stable update, so the decay's 1/4 steps begin at update 5), linear down to 0.2
    got = lrs(LrScheduleConfig(decay="linear", decay_ratio=0.5, min_lr_factor=0.2, total_updates=8))
    assert got == pytest.approx([1, 1, 1, 1, 1, 0.2 + 0.8 * 3 / 4, 0.2 + 0.8 * 2 / 4, 0.2 + 0.8 * 1 / 4])


def test_a_warmup_without_decay_holds_the_peak_and_no_schedule_builds_no_scheduler():
    assert lrs(LrScheduleConfig(warmup_updates=4, total_updates=6)) == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1])
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    assert lr_scheduler(optimizer, LrScheduleConfig()) is None
    with pytest.raises(ValueError, match="total_updates must be set"):
        lr_scheduler(optimizer, LrScheduleConfig(decay="linear"))


@pytest.mark.parametrize("field, value, message", [("decay", "step", "unknown trainer.lr_schedule.decay 'step'"),
                                                   ("min_lr_factor", 1.5, "between 0 and 1"),
                                                   ("decay_ratio", -0.5, "decay_ratio must be between 0 and 1"),
                                                   ("warmup_updates", -1, "at least 0")])
def test_a_schedule_that_cannot_work_is_refused_naming_its_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        load_config("smoke", [f"--trainer.lr_schedule.{field}", str(value)]).check()


def test_the_schedule_spans_the_runs_optimizer_updates_unless_told_otherwise():
    config = load_config("smoke", ["--controller.steps", "7", "--trainer.mini_batches", "3",
                                   "--trainer.lr_schedule.decay", "cosine"])
    assert trainer_config(config).lr_schedule.total_updates == 21
    assert config.trainer.lr_schedule.total_updates == 0  # the run's own config keeps the default
    config.trainer.lr_schedule.total_updates = 50
    assert trainer_config(config).lr_schedule.total_updates == 50
