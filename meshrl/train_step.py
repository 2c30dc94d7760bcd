"""One training step: the episodes of one batch become optimizer updates on the trainer.

The replay buffer (meshrl/actors/replay_buffer.py) composes the batch and cuts it with the rules here;
the controller (and a restart that trains logged batches again) drives the trainer through it with
`train_updates`, naming each micro-batch by a `BatchRef`, and every rank takes its own from the buffer.
The step's episodes are split into `trainer.mini_batches` mini-batches, each one optimizer update,
each fed to the trainer in micro-batches whose losses add up to the mini-batch's: of
`trainer.micro_batch_size` sequences in order, or with `trainer.micro_batch_tokens` as many sequences
as fit in that many padded positions, sorted by length so that a micro-batch's sequences are alike.
Every update clips its ratio against pi_old, the trainer's policy at the start of the step: the first
update takes it from its own forward pass (detached), the later ones get it from one no-grad pass over
their micro-batches before the first update.

Each rank gets its share of an update's micro-batches in one call (`forward_backward(refs)`, as the
pi_old and reference passes get theirs): one message per rank per update, not one per micro-batch. The
micro-batches are dealt in rounds, one per rank, every rank the same number (a sharded model's
collectives need them all): a round short of micro-batches is filled with a copy that trains nothing (no
loss token), whose metrics add nothing. A call's timeout is its role's per micro-batch, times its share.
"""

import asyncio
import dataclasses
import math
import weakref
from collections import defaultdict

from meshrl.actors import first
from meshrl.actors.timeouts import Timeout, Timeouts
from meshrl.actors.trace import no_span
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.types import BatchRef, Episode


def split(episodes: list, parts: int) -> list[list]:
    """`episodes` in at most `parts` consecutive chunks of nearly equal size; one empty chunk if none."""
    if not episodes:
        return [[]]
    size, extra = divmod(len(episodes), min(parts, len(episodes)))
    chunks, start = [], 0
    for i in range(min(parts, len(episodes))):
        end = start + size + (i < extra)
        chunks.append(episodes[start:end])
        start = end
    return chunks


def micro_batches(episodes: list[Episode], size: int, max_tokens: int = 0) -> list[tuple[list[Episode], int, int]]:
    """One mini-batch's micro-batches (`micro_groups`), each with the normalisers of the whole mini-batch, as
    the replay buffer keeps them until a rank asks (then `TrainBatch.collate(*micro, pad_id)`): (its episodes,
    the mini-batch's loss tokens, its sequences)."""
    loss_tokens = sum(e.num_response_tokens for e in episodes)
    return [(group, loss_tokens, len(episodes)) for group in micro_groups(episodes, size, max_tokens)]


def micro_groups(episodes: list[Episode], size: int, max_tokens: int = 0) -> list[list[Episode]]:
    """One mini-batch's episodes in micro-batches: `size` sequences each, or (`max_tokens` > 0) as many as
    fit in that many padded positions."""
    if max_tokens > 0:
        return by_tokens(episodes, max_tokens)
    return [episodes[i:i + size] for i in range(0, len(episodes), size)]


def by_tokens(episodes: list[Episode], max_tokens: int) -> list[list[Episode]]:
    """Sequences longest first, each micro-batch filled while its padded size (sequences x the longest,
    the first) stays within `max_tokens`: neighbours in length share a micro-batch, so padding is small.
    A sequence longer than the budget is a micro-batch of its own."""
    groups: list[list[Episode]] = []
    for e in sorted(episodes, key=lambda e: len(e.tokens), reverse=True):
        if groups and (len(groups[-1]) + 1) * (len(groups[-1][0].tokens) - 1) <= max_tokens:
            groups[-1].append(e)
        else:
            groups.append([e])
    return groups


def padding_fraction(episodes: list[Episode], micro: list[list[Episode]]) -> float:
    """The share of the positions that `episodes`' micro-batches (`micro`, as `micro_groups` makes them)
    compute that are padding: each collates to its sequences x its longest less one."""
    positions = sum(len(group) * (max(len(e.tokens) for e in group) - 1) for group in micro)
    return 1 - sum(len(e.tokens) - 1 for e in episodes) / max(positions, 1)


def rounds(refs: list[BatchRef], ranks: int) -> list[list[BatchRef]]:
    """`refs` in rounds of `ranks`, the last filled up with the same micro-batch `idle` (no loss token)."""
    out = [refs[i:i + ranks] for i in range(0, len(refs), ranks)]
    if out and len(out[-1]) < ranks:
        out[-1] += [dataclasses.replace(out[-1][0], idle=True)] * (ranks - len(out[-1]))
    return out


def dealt(refs: list[BatchRef], ranks: int) -> list[list[BatchRef]]:
    """Each rank's share of `refs`: rank r takes the r-th of every round (`rounds`)."""
    out = rounds(refs, ranks)
    return [[round_[r] for round_ in out] for r in range(ranks)]


def per_micro_batch(timeout: Timeout | None, micro_batches: int) -> Timeout | None:
    """A role's timeout for one call over `micro_batches` micro-batches (its setting is per micro-batch)."""
    return None if timeout is None else dataclasses.replace(timeout, seconds=timeout.seconds * max(micro_batches, 1))


async def each_rank(trainer, endpoint: str, shares: list) -> list:
    """`endpoint(shares[r])` on rank r of the trainer's mesh, all ranks at once."""
    return await asyncio.gather(*(getattr(rank, endpoint).call_one(r) for rank, r in zip(ranks_of(trainer), shares)))


_RANKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def ranks_of(mesh) -> list:
    """Each rank of an actor mesh as a mesh of its own, made once per mesh: slicing builds a new ActorMesh,
    which cost the controller more CPU than the call itself (2.6 ms; meshrl bench controller --real)."""
    ranks = _RANKS.get(mesh)
    if ranks is None:
        ranks = _RANKS[mesh] = [mesh.slice(procs=r) for r in range(mesh.sizes["procs"])]
    return ranks


def with_into(ref: BatchRef, into: str) -> BatchRef:
    """`ref`, its actor to put what it computes into its micro-batch's field `into`."""
    return dataclasses.replace(ref, into=into)


async def computed(actor, shares: list[list[BatchRef]], into: str, endpoint: str = "logprobs") -> None:
    """Each rank's logprobs (its `endpoint`'s) of its share of micro-batches, put into the replay buffer by
    the rank itself as each micro-batch's field `into`."""
    await each_rank(actor, endpoint, [[with_into(ref, into) for ref in share] for share in shares])


async def train_updates(trainer, reference, updates: list[list[BatchRef]], config: TrainerConfig,
                        span=no_span, version: int | None = None, reference_ranks: int = 1,
                        timeouts: Timeouts = Timeouts(), applied: dict | None = None) -> dict:
    """One optimizer update per list of micro-batches (`BatchRef`s: the ranks take them from the replay
    buffer, meshrl/actors/replay_buffer.py) on the trainer's `config.ranks` ranks (the reference, if any, on its
    `reference_ranks`); return the step's metrics.

    Ratio, clip, behaviour-weight and KL figures are means over all loss tokens of the step;
    `clip_fraction_by_update` gives each update's clipped share, `loss` and `grad_norm` the mean
    over updates. Each actor call is timed by `span` (a `Tracer.span`) with the trained `version`,
    and bounded by `timeouts.trainer` (the reference's by `timeouts.reference`). `applied["updates"]`
    counts the updates applied so far, for a step that fails part-way. An update with no micro-batch
    trains nothing and is never stepped (no optimizer update, the lr schedule not advanced): a batch
    with nothing to train makes a step of 0 updates, its loss and grad_norm NaN."""
    updates = [batches for batches in updates if batches]
    # LoRA: the trainer's own base, its adapter off (without LoRA and a reference the loss refuses the KL)
    base_reference = reference is None and config.loss.kl_coef > 0 and config.lora.rank > 0
    every = [b for batches in updates for b in batches]
    if reference and every:
        shares = dealt(every, reference_ranks)
        async with span("reference", "reference", version, timeout=per_micro_batch(timeouts.reference, len(shares[0]))):
            await computed(reference, shares, "ref_logprobs")
    elif base_reference and every:
        shares = dealt(every, config.ranks)
        async with span("trainer", "reference", version, timeout=per_micro_batch(timeouts.trainer, len(shares[0]))):
            await computed(trainer, shares, "ref_logprobs", "base_logprobs")
    for batches in updates[1:]:  # pi_old before the first update changes the weights
        shares = dealt(batches, config.ranks)
        async with span("trainer", "pi_old", version, timeout=per_micro_batch(timeouts.trainer, len(shares[0]))):
            await computed(trainer, shares, "old_logprobs")
    sums, clip_by_update, losses, grad_norms, skipped, memory, lr = defaultdict(float), [], [], [], 0, 0.0, None
    # the last version's publish, as the update that waited for it saw it; NaN where none came before this step's
    # updates (a run's first step), as a step with nothing to train has a NaN loss: every row has the same keys
    published = {"weight_publish_s": math.nan, "weight_publish_hidden": math.nan}
    for batches in updates:
        update = defaultdict(float)
        shares = dealt(batches, config.ranks)
        async with span("trainer", "train", version, timeout=per_micro_batch(timeouts.trainer, len(shares[0]))):
            results = await each_rank(trainer, "forward_backward", shares)
        for metrics in (m for round_ in zip(*results) for m in round_):  # summed round by round, as they ran
            sums["ratio_max"] = max(sums["ratio_max"], metrics.pop("ratio_max"))
            for k, v in metrics.items():
                update[k] += v
        losses.append(update.pop("loss", 0.0))
        async with span("trainer", "optim_step", version, timeout=timeouts.trainer):
            result = await first(trainer.optim_step.call(skip=not math.isfinite(losses[-1])))
        if applied is not None:
            applied["updates"] += 1
        grad_norms.append(result["grad_norm"])
        skipped += result["skipped"]
        memory = max(memory, result.get("memory_gb", 0.0))
        lr = result.get("lr", lr)
        if result.get("publish_s") is not None:  # optional in the contract (roles.Trainer.optim_step)
            published = publish_figures(result["publish_s"], result["publish_blocked_s"])
        clip_by_update.append((update["clip_low"] + update["clip_high"]) / max(update["tokens"], 1))
        for k, v in update.items():
            sums[k] += v
    tokens = max(sums["tokens"], 1)
    return {
        "loss": sum(losses) / len(losses) if losses else math.nan,
        "updates": len(updates),
        "updates_skipped": skipped,  # not applied: a NaN or infinite loss or gradient norm
        "logprob_mismatch": sums["logprob_mismatch"] / tokens,
        "ratio_mean": sums["ratio"] / tokens,
        "ratio_max": sums["ratio_max"],
        "clip_fraction_low": sums["clip_low"] / tokens,
        "clip_fraction_high": sums["clip_high"] / tokens,
        "clip_fraction_by_update": clip_by_update,
        "behaviour_weight_mean": sums["behaviour_weight"] / tokens,
        "tis_fraction": sums["tis_truncated"] / tokens,
        "behaviour_kl": sums["behaviour_kl"] / tokens,
        "entropy": sums["entropy"] / tokens,
        **({"kl": sums["kl"] / tokens} if reference or base_reference else {}),
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
        **({"trainer_memory_gb": memory} if memory else {}),  # rank 0's resident memory after its updates
        **({"lr": lr} if lr is not None else {}),  # the learning rate of the step's last update
        **published,
    }


def publish_figures(seconds: float, blocked: float) -> dict:
    """A version's publish (the trainer's copy into its ring, started after the step before trained it), as the
    first update after it saw it: its seconds, and the share of them hidden behind the passes that ran
    meanwhile (1: the update did not wait for it)."""
    return {"weight_publish_s": seconds,
            "weight_publish_hidden": min(1.0, max(0.0, 1 - blocked / seconds)) if seconds > 0 else 1.0}
