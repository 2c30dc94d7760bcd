"""The controller's Monarch messages per group are a budget that cannot grow unseen: a fixed workload (64
generator stand-ins on real Monarch processes, the real replay buffer, 3 steps of 64 groups and two evals)
routed by the real controller, every message it sends counted (meshrl/tools/bench/messages.py)."""

import asyncio

import pytest

from meshrl.tools.bench.controller_real import real_cost
from meshrl.tools.bench.messages import MESSAGES_PER_GROUP, MessageCounter

pytestmark = pytest.mark.processes


def test_the_controller_sends_at_most_its_budget_of_monarch_messages_per_group(tmp_path):
    with MessageCounter().installed() as counter:
        run = asyncio.run(real_cost(64, 16, 8, 3, 2, 4, [], tmp_path, counter, kill=False))
    sent, groups = run["messages"], run["groups"]
    assert groups == 3 * 64 + 4 and run["groups_regenerated"] == 0
    # each group was asked for once (no call retried), its grading riding on it: no score message; the graded
    # groups' stages shared messages; the trainer was called once per update (1 rank, 1 update a step)
    assert sent["generate"] == groups and "score" not in sent and 0 < sent["stage"] < 3 * 64, sent
    assert sent["forward_backward"] == sent["optim_step"] == 3, sent
    assert run["messages_per_group"] == sum(sent.values()) / groups
    assert run["messages_per_group"] <= MESSAGES_PER_GROUP, sent
