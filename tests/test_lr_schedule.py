"""The trainer's learning-rate schedule (meshrl/lr_schedule.py): torchtitan's scheduler counted
in optimizer updates, checked against factors computed by hand, and its length filled in from the run's
steps."""

import math

import pytest
import torch

from meshrl.configs import resolve
from meshrl.configs.named import load_config
from meshrl.lr_schedule import LrScheduleConfig, lr_scheduler


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


def test_a_linear_decay_falls_by_one_share_of_the_updates_each_update_and_ends_at_the_floor():
    # 4 updates, no warmup: 1, then 1 - 1/3, 1 - 2/3, and the last update at the floor, 0
    assert lrs(LrScheduleConfig(decay="linear", total_updates=4), lr=2.0) == pytest.approx([2.0, 4 / 3, 2 / 3, 0.0])
    # the demo's: 40 updates, the last 20 decaying linearly from 7e-5 to 7e-6, the last update at 7e-6
    demo = lrs(LrScheduleConfig(decay="linear", decay_ratio=0.5, min_lr_factor=0.1, total_updates=40), lr=7e-5)
    assert demo[:20] == pytest.approx([7e-5] * 20) and demo[-1] == pytest.approx(7e-6)
    assert demo[20:] == pytest.approx([7e-6 + 6.3e-5 * (1 - k / 20) for k in range(1, 21)])


def test_a_warmup_rises_linearly_then_a_cosine_decays_to_the_min_lr_factor():
    # warmup 2: 1/2, 2/2; one update at the peak; then update k takes progress (k - 2) / 7 of a half cosine,
    # scaled between 0.1 and 1 (torchtitan shortens the decay to the 7 updates left after the warmup)
    expected = [0.5, 1.0, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (k - 2) / 7)) for k in range(3, 10)]
    got = lrs(LrScheduleConfig(warmup_updates=2, decay="cosine", min_lr_factor=0.1, total_updates=10))
    assert got == pytest.approx(expected)
    assert got[-1] == pytest.approx(0.1)  # the floor, on the last update


def test_a_decay_over_the_last_half_holds_the_peak_until_then():
    # 8 updates, decay_ratio 0.5: the first 4 at the peak, then 4 decaying by 1/4 each, linear down to 0.2 on the last
    got = lrs(LrScheduleConfig(decay="linear", decay_ratio=0.5, min_lr_factor=0.2, total_updates=8))
    assert got == pytest.approx([1, 1, 1, 1, 0.2 + 0.8 * 3 / 4, 0.2 + 0.8 * 2 / 4, 0.2 + 0.8 * 1 / 4, 0.2])


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
    assert resolve(config).trainer.lr_schedule.total_updates == 21
    assert config.trainer.lr_schedule.total_updates == 0  # the run's own config (config.json) keeps the default
    config.trainer.lr_schedule.total_updates = 50
    assert resolve(config).trainer.lr_schedule.total_updates == 50
