"""Real Monarch actors with real vLLM and the real torchtitan model (tiny random Llama, real tokenizer)."""

import asyncio
import dataclasses

import pytest
from actor_helpers import episode, forward_backward, generate_whole, mismatch, replay_buffer_on, staged
from fake_holder import FakeHolder
from probe_actors import SlowPublishTrainer, WorkerHandoffGenerator

from meshrl.actors import spawn
from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.torch_generator import TorchGenerator
from meshrl.actors.generator_config import GeneratorConfig
from meshrl.actors.grader import TaskGrader
from meshrl.actors.grader_config import GraderConfig
from meshrl.actors.trainer import TitanTrainer
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.models.model import ChatTokenizer, resolve_checkpoint
from meshrl.tasks import Sample
from meshrl.tasks.sum_digits import SumDigitsConfig
from meshrl.types import Completion, Grading, Prompt, Sampling
from meshrl.weight_sync import WeightSyncConfig

pytestmark = pytest.mark.processes

# Mean |trainer - vLLM| logprob per token of a completion, nats, on the tiny stand-ins, vLLM serving bf16
# and the trainer in bf16 autocast. Largest measured here (2026-11-23, 6 completions each): Llama 0.008,
# Qwen3 0.004, Qwen3-MoE 0.018 (a near tie in the router's top-k can pick other experts in bf16). The
# suite runs Llama and Qwen3 here; every family's end-to-end run checks its steps' mismatch < 0.05
# (test_train_smoke.py), and `-k reach_vllm` with tiny_qwen3_moe added measures the MoE figure again.
PARITY = {"tiny": 0.02, "tiny_qwen3": 0.02, "tiny_qwen3_moe": 0.05}


@pytest.mark.parametrize("source, generator_class", [("tiny", VLLMGenerator), ("tiny_qwen3", WorkerHandoffGenerator),
                                                     ("tiny_qwen3", TorchGenerator)])
def test_trainer_weights_reach_vllm_and_change_its_output(source, generator_class):
    """For each model family: vLLM and the trainer score vLLM's samples alike before and after a
    published update, which vLLM loads under its own names (the family's adapter gives the ring's layout).
    Qwen3's versions go through the route of tensor-parallel replicas (each vLLM worker maps the shared
    memory the version was read into, through collective_rpc); the others are handed to the one worker in
    the replica's process. The torch generator (the trainer's own model) holds the contract alike: it loads
    each version under torchtitan's names."""
    tiny_checkpoint = resolve_checkpoint(source)
    gaps = []

    async def run():
        sync = WeightSyncConfig(transport="rdma")  # the transport between hosts (its TCP fallback here)
        gen_procs, generator = spawn("generator", generator_class, GeneratorConfig(weight_update="drain", num_threads=1), sync,
                                     str(tiny_checkpoint))
        trn_procs, trainer = spawn("trainer", TitanTrainer, TrainerConfig(lr=1e-2, num_threads=1), sync,
                                   str(tiny_checkpoint))
        buffer = replay_buffer_on(trn_procs)
        try:
            assert await generator.attach_weights.call_one([await trainer.weight_ring.call_one()]) == "rdma"
            assert await generator.pull_weights.call_one() == 0  # nothing published yet
            prompt = Prompt(5, ChatTokenizer(tiny_checkpoint).encode_chat("What is 1 + 2?"))
            greedy = Sampling(n=1, temperature=0.0, max_tokens=8)
            before = (await generate_whole(generator, [prompt], sampling=greedy))[0]
            assert before.policy_version == 0 and before.prompt_index == 5 and len(before.token_ids) == 8
            # vLLM and the trainer start from the same weights: their logprobs agree
            gaps.append(await mismatch(trainer, buffer, before))
            sampled = await generate_whole(generator, [prompt], sampling=Sampling(n=4, temperature=0.8,
                                                                                     max_tokens=16))
            gaps.extend([await mismatch(trainer, buffer, c, 0.8) for c in sampled])  # the distribution sampled from
            assert max(gaps) < PARITY[source], gaps

            # one large step pushing down the tokens vLLM chose
            await forward_backward(trainer, buffer, [episode(before, -1.0)])
            assert (await trainer.optim_step.call_one())["updates"] == 1
            assert await trainer.publish_weights.call_one() == 1  # versions count publishes
            stale = await mismatch(trainer, buffer, before)
            assert stale > 0.5  # the new policy scores the old tokens very differently

            assert await generator.pull_weights.call_one() == 1
            assert await generator.pull_weights.call_one() == 1  # nothing newer: no reload
            after = (await generate_whole(generator, [prompt], sampling=greedy))[0]
            assert after.policy_version == 1
            assert after.token_ids != before.token_ids
            # vLLM now serves exactly the trainer's new weights (tied embedding and head included)
            gaps.append(await mismatch(trainer, buffer, after))
            assert max(gaps) < PARITY[source], gaps
            print(f"PARITY {source}: {gaps}")
        finally:
            await gen_procs.stop()
            await trn_procs.stop()

    asyncio.run(run())


def test_grader_scores_a_group_skips_malformed_completions_and_zeroes_truncated_ones_when_asked():
    """The generator holding a group's completions (a fake one holding given Completions, grading them as a
    generate call carrying a Grading has a generator do) sends the grader their replies, and the grader
    answers a (reward, checks) for each, None where the reward raised."""
    def c(text, finish_reason="stop"):
        return Completion(0, [1], [2], [-0.1], text, 0, finish_reason)

    held = [c("Answer: 7"), c(None), c("8"), c("Answer: 3"), c("Answer: 7 and so on", "length")]

    async def run():
        procs, grader = spawn("grader", TaskGrader, "sum_digits", SumDigitsConfig(format_weight=0.1),
                              GraderConfig(zero_truncated=True))
        holder_procs, holder = spawn("holder", FakeHolder, held)
        try:
            answer = await holder.grade.call_one(Grading(grader, Sample("What is 3 + 4?", "7"), 30.0))
            assert answer.grade_error == "" and not answer.grader_failed
            return answer.scores, await holder.keys.call_one()
        finally:
            await procs.stop()
            await holder_procs.stop()

    scores, still_held = asyncio.run(run())
    assert still_held == [0, 1, 2, 3, 4]  # scoring takes nothing away: the replay buffer takes them later
    assert [s is None for s in scores] == [False, True, False, False, False]  # no text: its reward raised
    scored = [s for s in scores if s is not None]
    # the reply cut off at its token limit earns nothing (zero_truncated), though it is right
    assert [reward for reward, _ in scored] == pytest.approx([1.1, 0.0, 0.1, 0.0])
    # the task's checks that need the question ride along: "Answer: 3" copied a number of the question
    # and the grader's own: `truncated`
    checks = [checks for _, checks in scored]
    assert checks[0] == {"correct": 1.0, "format": 1.0, "last_number": 1.0, "copied": 0.0, "truncated": 0.0}
    assert checks[2] == {"correct": 0.0, "format": 1.0, "last_number": 0.0, "copied": 1.0, "truncated": 0.0}
    assert checks[3] == checks[0] | {"truncated": 1.0}


@pytest.mark.parametrize("generator_class", [VLLMGenerator, TorchGenerator])
def test_the_trainer_scores_sampled_tokens_as_vllm_sampled_them_at_any_temperature(generator_class):
    """vLLM (and the torch generator) returns the logprobs of the distribution it sampled from (logits /
    temperature), and the trainer takes its own from logits / the episode's temperature: at 0.7 they agree as
    closely as at 1. A trainer that ignored the temperature would score the same tokens very differently."""
    from meshrl.models.model import resolve_checkpoint

    smollm2 = resolve_checkpoint("smollm2")  # a real model: a random one's logits are too flat to tell

    async def run():
        sync = WeightSyncConfig()
        gen_procs, generator = spawn("generator", generator_class, GeneratorConfig(weight_update="drain", num_threads=1), sync,
                                     str(smollm2))
        trn_procs, trainer = spawn("trainer", TitanTrainer, TrainerConfig(num_threads=1), sync, str(smollm2))
        buffer = replay_buffer_on(trn_procs)
        try:
            prompt = Prompt(0, ChatTokenizer(smollm2).encode_chat("Write one sentence about the sea."))
            gap = {}
            for temperature in (1.0, 0.7):
                sampled = await generate_whole(generator, [prompt], sampling=Sampling(n=4, temperature=temperature,
                                                                                         max_tokens=24))
                gap[temperature] = [await mismatch(trainer, buffer, c, temperature) for c in sampled]
                if temperature != 1.0:
                    gap["ignored"] = [await mismatch(trainer, buffer, c, 1.0) for c in sampled]
            return gap
        finally:
            await gen_procs.stop()
            await trn_procs.stop()

    gap = asyncio.run(run())
    tolerance = 0.08  # nats per token: bf16 (or fp32) numerics of two engines
    assert max(gap[1.0]) < tolerance and max(gap[0.7]) < tolerance, gap
    assert min(gap["ignored"]) > 2 * tolerance, gap


def test_a_call_after_a_publish_runs_after_its_first_part_and_while_it_copies(tiny_checkpoint):
    """publish_weights takes its first part (the version, the copy started) in its message's turn, even when
    that part waits before it starts (SlowPublishTrainer's, half a second): the forward_backward and logprobs
    sent right after it run at the new version (on every rank this keeps a publish's gather ahead of the next
    call's collectives). They run and end on the actor while the copy, slowed to over a second, goes on, and
    the optimizer update waits for the copy of the weights it changes (the actor's own times and versions)."""
    completion = Completion(0, [1, 2, 3], [4, 5, 6, 7], [-1.0] * 4, "", 0, "stop")

    async def run():
        procs, trainer = spawn("trainer", SlowPublishTrainer, TrainerConfig(num_threads=1), WeightSyncConfig(),
                               str(tiny_checkpoint))
        buffer = replay_buffer_on(procs)
        try:
            _, updates = await staged(buffer, [episode(completion, 1.0)], trainer)
            ref = updates[0][0]
            await trainer.forward_backward.call_one([ref])  # warm
            await trainer.optim_step.call_one()
            await trainer.spans.call_one()
            publish = asyncio.ensure_future(trainer.publish_weights.call_one())
            await trainer.forward_backward.call_one([ref])
            await trainer.logprobs.call_one([dataclasses.replace(ref, into="old_logprobs")])
            await trainer.optim_step.call_one()
            assert await publish == 1
            return {s["what"]: s for s in await trainer.spans.call_one()}
        finally:
            await procs.stop()

    spans = asyncio.run(run())
    copy = spans["publish"]
    assert copy["end"] - copy["start"] >= 1.0 and copy["policy_version"] == 1
    assert spans["train"]["policy_version"] == spans["logprobs"]["policy_version"] == 1  # after the first part
    assert copy["start"] < spans["train"]["start"] and spans["train"]["end"] < copy["end"]
    assert spans["logprobs"]["end"] < copy["end"]
    assert spans["optim_step"]["start"] < copy["end"] <= spans["optim_step"]["end"]
