"""The decoupled ratio on real parts: vLLM's behaviour logprobs, the torchtitan trainer (tiny model),
every loss, each batch staged in a real replay buffer and trained through `train_updates` as the
controller has it trained (the trainer's ranks taking their micro-batches from the buffer).

With one update per step the clip sees pi_theta / pi_old = 1 exactly, so nothing clips, however far
the generator's logprobs are from the trainer's (numerics, or staleness); that distance shows up in
the behaviour weight and its KL instead. With two updates, the second one clips.
"""

import asyncio
import dataclasses

import pytest

from actor_helpers import generate_whole, replay_buffer_on, train_through_buffer

from meshrl.actors import spawn
from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.generator_config import GeneratorConfig
from meshrl.actors.trainer import TitanTrainer
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.configs import ControllerConfig
from meshrl.episodes import build_episodes
from meshrl.losses import LOSSES, LossConfig
from meshrl.models.model import ChatTokenizer
from meshrl.types import Prompt, Sampling, ScoredCompletion
from meshrl.weight_sync import WeightSyncConfig

pytestmark = pytest.mark.processes


def test_one_update_clips_nothing_even_on_stale_episodes_and_a_second_update_clips(tiny_checkpoint):
    tokenizer = ChatTokenizer(tiny_checkpoint)
    prompts = [Prompt(i, tokenizer.encode_chat(f"What is {i} + 2?")) for i in range(4)]
    sampling = Sampling(n=4, temperature=1.0, max_tokens=12)

    async def episodes(generator):
        """A batch sampled by vLLM, with GRPO advantages of +-1 (alternate completions rewarded)."""
        completions = await generate_whole(generator, prompts, sampling=sampling)
        groups = [[ScoredCompletion(c, float(j % 2)) for j, c in enumerate(completions[i:i + 4])]
                  for i in range(0, len(completions), 4)]
        return [e for gid, group in enumerate(groups) for e in build_episodes(group, gid, ControllerConfig(), 1.0)]

    async def run():
        sync = WeightSyncConfig()
        configs = {name: TrainerConfig(lr=1e-2, num_threads=1, micro_batch_size=4, loss=LossConfig(name=name))
                   for name in LOSSES}
        spawned = [spawn("generator", VLLMGenerator, GeneratorConfig(weight_update="drain", num_threads=1), sync, str(tiny_checkpoint))]
        try:
            spawned += [spawn(f"trainer-{name}", TitanTrainer, config, sync, str(tiny_checkpoint))
                        for name, config in configs.items()]
            generator = spawned[0][1]
            fresh, stale = await episodes(generator), await episodes(generator)  # both from version 0
            # the buffers cut a batch as the configs say (alike for every loss): in 1 update, or in 2
            configs_two = {name: dataclasses.replace(config, mini_batches=2) for name, config in configs.items()}
            one_update, two_updates = (replay_buffer_on(spawned[0][0], TrainerConfig(micro_batch_size=4, mini_batches=n),
                                                        tokenizer.pad_id) for n in (1, 2))
            results = {}
            for (name, config), (_, trainer) in zip(configs.items(), spawned[1:]):
                on_policy = await train_through_buffer(trainer, one_update, fresh, config)
                # the trainer has moved a large step: episodes from version 0 are now one step stale
                behind = await train_through_buffer(trainer, one_update, stale, config)
                two = await train_through_buffer(trainer, two_updates, fresh, configs_two[name])
                results[name] = on_policy, behind, two
            return results
        finally:
            for procs, _ in spawned:
                await procs.stop()

    for name, (on_policy, behind, two) in asyncio.run(run()).items():
        for step in (on_policy, behind):
            assert step["updates"] == 1 and step["clip_fraction_by_update"] == [0.0], name
            assert step["clip_fraction_low"] == step["clip_fraction_high"] == 0.0, name
            assert step["ratio_mean"] == step["ratio_max"] == 1.0, name
        # vLLM's numerics differ a little from the trainer's; staleness a lot: both go to the weight
        assert 0 < on_policy["logprob_mismatch"] < 0.05, name
        assert behind["logprob_mismatch"] > 0.3 and behind["behaviour_kl"] > 10 * on_policy["behaviour_kl"], name
        assert behind["tis_fraction"] > 0, name  # some stale tokens' weights hit tis_cap
        assert two["updates"] == 2, name
        first, second = two["clip_fraction_by_update"]
        assert first == 0.0 and second > 0.0, f"{name}: clip fraction by update {first}, {second}"
