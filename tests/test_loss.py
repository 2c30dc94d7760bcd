"""The trainer's loss on small inputs, checked against values computed by hand."""

import math

import pytest
import torch

from meshrl.actors.trainer import ppo_clip_loss, token_logprobs
from meshrl.types import TrainBatch


def batch(behaviour, mask, advantages, loss_tokens):
    n, t = len(behaviour), len(behaviour[0])
    zeros = torch.zeros((n, t), dtype=torch.long)
    return TrainBatch(zeros, zeros, torch.tensor(mask), torch.tensor(behaviour), torch.tensor(advantages), loss_tokens)


def test_token_logprobs_match_log_softmax():
    logits = torch.randn(2, 3, 11)
    targets = torch.randint(0, 11, (2, 3))
    expected = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, targets), expected, atol=1e-6)


def test_ppo_clip_by_hand():
    # sequence 0 (A=+1): ratios e^0.5 (clipped to 1.2), e^-0.1 (kept); masked position ignored.
    # sequence 1 (A=-2): ratio e^-0.5 (clipped to 0.8 -> min picks -1.6), masked, masked.
    new = torch.tensor([[0.0, -0.6, 5.0], [-1.5, 9.0, 9.0]], requires_grad=True)
    b = batch([[-0.5, -0.5, 0.0], [-1.0, 0.0, 0.0]], [[True, True, False], [True, False, False]], [1.0, -2.0], 3)
    loss, metrics = ppo_clip_loss(new, b, clip_eps=0.2)
    per_token = [-1.2, -math.exp(-0.1), 2 * 0.8]
    assert loss.item() == pytest.approx(sum(per_token) / 3, rel=1e-6)
    assert metrics["tokens"] == 3 and (metrics["clip_high"], metrics["clip_low"]) == (1, 1)
    assert metrics["tis_truncated"] == 0
    assert metrics["ratio"] == pytest.approx(math.exp(0.5) + math.exp(-0.1) + math.exp(-0.5), rel=1e-6)
    assert metrics["ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)
    assert metrics["logprob_mismatch"] == pytest.approx(0.5 + 0.1 + 0.5, rel=1e-6)
    loss.backward()
    # clipped tokens and masked tokens get no gradient; the kept token gets -A * ratio / loss_tokens
    assert new.grad[0, 0] == 0 and new.grad[1, 0] == 0 and new.grad[0, 2] == 0 and new.grad[1, 1] == 0
    assert new.grad[0, 1].item() == pytest.approx(-math.exp(-0.1) / 3, rel=1e-6)


def test_loss_tokens_normalise_across_micro_batches():
    new = torch.zeros(1, 2)
    b = batch([[0.0, 0.0]], [[True, True]], [1.0], loss_tokens=8)
    loss, _ = ppo_clip_loss(new, b, clip_eps=0.2)
    assert loss.item() == pytest.approx(-2 / 8)


def test_truncated_importance_sampling_caps_the_ratio():
    # A=-1, ratio e^1.5 = 4.48: PPO alone keeps the unclipped -4.48 (min of -4.48 and -1.2);
    # the cap of 2 truncates the ratio first: loss +2, and no gradient through the capped token.
    new = torch.tensor([[0.5]], requires_grad=True)
    b = batch([[-1.0]], [[True]], [-1.0], 1)
    uncapped, _ = ppo_clip_loss(new, b, clip_eps=0.2)
    assert uncapped.item() == pytest.approx(math.exp(1.5), rel=1e-6)
    capped, metrics = ppo_clip_loss(new, b, clip_eps=0.2, tis_cap=2.0)
    assert capped.item() == pytest.approx(2.0)
    assert metrics["tis_truncated"] == 1 and metrics["ratio_max"] == pytest.approx(math.exp(1.5), rel=1e-6)
    capped.backward()
    assert new.grad.item() == 0
