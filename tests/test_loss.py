"""Every loss, aggregation and penalty on small inputs, against values computed by hand."""

import math

import pytest
import torch

from meshrl.losses import LOSSES, LossConfig, aggregate, check, policy_loss, token_entropy, token_logprobs
from meshrl.types import TrainBatch


def batch(behaviour, mask, advantages, loss_tokens=None, loss_sequences=None, ref=None, old=None):
    n, t = len(behaviour), len(behaviour[0])
    zeros = torch.zeros((n, t), dtype=torch.long)
    mask = torch.tensor(mask)
    return TrainBatch(zeros, zeros, mask, torch.tensor(behaviour), torch.tensor(advantages),
                      loss_tokens or int(mask.sum()), loss_sequences or n,
                      None if ref is None else torch.tensor(ref), None if old is None else torch.tensor(old))


def loss_of(name, new, b, **cfg):
    return policy_loss(new, b, LossConfig(name=name, **cfg))


def test_token_logprobs_and_entropy_match_their_definitions():
    logits = torch.randn(2, 3, 11)
    targets = torch.randint(0, 11, (2, 3))
    logp = torch.log_softmax(logits, -1)
    assert torch.allclose(token_logprobs(logits, targets), logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-6)
    assert torch.allclose(token_entropy(logits), -(logp.exp() * logp).sum(-1), atol=1e-6)
    assert token_entropy(torch.zeros(1, 1, 8)).item() == pytest.approx(math.log(8))
    # as a metric it goes a few rows at a time; with a gradient (the entropy bonus) whole: the same values
    rows = torch.randn(10, 11) * 4
    whole = token_entropy(rows.clone().requires_grad_())
    assert whole.requires_grad and torch.allclose(token_entropy(rows, rows=3), whole.detach(), atol=1e-5)


# Two sequences: sequence 0 (A=+1) with ratios e^0.5 and e^-0.1 to pi_old and one masked token;
# sequence 1 (A=-2) with ratio e^-0.5 and two masked tokens. The masked positions carry junk on
# purpose. The generator sampled exactly pi_old here (behaviour == old: weight 1).
NEW = [[0.0, -0.6, 5.0], [-1.5, 9.0, 9.0]]
OLD = [[-0.5, -0.5, 0.0], [-1.0, 0.0, 0.0]]
MASK = [[True, True, False], [True, False, False]]
B = (OLD, MASK, [1.0, -2.0])


def test_ppo_clip_by_hand():
    new = torch.tensor(NEW, requires_grad=True)
    loss, metrics = loss_of("ppo_clip", new, batch(*B, old=OLD), clip_eps=0.2)
    # -min(rA, clip(r)A): -1.2 (clipped high), -e^-0.1 (kept), +1.6 (A<0: clip(e^-0.5)=0.8, min picks -1.6)
    assert loss.item() == pytest.approx((-1.2 - math.exp(-0.1) + 1.6) / 3, rel=1e-6)
    assert (metrics["tokens"], metrics["clip_high"], metrics["clip_low"], metrics["tis_truncated"]) == (3, 1, 1, 0)
    assert metrics["ratio"] == pytest.approx(math.exp(0.5) + math.exp(-0.1) + math.exp(-0.5), rel=1e-6)
    assert metrics["ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)
    assert metrics["logprob_mismatch"] == 0 and metrics["behaviour_kl"] == 0 and metrics["behaviour_weight"] == 3
    loss.backward()
    # clipped and masked tokens get no gradient; the kept token gets -A r / loss_tokens
    assert new.grad[0, 1].item() == pytest.approx(-math.exp(-0.1) / 3, rel=1e-6)
    assert new.grad[0, 0] == 0 and new.grad[1, 0] == 0 and new.grad[0, 2] == 0 and new.grad[1, 1] == 0


# The step's first update (no old_logprobs): pi_old is the policy itself, so the policy ratio is 1.
# The generator's logprobs differ (numerics): weights e^0.3 and e^-0.7 on sequence 0, e^-0.5 on 1.
FIRST = ([[-0.5, -0.3, 7.0], [-1.0, 7.0, 7.0]], MASK, [1.0, -2.0])
FIRST_NEW = [[-0.2, -1.0, 3.0], [-1.5, 3.0, 3.0]]


@pytest.mark.parametrize("name", LOSSES)
def test_first_update_of_a_step_clips_nothing_whatever_the_generator_mismatch(name):
    new = torch.tensor(FIRST_NEW, requires_grad=True)
    loss, metrics = loss_of(name, new, batch(*FIRST))
    assert metrics["clip_low"] == metrics["clip_high"] == 0
    assert metrics["ratio"] == 3 and metrics["ratio_max"] == 1  # exactly 1 on every loss token
    assert metrics["logprob_mismatch"] == pytest.approx(0.3 + 0.7 + 0.5, rel=1e-6)
    weights = [math.exp(0.3), math.exp(-0.7), math.exp(-0.5)]
    assert metrics["behaviour_weight"] == pytest.approx(sum(weights), rel=1e-6)
    # k3 estimate of KL(behaviour || old): w - 1 - log w per token
    assert metrics["behaviour_kl"] == pytest.approx(sum(w - 1 - math.log(w) for w in weights), rel=1e-5)
    loss.backward()
    if name == "gspo":  # seq_mean: sequence 0's two tokens share its 1/2 of the loss
        assert loss.item() == pytest.approx((-(weights[0] + weights[1]) / 2 + 2 * weights[2]) / 2, rel=1e-6)
        return
    if name == "cispo":  # -A w r.detach() logp: the same gradient, a different value
        assert loss.item() == pytest.approx((0.2 * weights[0] + weights[1] - 3 * weights[2]) / 3, rel=1e-6)
    else:  # -A w r with r = 1
        assert loss.item() == pytest.approx((-weights[0] - weights[1] + 2 * weights[2]) / 3, rel=1e-6)
    # the gradient is -A w per token / loss_tokens: the weight scales it, nothing clips it
    assert new.grad.flatten().tolist() == pytest.approx(
        [-weights[0] / 3, -weights[1] / 3, 0.0, 2 * weights[2] / 3, 0.0, 0.0], rel=1e-6)


def test_later_update_clips_the_policy_ratio_and_weights_by_the_behaviour_ratio():
    # pi_old (before the step's first update) 0, 0; the policy moved to 0.1, 0.5; the generator had -0.2, 0.3
    new = torch.tensor([[0.1, 0.5, 9.0]], requires_grad=True)
    b = batch([[-0.2, 0.3, 0.0]], [[True, True, False]], [1.0], old=[[0.0, 0.0, -9.0]])
    loss, metrics = loss_of("ppo_clip", new, b, clip_eps=0.2)
    w = [math.exp(0.2), math.exp(-0.3)]
    # token 0: r = e^0.1 kept; token 1: r = e^0.5 clipped to 1.2 (A > 0); each times its weight
    assert loss.item() == pytest.approx(-(w[0] * math.exp(0.1) + w[1] * 1.2) / 2, rel=1e-6)
    assert (metrics["clip_high"], metrics["clip_low"]) == (1, 0)
    assert metrics["logprob_mismatch"] == pytest.approx(0.5, rel=1e-6)  # |pi_old - behaviour|, not |new - behaviour|
    loss.backward()
    assert new.grad.tolist()[0] == pytest.approx([-w[0] * math.exp(0.1) / 2, 0.0, 0.0], rel=1e-6)


def test_stale_episode_weight_is_truncated_per_token_or_per_sequence():
    # A stale episode: the generator's old policy gave these tokens logprobs -1.0 and -0.1, the
    # trainer's pi_old gives 0: weights e^1 = 2.72 (over the cap of 2) and e^0.1
    b = batch([[-1.0, -0.1, 5.0]], [[True, True, False]], [1.0])
    new = torch.tensor([[0.0, 0.0, 1.0]], requires_grad=True)
    loss, metrics = loss_of("ppo_clip", new, b, tis_cap=2.0)
    assert loss.item() == pytest.approx(-(2.0 + math.exp(0.1)) / 2, rel=1e-6)
    assert metrics["tis_truncated"] == 1 and metrics["behaviour_weight"] == pytest.approx(math.e + math.exp(0.1))
    loss.backward()
    # truncation caps the (detached) weight; the token keeps its gradient through the policy ratio
    assert new.grad.tolist()[0] == pytest.approx([-2.0 / 2, -math.exp(0.1) / 2, 0.0], rel=1e-6)

    uncapped, metrics = loss_of("ppo_clip", new, b, tis_cap=0.0)
    assert uncapped.item() == pytest.approx(-(math.e + math.exp(0.1)) / 2, rel=1e-6)
    assert metrics["tis_truncated"] == 0

    # per sequence: one weight e^(1 + 0.1) = 3.0 for the whole sequence, truncated to 2 on both tokens
    seq, metrics = loss_of("ppo_clip", new, b, tis_cap=2.0, tis_level="sequence")
    assert seq.item() == pytest.approx(-2.0, rel=1e-6)
    assert metrics["tis_truncated"] == 2 and metrics["behaviour_weight"] == pytest.approx(2 * math.exp(1.1))
    # a short sequence under the cap keeps its product: e^(-0.3 + 0.1)
    short, _ = loss_of("ppo_clip", new, batch([[0.3, -0.1, 0.0]], [[True, True, False]], [1.0]),
                       tis_level="sequence")
    assert short.item() == pytest.approx(-math.exp(-0.2), rel=1e-6)


def test_dapo_clips_higher_above_than_below():
    new = torch.tensor([[0.25, -0.5]], requires_grad=True)  # ratios e^0.25 = 1.284 and e^-0.5 = 0.607
    b = batch([[0.0, 0.0]], [[True, True]], [1.0], old=[[0.0, 0.0]])
    loss, metrics = loss_of("dapo", new, b, clip_eps_low=0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-(1.28 + math.exp(-0.5)) / 2, rel=1e-6)  # high clip 1.28, not 1.2
    assert (metrics["clip_high"], metrics["clip_low"]) == (1, 0)  # A>0: a low ratio is not clipped
    symmetric, _ = loss_of("ppo_clip", new, b, clip_eps=0.2)
    assert symmetric.item() == pytest.approx(-(1.2 + math.exp(-0.5)) / 2, rel=1e-6)


def test_gspo_uses_one_length_normalised_ratio_per_sequence():
    # sequence 0: log ratios 0.5, -0.1 -> sequence ratio e^0.2, clipped to 1.0004 (A>0)
    # sequence 1: one token, log ratio -0.5 -> e^-0.5, A=-2 -> min(-2 e^-0.5, -2 * 0.9997) = -2 * 0.9997
    new = torch.tensor(NEW, requires_grad=True)
    loss, metrics = loss_of("gspo", new, batch(*B, old=OLD))
    seq0, seq1 = -1.0004, 2 * (1 - 3e-4)
    assert loss.item() == pytest.approx((seq0 + seq1) / 2, rel=1e-6)  # mean over sequences
    assert metrics["clip_high"] == 2 and metrics["clip_low"] == 1  # clipping is per sequence, counted per token
    # an unclipped sequence: every token gets d/dlogp of -A exp(mean log r) = -A s / len, over 1 sequence
    near = torch.tensor([[1e-4, 0.0]], requires_grad=True)
    loss, _ = loss_of("gspo", near, batch([[0.0, 0.0]], [[True, True]], [1.0], old=[[0.0, 0.0]]))
    loss.backward()
    assert near.grad.tolist()[0] == pytest.approx([-math.exp(5e-5) / 2] * 2, rel=1e-5)


def test_cispo_keeps_a_gradient_for_every_token_through_a_bounded_ratio():
    new = torch.tensor([[0.5, -0.1]], requires_grad=True)  # ratios 1.649 (bounded to 1.28), 0.905
    b = batch([[0.0, 0.0]], [[True, True]], [1.0], old=[[0.0, 0.0]])
    loss, metrics = loss_of("cispo", new, b, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-(1.28 * 0.5 + math.exp(-0.1) * -0.1) / 2, rel=1e-6)
    loss.backward()
    assert new.grad.tolist()[0] == pytest.approx([-1.28 / 2, -math.exp(-0.1) / 2], rel=1e-6)
    assert metrics["clip_high"] == 1


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


def test_unknown_loss_and_tis_level_are_errors():
    with pytest.raises(ValueError, match="unknown trainer.loss.name 'ppo2'"):
        check(LossConfig(name="ppo2"))
    with pytest.raises(ValueError, match="unknown trainer.loss.tis_level 'batch'"):
        check(LossConfig(tis_level="batch"))
