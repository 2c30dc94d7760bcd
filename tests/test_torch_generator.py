"""The torch generator (meshrl/actors/torch_generator.py: sampling with the trainer's own torchtitan model) in
real Monarch actors beside the real trainer: with generator.exact its behaviour logprobs are the trainer's to
the bit, before and after a published update; and whole runs train with it (`--generator.impl torch`), sync,
async, multi-turn, LoRA, and through the death of a replica."""

import asyncio
import json
import subprocess
import sys

import pytest
from actor_helpers import episode, forward_backward, generate_whole, replay_buffer_on

from meshrl.actors import spawn
from meshrl.actors.generator_config import GeneratorConfig
from meshrl.actors.torch_generator import TorchGenerator
from meshrl.actors.trainer import TitanTrainer
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.models.model import ChatTokenizer, resolve_checkpoint
from meshrl.types import Prompt, Sampling
from meshrl.weight_sync import WeightSyncConfig

pytestmark = pytest.mark.processes


def test_exact_behaviour_logprobs_are_the_trainers_recomputation_to_the_bit():
    """generator.exact (float32 weights, each completion re-scored one sequence at a time as the trainer with
    trainer.per_sequence scores it): over one micro-batch of sequences of different lengths, at temperature
    0.8, the trainer's first update finds logprob_mismatch, behaviour KL and the clip all exactly 0, before
    and after a published update. The same generator without exact (its cached decoding's own logprobs) is
    not bitwise the trainer's: the equality is the re-scoring's, not a coincidence of the model."""
    checkpoint = resolve_checkpoint("tiny")
    sync = WeightSyncConfig(dtype="float32")  # the trainer's master weights, as generator.exact resolves it
    figures = {}

    async def run():
        gen_procs, exact = spawn("generator_exact", TorchGenerator, GeneratorConfig(
            impl="torch", exact=True, dtype="float32", weight_update="drain", num_threads=1), sync, str(checkpoint))
        plain_procs, plain = spawn("generator_plain", TorchGenerator, GeneratorConfig(
            impl="torch", dtype="float32", weight_update="drain", num_threads=1), sync, str(checkpoint))
        trainer_config = TrainerConfig(lr=1e-2, num_threads=1, per_sequence=True, bf16_autocast=False)
        trn_procs, trainer = spawn("trainer", TitanTrainer, trainer_config, sync, str(checkpoint))
        buffer = replay_buffer_on(trn_procs, trainer_config)
        try:
            ring = await trainer.weight_ring.call_one()
            for generator in (exact, plain):
                await generator.attach_weights.call_one([ring])
            tokenizer = ChatTokenizer(checkpoint)
            prompts = [Prompt(i, tokenizer.encode_chat(q)) for i, q in enumerate(["What is 1 + 2?", "Name a colour."])]
            sampling = Sampling(n=3, temperature=0.8, max_tokens=12)
            for version in (0, 1):
                for name, generator in (("exact", exact), ("plain", plain)):
                    assert await generator.pull_weights.call_one() == version
                    made = await generate_whole(generator, prompts, sampling=sampling)
                    assert {c.policy_version for c in made} == {version}
                    figures[name, version] = await forward_backward(trainer, buffer,
                                                                    [episode(c, 0.0, 0.8) for c in made])
                    lengths = {len(c.prompt_token_ids) + len(c.token_ids) for c in made}
                    figures[name, version]["lengths"] = sorted(lengths)
                await forward_backward(trainer, buffer, [episode(c, 1.0, 0.8) for c in made])
                assert (await trainer.optim_step.call_one())["updates"] == version + 1
                assert await trainer.publish_weights.call_one() == version + 1
        finally:
            for procs in (gen_procs, plain_procs, trn_procs):
                await procs.stop()

    asyncio.run(run())
    for version in (0, 1):
        f = figures["exact", version]
        assert f["tokens"] > 0 and len(f["lengths"]) > 1  # rows padded in the trainer's micro-batch
        assert f["logprob_mismatch"] == 0.0 and f["behaviour_kl"] == 0.0, f
        assert f["clip_low"] == f["clip_high"] == 0 and f["behaviour_weight"] == f["tokens"], f
        assert figures["plain", version]["logprob_mismatch"] > 0.0, figures["plain", version]
    print("EXACT", figures)


def train(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict], dict]:
    """`meshrl train --config smoke --generator.impl torch` with `args`: the process, its rows, its summary."""
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
                           "--generator.impl", "torch", *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return done, rows, json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("mode", ["sync", "async", "async_exact"])
def test_smoke_trains_with_the_torch_generator(tmp_path, mode):
    """The smoke recipe with the torch generator: every step trains (tokens trained, a finite loss), sync
    (max_policy_age 0, drained loads) and async (one version ahead, loads in flight); with exact the steps'
    mismatch is 0."""
    args = {"sync": [], "async": ["--controller.max_policy_age", "1"],
            "async_exact": ["--controller.max_policy_age", "1", "--generator.exact", "true"]}[mode]
    _, rows, summary = train(tmp_path, *args)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["tokens_trained"] > 0 and r["loss"] == r["loss"] for r in rows), rows
    assert summary["steps"] == 2
    if mode == "async":
        assert rows[-1]["policy_version"] >= 1
    if mode == "async_exact":
        assert all(r["logprob_mismatch"] == 0.0 for r in rows), [r["logprob_mismatch"] for r in rows]


def test_a_multi_turn_zorplex_run_trains_with_the_torch_generator_and_its_prefix_cache_serves_prompts(tmp_path):
    """Zorplex level 2 (tool calls, several turns a conversation) on two torch replicas: every step trains,
    and the replicas' own prefix caches serve prompt tokens (the openings' shared worked example: a group's
    conversations share their opening, computed once on a replica)."""
    _, rows, _ = train(tmp_path, "--task", "zorplex", "--zorplex.eval_size", "2", "--zorplex.level", "2",
                       "--checkpoint.every", "0", "--generator.replicas", "2", "--generator.num_threads", "1",
                       "--generator.cpus", "0;1")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["tokens_trained"] > 0 for r in rows)
    # a step's row counts the requests whose answers arrived in it: over the run, the caches served some
    assert sum(r["prompt_tokens_cached"] for r in rows) > 0 and all(r["prefix_cache_hit_rate"] < 1 for r in rows), rows


def test_a_lora_run_trains_the_adapter_with_the_torch_generator_serving_it(tmp_path):
    """LoRA rank 8: the torch generator holds the base with the adapter, as the trainer does, and loads each
    published adapter into it; generation one step ahead, so a version is loaded while the run goes on."""
    _, rows, _ = train(tmp_path, "--trainer.lora.rank", "8", "--trainer.lr", "1e-2", "--controller.steps", "3",
                       "--controller.max_policy_age", "1")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["tokens_trained"] > 0 for r in rows)
    assert rows[-1]["policy_version"] >= 2
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()


def test_a_sigkilled_torch_replica_of_two_is_replaced_and_its_group_generated_again(tmp_path):
    """SIGKILL one of two torch replicas after the first step: the run ends with exit 0 and every step, the
    restart counted and the groups it held generated again."""
    from actor_helpers import kill_role_after_steps

    run_dir = tmp_path / "run"
    run = subprocess.Popen([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
                            "--generator.impl", "torch", "--controller.steps", "4", "--controller.max_policy_age", "1",
                            "--checkpoint.every", "0", "--generator.replicas", "2", "--generator.num_threads", "1",
                            "--generator.cpus", "0;1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr, _ = kill_role_after_steps(run, run_dir, "generator0", 1)
    assert run.returncode == 0, stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["generator_restarts"] == 1
    assert all(r["tokens_trained"] > 0 for r in rows)
