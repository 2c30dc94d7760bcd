"""Real Monarch actors with real vLLM and the real torchtitan model (tiny random Llama, real tokenizer)."""

import asyncio

import pytest
from actor_helpers import episode, mismatch

from meshrl.actors import spawn
from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.grader import Grader
from meshrl.actors.replay_buffer import ReplayBuffer
from meshrl.actors.trainer import TitanTrainer
from meshrl.configs import GeneratorConfig, ReplayBufferConfig, TrainerConfig, WeightSyncConfig
from meshrl.model import ChatTokenizer
from meshrl.tasks.sum_digits import SumDigitsConfig
from meshrl.types import Completion, Episode, Prompt, Sampling, TrainBatch


def test_trainer_weights_reach_vllm_and_change_its_output(tiny_checkpoint):
    async def run():
        sync = WeightSyncConfig(transport="rdma")  # the transport between hosts (its TCP fallback here)
        gen_procs, generator = spawn("generator", VLLMGenerator, GeneratorConfig(num_threads=1), sync,
                                     str(tiny_checkpoint))
        trn_procs, trainer = spawn("trainer", TitanTrainer, TrainerConfig(lr=1e-2, num_threads=1), sync,
                                   str(tiny_checkpoint))
        try:
            assert await generator.attach_weights.call_one([await trainer.weight_ring.call_one()]) == "rdma"
            assert await generator.pull_weights.call_one() == 0  # nothing published yet
            prompt = Prompt(5, ChatTokenizer(tiny_checkpoint).encode_chat("What is 1 + 2?"))
            greedy = Sampling(n=1, temperature=0.0, max_tokens=8)
            before = (await generator.generate.call_one([prompt], sampling=greedy))[0]
            assert before.policy_version == 0 and before.prompt_index == 5 and len(before.token_ids) == 8
            # vLLM and the trainer start from the same weights: their logprobs agree
            assert await mismatch(trainer, before) < 0.05

            # one large step pushing down the tokens vLLM chose
            e = episode(before, -1.0)
            await trainer.forward_backward.call_one(TrainBatch.collate([e], e.num_response_tokens, 1))
            assert (await trainer.optim_step.call_one())["updates"] == 1
            assert await trainer.publish_weights.call_one() == 1  # versions count publishes
            stale = await mismatch(trainer, before)
            assert stale > 0.5  # the new policy scores the old tokens very differently

            assert await generator.pull_weights.call_one() == 1
            assert await generator.pull_weights.call_one() == 1  # nothing newer: no reload
            after = (await generator.generate.call_one([prompt], sampling=greedy))[0]
            assert after.policy_version == 1
            assert after.token_ids != before.token_ids
            # vLLM now serves exactly the trainer's new weights (tied embedding and head included)
            assert await mismatch(trainer, after) < 0.05
        finally:
            await gen_procs.stop()
            await trn_procs.stop()

    asyncio.run(run())


def test_replay_buffer_evicts_episodes_older_than_max_policy_age():
    async def run():
        procs, buffer = spawn("replay_buffer", ReplayBuffer, ReplayBufferConfig(max_policy_age=1))
        try:
            def ep(version):
                return Episode([1, 2], [False, True], [0.0, -1.0], 1.0, version, 0)

            await buffer.add.call_one([ep(0), ep(0), ep(1), ep(2), ep(2)])
            assert await buffer.sample.call_one(2, 4) is None  # only 3 are fresh enough at version 2
            assert await buffer.stats.call_one() == {"buffer_depth": 3, "episodes_evicted": 2}
            sampled = await buffer.sample.call_one(2, 2)
            assert [e.policy_version for e in sampled] == [1, 2]  # oldest fresh first
            assert await buffer.stats.call_one() == {"buffer_depth": 1, "episodes_evicted": 2}
            assert [e.policy_version for e in await buffer.sample.call_one(3, 1)] == [2]
        finally:
            await procs.stop()

    asyncio.run(run())


def test_grader_scores_a_group_and_skips_malformed_completions():
    async def run():
        procs, grader = spawn("grader", Grader, "sum_digits", SumDigitsConfig(format_weight=0.1))
        try:
            def c(text):
                return Completion(0, [1], [2], [-0.1], text, 0, "stop")

            scored = await grader.score.call_one([c("Answer: 7"), c(None), c("8")], "7")
            assert [s.completion.text for s in scored] == ["Answer: 7", "8"]
            assert [s.reward for s in scored] == pytest.approx([1.1, 0.0])
            assert scored[0].reward_components == {"correct": 1.0, "format": 1.0, "last_number": 1.0}
        finally:
            await procs.stop()

    asyncio.run(run())
