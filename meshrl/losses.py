"""Policy losses, chosen by name (`trainer.loss`), and how per-token terms become one number.

All of them weigh tokens by the importance ratio r = pi_theta / pi_behaviour against the
generator's logprobs, truncated at `tis_cap` when it is set (truncated importance sampling), so
stale (off-policy) episodes are corrected the same way whichever loss is chosen. Every loss is a
sum over a micro-batch divided by a normaliser of the whole optimizer step, so micro-batches add
up to the step's loss. Metrics are sums over loss tokens (the controller divides).
"""

import torch

from meshrl.configs import LossConfig
from meshrl.types import TrainBatch


def aggregate(per_token: torch.Tensor, batch: TrainBatch, how: str, constant_norm: int) -> torch.Tensor:
    """Reduce masked per-token terms [B, T] to this micro-batch's share of the step's loss."""
    mask = batch.loss_mask
    if how == "token_mean":  # every token of the step weighs the same (DAPO's token-level loss)
        return (per_token * mask).sum() / batch.loss_tokens
    if how == "seq_mean":  # every sequence weighs the same: GRPO's original mean of per-sequence means
        lengths = mask.sum(-1).clamp(min=1)
        return ((per_token * mask).sum(-1) / lengths).sum() / batch.loss_sequences
    if how == "constant":  # Dr. GRPO: a constant normaliser, no length bias
        return (per_token * mask).sum() / (batch.loss_sequences * constant_norm)
    raise ValueError(f"unknown loss aggregation {how!r}: token_mean, seq_mean or constant")


def _ratio(logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    log_ratio = torch.where(batch.loss_mask, logprobs - batch.behaviour_logprobs, 0.0)
    return log_ratio, torch.exp(log_ratio)


def _truncate(ratio: torch.Tensor, cap: float) -> torch.Tensor:
    return ratio.clamp(max=cap) if cap > 0 else ratio


def _clipped_surrogate(ratio: torch.Tensor, batch: TrainBatch, tis_cap: float, low: float, high: float):
    """PPO's pessimistic surrogate -min(w A, clip(w) A) on the truncated ratio w: the per-token loss,
    the ratio, and where the clip decided it."""
    weight = _truncate(ratio, tis_cap)
    advantages = batch.advantages.unsqueeze(-1)
    unclipped = weight * advantages
    clipped = weight.clamp(1 - low, 1 + high) * advantages
    return -torch.minimum(unclipped, clipped), ratio, clipped < unclipped


def ppo_clip(logprobs, batch, cfg: LossConfig):
    """PPO-clip (Schulman et al. 2017) per token, symmetric epsilon."""
    return _clipped_surrogate(_ratio(logprobs, batch)[1], batch, cfg.tis_cap, cfg.clip_eps, cfg.clip_eps)


def dapo(logprobs, batch, cfg: LossConfig):
    """DAPO (Yu et al. 2025): clip-higher, a wider upper than lower clip range (use token_mean)."""
    return _clipped_surrogate(_ratio(logprobs, batch)[1], batch, cfg.tis_cap, cfg.clip_eps_low, cfg.clip_eps_high)


def gspo(logprobs, batch, cfg: LossConfig):
    """GSPO (Zheng et al. 2025): one length-normalised ratio per sequence, clipped per sequence.

    The sequence's ratio exp(mean_t log r_t) is given to each of its tokens, and seq_mean then
    averages per-sequence losses, as the paper does."""
    log_ratio, _ = _ratio(logprobs, batch)
    lengths = batch.loss_mask.sum(-1, keepdim=True).clamp(min=1)
    seq_ratio = torch.exp(log_ratio.sum(-1, keepdim=True) / lengths).expand_as(log_ratio)
    return _clipped_surrogate(seq_ratio, batch, cfg.tis_cap, cfg.gspo_clip_eps_low, cfg.gspo_clip_eps_high)


def cispo(logprobs, batch, cfg: LossConfig):
    """CISPO (MiniMax 2025): a clipped, stop-gradient importance weight times the logprob, so every
    token keeps a gradient (PPO's clip drops clipped tokens' gradients entirely)."""
    _, ratio = _ratio(logprobs, batch)
    weight = _truncate(ratio.clamp(max=1 + cfg.clip_eps_high), cfg.tis_cap).detach()
    per_token = -weight * batch.advantages.unsqueeze(-1) * logprobs
    return per_token, ratio, (ratio > 1 + cfg.clip_eps_high)


LOSSES = {"ppo_clip": ppo_clip, "dapo": dapo, "gspo": gspo, "cispo": cispo}
AGGREGATIONS = ("token_mean", "seq_mean", "constant")


def check(cfg: LossConfig) -> None:
    """Unknown names fail before any actor starts."""
    if cfg.name not in LOSSES:
        raise ValueError(f"unknown loss {cfg.name!r}; known: {', '.join(LOSSES)}")
    if cfg.aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {cfg.aggregation!r}; known: {', '.join(AGGREGATIONS)}")


def policy_loss(logprobs: torch.Tensor, batch: TrainBatch, cfg: LossConfig,
                entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The loss `cfg.name` plus the optional KL penalty and entropy bonus, with its metrics.

    `entropy` is the per-token entropy of the policy (with its gradient when entropy_coef > 0)."""
    mask = batch.loss_mask
    per_token, ratio, clip_active = LOSSES[cfg.name](logprobs, batch, cfg)
    how = "seq_mean" if cfg.name == "gspo" else cfg.aggregation
    loss = aggregate(per_token, batch, how, cfg.constant_norm)
    metrics = {}
    if cfg.kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference logprobs in the batch")
        delta = batch.ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
        loss = loss + cfg.kl_coef * aggregate(kl, batch, how, cfg.constant_norm)
        metrics["kl"] = float((kl.detach() * mask).sum())
    if entropy is not None:
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate(entropy, batch, how, cfg.constant_norm)
        metrics["entropy"] = float((entropy.detach() * mask).sum())
    with torch.no_grad():
        log_ratio = torch.where(mask, logprobs - batch.behaviour_logprobs, 0.0)
        metrics |= {
            "loss": loss.item(),
            "tokens": int(mask.sum()),
            "logprob_mismatch": float((log_ratio.abs() * mask).sum()),
            "ratio": float((ratio * mask).sum()),
            "ratio_max": float(ratio[mask].max()) if mask.any() else 0.0,
            "clip_low": int((clip_active & mask & (ratio < 1)).sum()),
            "clip_high": int((clip_active & mask & (ratio > 1)).sum()),
            "tis_truncated": int(((ratio > cfg.tis_cap) & mask).sum()) if cfg.tis_cap > 0 else 0,
        }
    return loss, metrics


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at every position, in float32."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of the next-token distribution at every position, in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def response_logits(model, batch: TrainBatch) -> torch.Tensor:
    """Logits [N, V] at the batch's N loss positions only: the LM head (a fifth of SmolLM2's weights)
    and the log-softmax over the vocabulary skip the prompt positions. `model` is a policy from
    `model.load_policy`, whose forward stops before the LM head."""
    return model.lm_head(model(batch.input_ids)[batch.loss_mask])


def on_positions(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-position values [N] back to [B, T], zero off the mask (differentiable)."""
    return torch.zeros(mask.shape, dtype=values.dtype).masked_scatter(mask, values)


def policy_logprobs(model, batch: TrainBatch, bf16_autocast: bool) -> torch.Tensor:
    """`model`'s logprob of every loss token [B, T] (0 elsewhere), without building a graph."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
        logits = response_logits(model, batch)
    return on_positions(token_logprobs(logits, batch.target_ids[batch.loss_mask]), batch.loss_mask)
