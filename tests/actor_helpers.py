"""Shared by the tests that run real actors."""

import dataclasses

from meshrl.rollout import build_episodes
from meshrl.types import Completion, Episode, ScoredCompletion, TrainBatch


def episode(completion: Completion, advantage: float) -> Episode:
    return dataclasses.replace(build_episodes([ScoredCompletion(completion, 0.0)], group_id=0)[0], advantage=advantage)


async def mismatch(trainer, completion: Completion) -> float:
    """Mean |trainer logprob - generator logprob| over the completion's tokens (zero advantage: no update)."""
    e = episode(completion, 0.0)
    metrics = await trainer.forward_backward.call_one(TrainBatch.collate([e], e.num_response_tokens, 1))
    return metrics["logprob_mismatch"] / metrics["tokens"]
