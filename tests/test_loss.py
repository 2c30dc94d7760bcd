"""Every loss, aggregation and penalty on small inputs, against values computed by hand."""

import math

import pytest
import torch

from meshrl.configs import LossConfig
from meshrl.losses import aggregate, check, policy_loss, token_entropy, token_logprobs
from meshrl.types import TrainBatch


def batch(behaviour, mask, advantages, loss_tokens=None, loss_sequences=None, ref=None):
    n, t = len(behaviour), len(behaviour[0])
    zeros = torch.zeros((n, t), dtype=torch.long)
    mask = torch.tensor(mask)
    return TrainBatch(zeros, zeros, mask, torch.tensor(behaviour), torch.tensor(advantages),
                      loss_tokens or int(mask.sum()), loss_sequences or n,
                      None if ref is None else torch.tensor(ref))


def loss_of(name, new, b, **cfg):
    return policy_loss(new, b, LossConfig(name=name, **cfg))


def test_token_logprobs_and_entropy_match_their_definitions():
    logits = torch.randn(2, 3, 11)
    targets = torch.randint(0, 11, (2, 3))
    logp = torch.log_softmax(logits, -1)
    assert torch.allclose(token_logprobs(logits, targets), logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-6)
    assert torch.allclose(token_entropy(logits), -(logp.exp() * logp).sum(-1), atol=1e-6)
    assert token_entropy(torch.zeros(1, 1, 8)).item() == pytest.approx(math.log(8))


# Two sequences: sequence 0 (A=+1) with ratios e^0.5 and e^-0.1 and one masked token; sequence 1
# (A=-2) with ratio e^-0.5 and two masked tokens. The masked positions carry junk on purpose.
NEW = [[0.0, -0.6, 5.0], [-1.5, 9.0, 9.0]]
B = ([[-0.5, -0.5, 0.0], [-1.0, 0.0, 0.0]], [[True, True, False], [True, False, False]], [1.0, -2.0])


def test_ppo_clip_by_hand():
    new = torch.tensor(NEW, requires_grad=True)
    loss, metrics = loss_of("ppo_clip", new, batch(*B), clip_eps=0.2)
    # -min(rA, clip(r)A): -1.2 (clipped high), -e^-0.1 (kept), +1.6 (A<0: clip(e^-0.5)=0.8, min picks -1.6)
    assert loss.item() == pytest.approx((-1.2 - math.exp(-0.1) + 1.6) / 3, rel=1e-6)
    assert (metrics["tokens"], metrics["clip_high"], metrics["clip_low"], metrics["tis_truncated"]) == (3, 1, 1, 0)
    assert metrics["ratio"] == pytest.approx(math.exp(0.5) + math.exp(-0.1) + math.exp(-0.5), rel=1e-6)
    assert metrics["ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)
    assert metrics["logprob_mismatch"] == pytest.approx(1.1, rel=1e-6)
    loss.backward()
    # clipped and masked tokens get no gradient; the kept token gets -A r / loss_tokens
    assert new.grad[0, 1].item() == pytest.approx(-math.exp(-0.1) / 3, rel=1e-6)
    assert new.grad[0, 0] == 0 and new.grad[1, 0] == 0 and new.grad[0, 2] == 0 and new.grad[1, 1] == 0


def test_dapo_clips_higher_above_than_below():
    new = torch.tensor([[0.25, -0.5]], requires_grad=True)  # ratios e^0.25 = 1.284 and e^-0.5 = 0.607
    b = batch([[0.0, 0.0]], [[True, True]], [1.0])
    loss, metrics = loss_of("dapo", new, b, clip_eps_low=0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-(1.28 + math.exp(-0.5)) / 2, rel=1e-6)  # high clip 1.28, not 1.2
    assert (metrics["clip_high"], metrics["clip_low"]) == (1, 0)  # A>0: a low ratio is not clipped
    symmetric, _ = loss_of("ppo_clip", new, b, clip_eps=0.2)
    assert symmetric.item() == pytest.approx(-(1.2 + math.exp(-0.5)) / 2, rel=1e-6)


def test_gspo_uses_one_length_normalised_ratio_per_sequence():
    # sequence 0: log ratios 0.5, -0.1 -> sequence ratio e^0.2, clipped to 1.0004 (A>0)
    # sequence 1: one token, log ratio -0.5 -> e^-0.5, A=-2 -> min(-2 e^-0.5, -2 * 0.9997) = -2 * 0.9997
    new = torch.tensor(NEW, requires_grad=True)
    loss, metrics = loss_of("gspo", new, batch(*B))
    seq0, seq1 = -1.0004, 2 * (1 - 3e-4)
    assert loss.item() == pytest.approx((seq0 + seq1) / 2, rel=1e-6)  # mean over sequences
    assert metrics["clip_high"] == 2 and metrics["clip_low"] == 1  # clipping is per sequence, counted per token
    # an unclipped sequence: every token gets d/dlogp of -A exp(mean log r) = -A s / len, over 1 sequence
    near = torch.tensor([[1e-4, 0.0]], requires_grad=True)
    loss, _ = loss_of("gspo", near, batch([[0.0, 0.0]], [[True, True]], [1.0]))
    loss.backward()
    assert near.grad.tolist()[0] == pytest.approx([-math.exp(5e-5) / 2] * 2, rel=1e-5)


def test_cispo_keeps_a_gradient_for_every_token_through_a_clipped_weight():
    new = torch.tensor([[0.5, -0.1]], requires_grad=True)  # ratios 1.649 (clipped to 1.28), 0.905
    loss, metrics = loss_of("cispo", new, batch([[0.0, 0.0]], [[True, True]], [1.0]), clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-(1.28 * 0.5 + math.exp(-0.1) * -0.1) / 2, rel=1e-6)
    loss.backward()
    assert new.grad.tolist()[0] == pytest.approx([-1.28 / 2, -math.exp(-0.1) / 2], rel=1e-6)
    assert metrics["clip_high"] == 1


def test_truncated_importance_sampling_caps_the_ratio():
    # A=-1, ratio e^1.5 = 4.48: PPO alone keeps -4.48 (the min); the cap of 2 truncates it first
    new = torch.tensor([[0.5]], requires_grad=True)
    b = batch([[-1.0]], [[True]], [-1.0])
    uncapped, _ = loss_of("ppo_clip", new, b, tis_cap=0.0)
    assert uncapped.item() == pytest.approx(math.exp(1.5), rel=1e-6)
    capped, metrics = loss_of("ppo_clip", new, b, tis_cap=2.0)
    assert capped.item() == pytest.approx(2.0) and metrics["tis_truncated"] == 1
    capped.backward()
    assert new.grad.item() == 0


def test_aggregations_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    b = batch([[0.0] * 3] * 2, [[True, True, False], [True, False, False]], [0.0, 0.0], loss_tokens=6, loss_sequences=4)
    assert aggregate(per_token, b, "token_mean", 0).item() == pytest.approx(6 / 6)  # step-wide token count
    assert aggregate(per_token, b, "seq_mean", 0).item() == pytest.approx((1.5 + 3.0) / 4)
    assert aggregate(per_token, b, "constant", 10).item() == pytest.approx(6 / (4 * 10))
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(per_token, b, "median", 0)


def test_micro_batches_add_up_to_the_steps_token_mean():
    whole = batch([[0.0, 0.0], [0.0, 0.0]], [[True, True], [True, False]], [1.0, -1.0])
    full, _ = loss_of("ppo_clip", torch.zeros(2, 2), whole)
    halves = [batch([[0.0, 0.0]], [m], [a], loss_tokens=3, loss_sequences=2)
              for m, a in (([True, True], 1.0), ([True, False], -1.0))]
    assert sum(loss_of("ppo_clip", torch.zeros(1, 2), h)[0].item() for h in halves) == pytest.approx(full.item())


def test_k3_kl_penalty_to_the_reference():
    # log ratio to the reference d = ref - logp = -0.5 and +0.5 on the two loss tokens
    new = torch.tensor([[0.0, -1.0, 3.0]], requires_grad=True)
    b = batch([[0.0, -1.0, 0.0]], [[True, True, False]], [0.0], ref=[[-0.5, -0.5, 0.0]])
    loss, metrics = loss_of("ppo_clip", new, b, kl_coef=0.1)
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1]
    assert metrics["kl"] == pytest.approx(sum(k3), rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2, rel=1e-6)  # A=0: only the penalty
    loss.backward()
    # d k3 / d logp = 1 - exp(d): pulls each logprob toward the reference
    assert new.grad.tolist()[0][:2] == pytest.approx([0.1 * (1 - math.exp(-0.5)) / 2, 0.1 * (1 - math.exp(0.5)) / 2])
    with pytest.raises(ValueError, match="reference logprobs"):
        loss_of("ppo_clip", new, batch([[0.0]], [[True]], [0.0]), kl_coef=0.1)


def test_entropy_bonus_rewards_a_flatter_distribution():
    logits = torch.tensor([[[2.0, 0.0, 0.0]]], requires_grad=True)
    b = batch([[0.0]], [[True]], [0.0])
    entropy = token_entropy(logits)
    loss, metrics = policy_loss(torch.zeros(1, 1), b, LossConfig(entropy_coef=0.5), entropy)
    assert metrics["entropy"] == pytest.approx(entropy.item())
    assert loss.item() == pytest.approx(-0.5 * entropy.item())
    loss.backward()
    assert logits.grad[0, 0, 0] > 0  # descending the loss lowers the dominant logit: more entropy


def test_unknown_loss_is_an_error():
    with pytest.raises(ValueError, match="unknown loss 'ppo2'"):
        check(LossConfig(name="ppo2"))
