"""Policy losses, chosen by name (`trainer.loss`), and how per-token terms become one number.

Two ratios, two jobs (decoupled PPO, as verl's old_log_prob + rollout correction and AReaL do):
- the policy ratio r = pi_theta / pi_old, where pi_old is the trainer's own policy at the start of
  the step's first update. Each loss clips (CISPO: bounds) r only, so the clip limits how far this
  step moves the policy; with one update per step r is exactly 1 and nothing clips.
- the behaviour weight w = pi_old / pi_behaviour against the generator's logprobs, per token or
  per sequence, truncated at `tis_cap` and detached: it corrects the generator's numerics and
  staleness, and multiplies each loss's per-token term.
Every loss is a sum over a micro-batch divided by a normaliser of the whole update, so micro-batches
add up to the update's loss. Metrics are sums over loss tokens (the caller divides).
"""

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from meshrl.actors import has_bf16_math
from meshrl.models.memory import DEFAULT_CHUNK_TOKENS
from meshrl.types import TrainBatch


@dataclass
class LossConfig:
    """The policy loss (`trainer.loss`; the table in docs/training.md). Each loss clips the ratio to the
    trainer's own pi_old and is weighted by pi_old / pi_behaviour, truncated at tis_cap."""

    name: str = "ppo_clip"  # ppo_clip | dapo | gspo | cispo
    clip_eps: float = 0.2  # ppo_clip: symmetric clip range of the ratio
    clip_eps_low: float = 0.2  # dapo: lower clip range
    clip_eps_high: float = 0.28  # dapo (clip-higher) and cispo (upper bound of the ratio)
    gspo_clip_eps_low: float = 3e-4  # gspo clips the sequence ratio, which stays close to 1
    gspo_clip_eps_high: float = 4e-4  # gspo: upper clip range of the sequence ratio
    tis_cap: float = 2.0  # truncate the behaviour weight pi_old / pi_behaviour here (0: not truncated)
    tis_level: str = "token"  # the behaviour weight per token | sequence (the product over its tokens)
    aggregation: str = "token_mean"  # token_mean | seq_mean | constant (Dr. GRPO); gspo is always seq_mean
    constant_norm: int = 0  # aggregation=constant: the tokens per sequence to divide by; 0: generator.max_tokens, the most a sequence has (filled in by meshrl.configs.resolve)
    kl_coef: float = 0.0  # k3 KL penalty to the frozen reference model (starts a ReferenceModel actor)
    entropy_coef: float = 0.0  # entropy bonus

    def check(self) -> None:
        check(self)


def aggregate(per_token: torch.Tensor, batch: TrainBatch, how: str, constant_norm: int) -> torch.Tensor:
    """Reduce masked per-token terms [B, T] to this micro-batch's share of the update's loss."""
    mask = batch.loss_mask
    if how == "token_mean":  # every token of the update weighs the same (DAPO's token-level loss)
        return (per_token * mask).sum() / batch.loss_tokens
    if how == "seq_mean":  # every sequence weighs the same: GRPO's original mean of per-sequence means
        lengths = mask.sum(-1).clamp(min=1)
        return ((per_token * mask).sum(-1) / lengths).sum() / batch.loss_sequences
    if how == "constant":  # Dr. GRPO: a constant normaliser, no length bias
        if constant_norm < 1:
            raise ValueError("trainer.loss.constant_norm is not filled in: meshrl.configs.resolve sets it to "
                             "generator.max_tokens")
        return (per_token * mask).sum() / (batch.loss_sequences * constant_norm)
    raise ValueError(f"unknown loss aggregation {how!r}: token_mean, seq_mean or constant")


def log_ratios(logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """log(pi_theta / pi_old) with its gradient, and the detached log(pi_old / pi_behaviour); 0 off the mask.

    Without `batch.old_logprobs` this is the step's first update: pi_old is pi_theta itself, detached."""
    mask = batch.loss_mask
    old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs
    return (torch.where(mask, logprobs - old, 0.0),
            torch.where(mask, old - batch.behaviour_logprobs, 0.0))


def behaviour_weight(log_w: torch.Tensor, mask: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The behaviour weight per token [B, T] before truncation, and after it (what the loss applies).

    "token": each token's own pi_old / pi_behaviour. "sequence": the product over the sequence's
    tokens, given to each of them (the sequence's likelihood ratio; truncated as one number)."""
    if cfg.tis_level == "sequence":
        log_w = torch.where(mask, log_w.sum(-1, keepdim=True), 0.0)
    weight = torch.exp(log_w)
    return weight, (weight.clamp(max=cfg.tis_cap) if cfg.tis_cap > 0 else weight)


def _clipped_surrogate(ratio: torch.Tensor, batch: TrainBatch, low: float, high: float):
    """PPO's pessimistic surrogate -min(r A, clip(r) A): the per-token loss, the ratio, and where the
    clip decided it."""
    advantages = batch.advantages.unsqueeze(-1)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - low, 1 + high) * advantages
    return -torch.minimum(unclipped, clipped), ratio, clipped < unclipped


def ppo_clip(logprobs, log_ratio, batch, cfg: LossConfig):
    """PPO-clip (Schulman et al. 2017) per token, symmetric epsilon."""
    return _clipped_surrogate(torch.exp(log_ratio), batch, cfg.clip_eps, cfg.clip_eps)


def dapo(logprobs, log_ratio, batch, cfg: LossConfig):
    """DAPO (Yu et al. 2025): clip-higher, a wider upper than lower clip range (use token_mean)."""
    return _clipped_surrogate(torch.exp(log_ratio), batch, cfg.clip_eps_low, cfg.clip_eps_high)


def gspo(logprobs, log_ratio, batch, cfg: LossConfig):
    """GSPO (Zheng et al. 2025): one length-normalised ratio per sequence, clipped per sequence.

    The sequence's ratio exp(mean_t log r_t) is given to each of its tokens, and seq_mean then
    averages per-sequence losses, as the paper does."""
    lengths = batch.loss_mask.sum(-1, keepdim=True).clamp(min=1)
    seq_ratio = torch.exp(log_ratio.sum(-1, keepdim=True) / lengths).expand_as(log_ratio)
    return _clipped_surrogate(seq_ratio, batch, cfg.gspo_clip_eps_low, cfg.gspo_clip_eps_high)


def cispo(logprobs, log_ratio, batch, cfg: LossConfig):
    """CISPO (MiniMax 2025): a bounded, stop-gradient ratio times the logprob, so every token keeps a
    gradient (PPO's clip drops clipped tokens' gradients entirely)."""
    ratio = torch.exp(log_ratio)
    per_token = -ratio.clamp(max=1 + cfg.clip_eps_high).detach() * batch.advantages.unsqueeze(-1) * logprobs
    return per_token, ratio, ratio > 1 + cfg.clip_eps_high


LOSSES = {"ppo_clip": ppo_clip, "dapo": dapo, "gspo": gspo, "cispo": cispo}
AGGREGATIONS = ("token_mean", "seq_mean", "constant")
TIS_LEVELS = ("token", "sequence")


def check(cfg: LossConfig) -> None:
    """Unknown names fail before any actor starts (the menus above are the only list of them)."""
    for what, value, known in (("trainer.loss.name", cfg.name, LOSSES),
                               ("trainer.loss.aggregation", cfg.aggregation, AGGREGATIONS),
                               ("trainer.loss.tis_level", cfg.tis_level, TIS_LEVELS)):
        if value not in known:
            raise ValueError(f"unknown {what} {value!r}; known: {', '.join(known)}")
    if cfg.constant_norm < 0:
        raise ValueError(f"trainer.loss.constant_norm must be at least 0 (0: generator.max_tokens), not {cfg.constant_norm}")


def policy_loss(logprobs: torch.Tensor, batch: TrainBatch, cfg: LossConfig,
                entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The loss `cfg.name`, weighted by the truncated behaviour weight, plus the optional KL penalty and
    entropy bonus, with its metrics.

    `entropy` is the per-token entropy of the policy (with its gradient when entropy_coef > 0)."""
    mask = batch.loss_mask
    log_ratio, log_w = log_ratios(logprobs, batch)
    per_token, ratio, clip_active = LOSSES[cfg.name](logprobs, log_ratio, batch, cfg)
    raw_weight, weight = behaviour_weight(log_w, mask, cfg)
    how = "seq_mean" if cfg.name == "gspo" else cfg.aggregation
    loss = aggregate(per_token * weight, batch, how, cfg.constant_norm)
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
        ratio = ratio.detach()
        token_w = torch.exp(log_w)
        metrics |= {
            "loss": loss.item(),
            "tokens": int(mask.sum()),
            "logprob_mismatch": float((log_w.abs() * mask).sum()),
            "ratio": float((ratio * mask).sum()),
            "ratio_max": float(ratio[mask].max()) if mask.any() else 0.0,
            "clip_low": int((clip_active & mask & (ratio < 1)).sum()),
            "clip_high": int((clip_active & mask & (ratio > 1)).sum()),
            "behaviour_weight": float((raw_weight * mask).sum()),
            "tis_truncated": int(((raw_weight > cfg.tis_cap) & mask).sum()) if cfg.tis_cap > 0 else 0,
            # k3 estimate of KL(pi_behaviour || pi_old) from the behaviour policy's own samples
            "behaviour_kl": float(((token_w - 1 - log_w) * mask).sum()),
        }
    return loss, metrics


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at every position, in float32."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor, rows: int = 8) -> torch.Tensor:
    """The entropy of the next-token distribution at every position, in float32: logsumexp - E_p[logit].

    As a metric (no gradient) it goes `rows` positions at a time, so that its temporaries stay in
    cache: a quarter of the time of one pass over the whole [positions, vocabulary] (133 -> 32 ms for
    768 positions of SmolLM2's 49k vocabulary on 2 CPU cores), about 1% of a training step."""
    if torch.is_grad_enabled() and logits.requires_grad:  # the entropy bonus: differentiable, whole
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -(logp.exp() * logp).sum(-1)
    out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], rows):
        chunk = logits[start:start + rows].float()
        lse = torch.logsumexp(chunk, dim=-1, keepdim=True)
        out[start:start + rows] = lse.squeeze(-1) - torch.linalg.vecdot((chunk - lse).exp_(), chunk)
    return out


def response_hidden(model, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The final hidden states [N, D] at the batch's N loss positions only, and each position's sampling
    temperature [N] (float32; None where every sequence was sampled at 1). `model` is a policy from
    `model.load_policy`, whose forward stops before the LM head."""
    mask = batch.loss_mask
    hidden = model(batch.input_ids)[mask]
    if batch.temperature is None or bool((batch.temperature == 1).all()):
        return hidden, None
    return hidden, batch.temperature.to(hidden.device).float().unsqueeze(-1).expand(mask.shape)[mask]


def response_logits(model, batch: TrainBatch) -> torch.Tensor:
    """Logits [N, V] at the batch's N loss positions only, divided by each sequence's sampling
    temperature: those of the distribution its tokens were drawn from (float32 then). The LM head (a
    fifth of SmolLM2's weights) and the log-softmax over the vocabulary skip the prompt positions.
    All N positions at once: the trainer goes `chunk_tokens` at a time instead (`head_terms`)."""
    hidden, temperature = response_hidden(model, batch)
    logits = model.lm_head(hidden)
    return logits if temperature is None else logits.float() / temperature.unsqueeze(-1)


def _head_terms(head, hidden, targets, temperature, bf16: bool, entropy: str | None):
    """log p(target) [n] and the entropy [n] (or None) of n positions from their hidden states: the
    LM head in autocast, the rest in float32."""
    with autocast(hidden.device, bf16):
        logits = head(hidden)
    logits = logits.float()
    if temperature is not None:
        logits = logits / temperature.unsqueeze(-1)
    logprobs = token_logprobs(logits, targets)
    if entropy is None:
        return logprobs, None
    # the bonus differentiable, over the whole chunk; a metric rows at a time, no graph (token_entropy)
    return logprobs, token_entropy(logits if entropy == "bonus" else logits.detach())


def head_terms(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor | None, bf16: bool,
               chunk_tokens: int, entropy: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) [N] and the entropy [N] (None without `entropy`: "metric", no gradient; "bonus",
    with its gradient) from the hidden states [N, D] at N positions, `chunk_tokens` positions at a time
    (0: all at once). With a gradient each chunk is checkpointed (torch.utils.checkpoint): its logits are
    freed once its logprobs are taken and computed again in the backward, so the logits of one chunk
    exist at a time, never [N, vocabulary] in float32 (7.5 GB at 8k tokens of Qwen3's 152k vocabulary),
    for a second pass of the LM head's matrix product."""
    n = hidden.shape[0]
    if chunk_tokens <= 0 or n == 0:
        return _head_terms(head, hidden, targets, temperature, bf16, entropy)
    parts = []
    for start in range(0, n, chunk_tokens):
        part = slice(start, start + chunk_tokens)
        args = (head, hidden[part], targets[part], None if temperature is None else temperature[part], bf16, entropy)
        if torch.is_grad_enabled():
            parts.append(checkpoint(_head_terms, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(_head_terms(*args))
    return (torch.cat([p[0] for p in parts]),
            None if entropy is None else torch.cat([p[1] for p in parts]))


def policy_terms(model, batch: TrainBatch, bf16_autocast: bool, chunk_tokens: int,
                 entropy: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`model`'s logprob of every loss token [B, T] and (with `entropy`) its entropy there [B, T], 0
    elsewhere: the forward in bf16 autocast (where the device has bf16 math), the LM head and the
    log-softmax `chunk_tokens` positions at a time (`head_terms`)."""
    mask = batch.loss_mask
    with autocast(batch.input_ids.device, bf16_autocast):
        hidden, temperature = response_hidden(model, batch)
    logprobs, values = head_terms(model.lm_head, hidden, batch.target_ids[mask], temperature, bf16_autocast,
                                  chunk_tokens, entropy)
    return on_positions(logprobs, mask), None if values is None else on_positions(values, mask)


def on_positions(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-position values [N] back to [B, T], zero off the mask (differentiable)."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def policy_logprobs(model, batch: TrainBatch, bf16_autocast: bool,
                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """`model`'s logprob of every loss token [B, T] (0 elsewhere), without building a graph."""
    with torch.no_grad():
        return policy_terms(model, batch, bf16_autocast, chunk_tokens)[0]


def bf16_compute(device: torch.device, bf16: bool) -> bool:
    """Whether a forward asked for bf16 autocast (`bf16`) runs in it on `device`: where it has bf16 math."""
    return bf16 and has_bf16_math(device)


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on the device the tensors live on where it has bf16 math, else none (fp32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16_compute(device, bf16))

