"""One optimizer step of each loss on the real trainer (torchtitan, tiny model): a response with a
positive advantage becomes more likely, one with a negative advantage less likely."""

import asyncio
import dataclasses

import pytest
import torch
from actor_helpers import logprobs, replay_buffer_on, train_through_buffer

from meshrl.actors import spawn
from meshrl.actors.trainer import TitanTrainer
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.losses import LOSSES, LossConfig
from meshrl.models.model import ChatTokenizer
from meshrl.types import Episode
from meshrl.weight_sync import WeightSyncConfig

pytestmark = pytest.mark.processes


def test_each_loss_moves_logprobs_the_way_the_advantages_point(tiny_checkpoint):
    tokenizer = ChatTokenizer(tiny_checkpoint)
    prompt = tokenizer.encode_chat("What is 1 + 2?")
    responses = [tokenizer.tokenizer.encode(text).ids for text in ("Answer: 3", "Answer: 7")]
    episodes = [Episode(prompt + r, [False] * len(prompt) + [True] * len(r), [0.0] * (len(prompt) + len(r)),
                        advantage, 0, 0) for r, advantage in zip(responses, (1.0, -1.0))]
    lengths = [e.num_response_tokens for e in episodes]

    async def one_step(trainer, config, buffer) -> torch.Tensor:
        """Summed response logprob of each episode, before and after one step, taken from the replay buffer by
        reference as in a run."""
        before = await logprobs(trainer, buffer, episodes)
        # sampled by this very policy: the behaviour logprobs are the trainer's own
        sampled = [dataclasses.replace(e, behaviour_logprobs=[0.0] * (len(e.tokens) - n) + values.tolist())
                   for e, n, values in zip(episodes, lengths, before.split(lengths))]
        await train_through_buffer(trainer, buffer, sampled, config)
        after = await logprobs(trainer, buffer, episodes)
        return torch.stack([change.sum() for change in (after - before).split(lengths)])

    async def run():
        configs = {name: TrainerConfig(lr=1e-4, num_threads=1, loss=LossConfig(name=name)) for name in LOSSES}
        spawned = {name: spawn(f"trainer-{name}", TitanTrainer, config, WeightSyncConfig(), str(tiny_checkpoint))
                   for name, config in configs.items()}
        try:
            return {name: await one_step(trainer, configs[name], replay_buffer_on(procs, configs[name],
                                                                                   tokenizer.pad_id))
                    for name, (procs, trainer) in spawned.items()}
        finally:
            for procs, _ in spawned.values():
                await procs.stop()

    for name, change in asyncio.run(run()).items():
        assert change[0] > 0, f"{name} did not raise the positive-advantage response: {change.tolist()}"
        assert change[1] < 0, f"{name} did not lower the negative-advantage response: {change.tolist()}"
