"""Logprobs one sequence at a time, each at its own length: what makes a generator's behaviour logprobs equal
to the trainer's recomputation bit for bit (`generator.exact`).

A matrix product's rounding may depend on its shapes (how many rows it multiplies at once, how its kernel
blocks them), so the same sequence scored inside two different batches, or padded to two lengths, can differ
in its last bits. Here every sequence is scored alone: a forward of [1, L] (L its tokens but the last), the LM
head and the log-softmax over its loss positions, `EXACT_CHUNK_TOKENS` at a time, in the trainer's autocast
rule (meshrl/losses.py's `policy_terms`). The trainer scores its micro-batches row by row with it
(`trainer.per_sequence`, which generator.exact turns on) and the torch generator re-scores each completion
with it (meshrl/actors/torch_generator.py), on the same weights in the same dtype: the same operations on
the same shapes, hence the same bits. It costs the trainer its batching (docs/performance.md)."""

import torch

from meshrl.losses import policy_terms
from meshrl.models.memory import DEFAULT_CHUNK_TOKENS
from meshrl.types import TrainBatch

EXACT_CHUNK_TOKENS = DEFAULT_CHUNK_TOKENS  # the LM head this many positions at a time, on both sides


def per_sequence_terms(model, batch: TrainBatch, bf16_autocast: bool,
                       entropy: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`policy_terms` of `batch` [B, T], one row at a time, each cut after its last loss position (a row
    without one is 0 throughout); differentiable as `policy_terms` is."""
    logprobs, values = [], []
    width = batch.loss_mask.shape[1]
    for b in range(batch.loss_mask.shape[0]):
        positions = batch.loss_mask[b].nonzero()
        if len(positions) == 0:
            logprobs.append(torch.zeros((1, width), device=batch.loss_mask.device))
            values.append(torch.zeros((1, width), device=batch.loss_mask.device))
            continue
        end = int(positions[-1]) + 1
        row = TrainBatch(batch.input_ids[b:b + 1, :end], batch.target_ids[b:b + 1, :end],
                         batch.loss_mask[b:b + 1, :end], None, None, 0, 0,
                         temperature=None if batch.temperature is None else batch.temperature[b:b + 1])
        lp, value = policy_terms(model, row, bf16_autocast, EXACT_CHUNK_TOKENS, entropy)
        logprobs.append(torch.nn.functional.pad(lp, (0, width - end)))
        if value is not None:
            values.append(torch.nn.functional.pad(value, (0, width - end)))
    return torch.cat(logprobs), (torch.cat(values) if entropy is not None else None)


def sequence_logprobs(model, tokens: list[int], prompt_tokens: int, temperature: float,
                      bf16_autocast: bool) -> list[float]:
    """The logprob of each of `tokens`' tokens after its first `prompt_tokens` under `model` at `temperature`,
    as the trainer computes them with `per_sequence_terms` (its collate: inputs the tokens but the last, targets
    shifted by one, float32 temperature), without a graph."""
    device = next(model.parameters()).device
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    mask = torch.arange(len(tokens) - 1, device=device) >= prompt_tokens - 1
    row = TrainBatch(ids[None, :-1], ids[None, 1:], mask[None], None, None, 0, 0,
                     temperature=torch.tensor([temperature], dtype=torch.float32))
    with torch.no_grad():
        logprobs, _ = per_sequence_terms(model, row, bf16_autocast)
    return logprobs[0, prompt_tokens - 1:].tolist()
