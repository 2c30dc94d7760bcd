"""Weights loaded while requests run (real Monarch actors, real vLLM, the tiny model): every token
carries the version it was sampled under and scores as that version's policy does; `recompute`
recomputes the running prefixes, `in_flight` keeps their KV cache. A whole async run with in-flight
loads (every trained sequence within the staleness bound, counted from its oldest token) is the LoRA
run of test_lora.py: the generator's loads, their bookkeeping and the rollouts' versions are the same
code for an adapter as for full weights, all but vLLM's reload, which this file tests for full weights."""

import asyncio

import pytest

from actor_helpers import episode, logprobs, replay_buffer_on
from probe_actors import ScalingTrainer, SlowStepGenerator

from meshrl.actors import spawn
from meshrl.actors.generator_config import GeneratorConfig
from meshrl.actors.reference import ReferenceModel
from meshrl.actors.reference_config import ReferenceConfig
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.models.model import ChatTokenizer
from meshrl.types import Completion, Prompt, Sampling
from meshrl.weight_sync import WeightSyncConfig

pytestmark = pytest.mark.processes

FINAL_NORM = r"norm\.weight"  # changes the logits only: the KV cache of a prefix stays right
VALUES = r"layers\.0\.attention\.qkv_linear\.wv\.weight"  # changes every later layer's keys and values


async def scored(actor, buffer, completion: Completion) -> list[float]:
    """`actor`'s logprob of each of the completion's tokens (a trainer's or the reference's policy), its
    micro-batch taken from `buffer`."""
    return (await logprobs(actor, buffer, [episode(completion, 0.0)])).tolist()


def gap(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def test_weights_loaded_mid_request_in_flight_and_recomputed(tiny_checkpoint):
    async def run():
        sync = WeightSyncConfig(poll_s=0.02)
        procs = []

        def start(name, cls, *args):
            mesh, actor = spawn(name, cls, *args)
            procs.append(mesh)
            return actor

        trainer = start("trainer", ScalingTrainer, TrainerConfig(num_threads=1), sync, str(tiny_checkpoint))
        buffer = replay_buffer_on(procs[-1])  # the trainer's and the reference's micro-batches
        old = start("reference", ReferenceModel, ReferenceConfig(num_threads=1), str(tiny_checkpoint))
        generators = {mode: start(f"generator_{mode}", SlowStepGenerator,
                                  GeneratorConfig(num_threads=1, weight_update=mode), sync, str(tiny_checkpoint))
                      for mode in ("in_flight", "recompute")}
        try:
            rings = [await trainer.weight_ring.call_one()]
            for generator in generators.values():
                await generator.attach_weights.call_one(rings)
            prompt = Prompt(0, ChatTokenizer(tiny_checkpoint).encode_chat("Tell me a long story."))
            long = Sampling(n=1, temperature=1.0, max_tokens=250)

            reports = []  # what each request's answer reported of its generator's loads

            async def mid_request(generators_, pattern, factor):
                """Each generator's long request, with a new version published while they run."""
                async def one(generator):
                    answer = await generator.generate.call_one([prompt], sampling=long)
                    reports.append(answer.report)
                    return await generator.completions.call_one([g.key for g in answer.completions], forget=True)

                running = [asyncio.create_task(one(g)) for g in generators_]
                await asyncio.sleep(3.0)  # 20 ms a step or more: some of the tokens are out, not all
                version = await trainer.scale_and_publish.call_one(pattern, factor)
                return version, [(await r)[0] for r in running]

            # a change to the keys and values, loaded mid-request by both: recompute redoes the running prefix
            # under the new weights, so its tokens after the swap are exactly the new policy's; in flight keeps
            # the prefix's KV as the old weights computed it, and is not
            version, (kept, recomputed) = await mid_request(
                [generators["in_flight"], generators["recompute"]], VALUES, 8.0)
            assert version == 1
            for c in (kept, recomputed):
                swap = c.versions[-1][0]
                assert c.policy_version == 0 and c.versions == [[0, 0], [swap, 1]] and 5 <= swap <= 245, c.versions
                assert gap(c.logprobs[:swap], (await scored(old, buffer, c))[:swap]) < 0.02  # the old policy's tokens
            swap = recomputed.versions[1][0]
            exact = gap(recomputed.logprobs[swap:], (await scored(trainer, buffer, recomputed))[swap:])
            swap = kept.versions[1][0]
            stale_kv = gap(kept.logprobs[swap:], (await scored(trainer, buffer, kept))[swap:])
            assert exact < 0.02 and stale_kv > max(0.03, 5 * exact), (exact, stale_kv)
            for updates in reports:  # each generator's load mid-request, reported with that request's answer
                assert updates["weight_swaps_in_flight"] == 1 and updates["prefix_cache_resets_refused"] == 0
                assert [p["version"] for p in updates["pulls"]] == [1] and updates["pulls"][0]["in_flight"]
            assert len(reports) == 2
            for generator in generators.values():  # and reported once: nothing since
                assert (await generator.weight_updates.call_one())["pulls"] == []

            # in flight, a change that leaves the KV cache right (the final norm: the logits only): before the
            # swap the old policy's tokens, after it the new policy's, in one request that went on
            version, [c] = await mid_request([generators["in_flight"]], FINAL_NORM, 4.0)
            swap = c.versions[-1][0]
            assert version == 2 and c.versions == [[0, 1], [swap, 2]] and 5 <= swap <= 245, c.versions
            new_lp = await scored(trainer, buffer, c)
            await trainer.scale_and_publish.call_one(FINAL_NORM, 0.25)  # back to version 1's weights, exactly
            old_lp = await scored(trainer, buffer, c)
            before, after = c.logprobs[:swap], c.logprobs[swap:]
            assert gap(before, old_lp[:swap]) < 0.02 and gap(after, new_lp[swap:]) < 0.02
            assert gap(after, old_lp[swap:]) > 0.5 and gap(before, new_lp[:swap]) > 0.5  # visibly different
        finally:
            for mesh in procs:
                await mesh.stop()

    asyncio.run(run())
