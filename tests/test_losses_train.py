"""One optimizer step of each loss on the real trainer (torchtitan, tiny model): a response with a
positive advantage becomes more likely, one with a negative advantage less likely."""

import asyncio

import pytest
import torch

from meshrl.actors import spawn
from meshrl.actors.configs import TrainerConfig
from meshrl.actors.trainer import TitanTrainer
from meshrl.losses import LOSSES, LossConfig
from meshrl.models.model import ChatTokenizer
from meshrl.types import Episode, TrainBatch
from meshrl.weight_sync import WeightSyncConfig

pytestmark = pytest.mark.processes


def test_each_loss_moves_logprobs_the_way_the_advantages_point(tiny_checkpoint):
    tokenizer = ChatTokenizer(tiny_checkpoint)
    prompt = tokenizer.encode_chat("What is 1 + 2?")
    responses = [tokenizer.tokenizer.encode(text).ids for text in ("Answer: 3", "Answer: 7")]
    episodes = [Episode(prompt + r, [False] * len(prompt) + [True] * len(r), [0.0] * (len(prompt) + len(r)),
                        advantage, 0, 0) for r, advantage in zip(responses, (1.0, -1.0))]
    tokens = sum(e.num_response_tokens for e in episodes)
    batch = TrainBatch.collate(episodes, tokens, len(episodes), tokenizer.pad_id)

    async def one_step(trainer) -> torch.Tensor:
        """Summed response logprob of each episode, before and after one step."""
        before = await trainer.logprobs.call_one(batch)
        batch.behaviour_logprobs = torch.where(batch.loss_mask, before, 0.0)  # sampled by this very policy
        await trainer.forward_backward.call_one(batch)
        await trainer.optim_step.call_one()
        after = await trainer.logprobs.call_one(batch)
        return ((after - before) * batch.loss_mask).sum(-1)

    async def run():
        spawned = [spawn(f"trainer-{name}", TitanTrainer,
                         TrainerConfig(lr=1e-4, num_threads=1, loss=LossConfig(name=name)), WeightSyncConfig(),
                         str(tiny_checkpoint)) for name in LOSSES]
        try:
            return dict(zip(LOSSES, [await one_step(trainer) for _, trainer in spawned]))
        finally:
            for procs, _ in spawned:
                await procs.stop()

    for name, change in asyncio.run(run()).items():
        assert change[0] > 0, f"{name} did not raise the positive-advantage response: {change.tolist()}"
        assert change[1] < 0, f"{name} did not lower the negative-advantage response: {change.tolist()}"
