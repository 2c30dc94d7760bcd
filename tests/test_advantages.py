"""Advantage estimators against values computed by hand."""

import math

import pytest

from meshrl.advantages import all_equal, dr_grpo, estimator, grpo, rloo, step_wise


def test_grpo_by_hand():
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5
    assert grpo([1.0, 0.0, 0.0, 1.0], eps=0.0) == [1.0, -1.0, -1.0, 1.0]
    std = math.sqrt(2 / 3)
    assert grpo([2.0, 0.0, 1.0], eps=1e-6) == pytest.approx([1 / (std + 1e-6), -1 / (std + 1e-6), 0.0])


def test_dr_grpo_subtracts_the_mean_only():
    assert dr_grpo([2.0, 0.0, 1.0], eps=1e-6) == pytest.approx([1.0, -1.0, 0.0])
    assert dr_grpo([1.0, 0.0, 0.0, 0.0], eps=1e-6) == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_rloo_leaves_each_reward_out_of_its_own_baseline():
    # reward 3 against the mean of (0, 0) = 0; each 0 against the mean of (3, 0) = 1.5
    assert rloo([3.0, 0.0, 0.0], eps=1e-6) == pytest.approx([3.0, -1.5, -1.5])
    assert rloo([1.0, 2.0], eps=1e-6) == pytest.approx([-1.0, 1.0])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_groups_of_one_and_equal_rewards_give_zero(name):
    assert estimator(name)([0.7], 1e-6) == [0.0]
    assert estimator(name)([0.7, 0.7, 0.7], 1e-6) == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)


def test_step_wise_broadcasts_each_runs_final_advantage_to_its_steps():
    # three runs of 2, 1 and 3 steps; final rewards 1, 0, 0 -> RLOO advantages 1, -0.5, -0.5
    assert step_wise([1.0, 0.0, 0.0], [2, 1, 3], "rloo", False, 1e-6) == [[1.0, 1.0], [-0.5], [-0.5, -0.5, -0.5]]
    divided = step_wise([1.0, 0.0, 0.0], [2, 1, 3], "rloo", True, 1e-6)
    assert [len(run) for run in divided] == [2, 1, 3]
    assert sum(divided, []) == pytest.approx([0.5, 0.5, -0.5] + [-0.5 / 3] * 3)


def test_all_equal_and_unknown_estimator():
    assert all_equal([1.0, 1.0]) and all_equal([0.5]) and not all_equal([1.0, 0.0])
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        estimator("ppo")
