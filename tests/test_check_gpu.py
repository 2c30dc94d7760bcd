"""`meshrl check gpu` in its dry mode (this machine has no CUDA): every section that can run on the CPU runs
at tiny sizes through the code the GPU run takes, on the stand-ins a lent GPU machine needs (no Monarch
there), and writes its figures; the CUDA-only parts say why they were skipped. Its pure parts (the FLOPs
count, the peak table) are checked by hand."""

import json
import math
import subprocess
import sys

import pytest
import torch

from meshrl.actors import has_bf16_math
from meshrl.tools.checks import mfu, parity, smoke, torch_loop, weights, workloads


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """One dry run on the stand-ins for Monarch: (its JSON, its stdout)."""
    out = tmp_path_factory.mktemp("check") / "gpu.json"
    done = subprocess.run([sys.executable, "-m", "meshrl", "check", "gpu", "--json", str(out), "--stand-ins"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


@pytest.mark.processes
def test_the_dry_run_writes_every_section_and_says_what_ran_on_stand_ins(dry):
    result, stdout = dry
    assert result["dry"] and result["passed"] and result["machine"]["device"] == "cpu"
    assert list(result["sections"]) == ["parity", "endpoints", "memory", "mfu", "publish", "weights", "smoke"]
    assert {n: s["status"] for n, s in result["sections"].items()} == {
        "parity": "pass", "endpoints": "pass", "memory": "ran", "mfu": "ran", "publish": "ran", "weights": "pass",
        "smoke": "pass"}
    assert result["sections"]["smoke"]["why"] == "dry mode"
    assert any(part.startswith("monarch") for part in result["stood_in"]) and not result["installed"]["monarch"]
    for name in result["sections"]:  # the table on stdout has a row for each
        assert f"\n{name} " in stdout
    assert "stand-in: monarch" in stdout
    # Each figure is rounded to 0.01 s, so the sections' sum may pass the rounded total by half a
    # hundredth for each rounding (the sections' and the total's), never by more.
    sections = result["sections"].values()
    assert 0 < sum(s["seconds"] for s in sections) <= result["seconds"] + 0.005 * (len(sections) + 1) + 1e-9


@pytest.mark.processes
def test_the_dry_parity_compares_two_real_paths_within_their_tolerances(dry):
    """Both sides are the CPU: fp32 is the same pass twice and must agree within fp32's tolerance; bf16
    is the CPU's autocast (where the trainer chose it) against fp32, a different computation that must differ
    from it yet stay within bf16's tolerance."""
    from meshrl.losses import bf16_compute

    import torch

    section = dry[0]["sections"]["parity"]
    assert list(section["kinds"]) == list(parity.KINDS)
    for kind, rows in section["kinds"].items():
        assert rows["tensors"] > 0 and math.isfinite(rows["loss_cpu_fp32"]) and rows["loss_cpu_fp32"] != 0
        for dtype in ("fp32", "bf16"):
            row, tolerance = rows[dtype], parity.TOLERANCE[dtype]
            assert row["pass"] and row["loss_rel"] <= tolerance["loss"], (kind, dtype, row)
            assert row["grad_rel"] <= tolerance["grad"] and row["grad_rel_max_tensor"] <= tolerance["grad_tensor"]
        assert not rows["fp32"]["autocast"]
        assert rows["bf16"]["autocast"] == bf16_compute(torch.device("cpu"), True)
        if rows["bf16"]["autocast"]:
            assert rows["bf16"]["grad_rel"] > rows["fp32"]["grad_rel"], kind
    lora, full = section["kinds"]["llama_lora"], section["kinds"]["llama"]
    assert lora["adapter_tensors"] == lora["tensors"] > 0 and full["adapter_tensors"] == 0  # the adapter's only


@pytest.mark.processes
def test_the_dry_endpoints_shard_at_world_one_and_read_back_each_version_equal(dry):
    section = dry[0]["sections"]["endpoints"]
    assert (section["world"], section["process_group"], section["fsdp2"]) == (1, "gloo", True)
    assert [r["version"] for r in section["read_back"]] == [1, 2] == [r["read"] for r in section["read_back"]]
    assert all(r["unequal"] == 0 and r["tensors"] > 0 for r in section["read_back"])
    assert section["read_back"][0]["digest"] != section["read_back"][1]["digest"]
    assert section["logprob_change"] > 0 and section["problems"] == []


@pytest.mark.processes
def test_the_dry_memory_mfu_and_publish_sections_run_the_same_passes_at_tiny_sizes(dry):
    sections = dry[0]["sections"]
    memory = sections["memory"]
    assert memory["tokens"] == list(workloads_sizes()) and memory["not_available"] == []
    # a bf16 reference where this CPU has bf16 math; an AVX2-only one keeps it fp32 and says so
    assert memory["not_on_this_device"] == ([] if has_bf16_math(torch.device("cpu")) else ["reference.dtype bfloat16"])
    for role in ("trainer", "reference"):
        for setting in ("off", "on"):
            cells = memory[role][setting]
            assert [int(n) for n in cells] == memory["tokens"]
            assert all(c["seconds"] > 0 and c["peak_gib"] is None for c in cells.values())
    m = sections["mfu"]
    assert m["tokens"] == mfu.DRY_TOKENS and m["peak_from"] == "measured matmul"
    assert m["mfu"] == pytest.approx(m["flops_per_step"] / m["forward_backward_s"] / 1e12 / m["peak_tflops"])
    assert 0 < m["mfu_with_optim_step"] < m["mfu"]
    publish = sections["publish"]
    assert publish["rates"] is None and "no CUDA" in publish["reason"]
    assert 0 <= publish["trainer"]["overlap"] <= 1 and publish["trainer"]["publish_weights_s"] > 0


@pytest.mark.processes
def test_the_dry_weights_section_loads_every_shape_in_a_second_process_bit_equal_and_untorn(dry):
    """The writer and the reader are two processes besides the check's, the ring their memfd stand-in; every
    shape's versions are each read as published (the reader's digests of its engine weights equal the
    writer's of its sources, and differ from version to version, so a stale or mixed load would show)."""
    result, stdout = dry
    section = result["sections"]["weights"]
    assert section["transport"] == "device_standin" and "not a GPU's figures" in section["figures"]
    assert len(set(section["processes"].values())) == 2
    assert list(section["shapes"]) == list(weights.SHAPES)
    for name, shape in section["shapes"].items():
        config = weights.tiny(weights.SHAPES[name])
        assert shape["config"] == config and shape["bytes"] == weights.layout_of(config).nbytes > 0
        assert shape["ring_bytes"] == weights.SLOTS * shape["bytes"] and shape["ring_allocated"] is None
        assert shape["bit_equal"] and shape["unequal_tensors"] == [], name
        assert shape["torn_reads"] == 0 == shape["corrupt_reads"]
        rows = shape["per_version"]
        assert [r["version"] for r in rows] == [r["read"] for r in rows] == list(range(1, section["versions"] + 1))
        assert all(r["equal"] and r["writer_digest"] == r["reader_digest"] for r in rows)
        assert len({r["writer_digest"] for r in rows}) == len(rows)
        assert all(shape[k] > 0 for k in ("publish_s", "load_s", "end_to_end_s", "publish_gbps", "load_gbps"))
        assert 0 <= shape["overlap"]["overlap"] <= 1 and shape["overlap"]["steps"] >= 1
    assert stdout.count("bit-equal yes, torn 0") == len(weights.SHAPES)


@pytest.mark.processes
def test_the_dry_smoke_runs_an_async_loop_with_the_torch_generator_loading_every_version(dry):
    """With no vLLM (or no Monarch), and in the dry mode, the smoke section runs the whole loop in the check's
    process: the torch generator and the trainer actor on the stand-ins, sum_digits' reward, GRPO advantages.
    Every step trains, each version published is loaded by the generator, and each step after the first trains
    groups generated one version behind (max_policy_age 1)."""
    result, stdout = dry
    section = result["sections"]["smoke"]
    steps, prompts, n, tokens = torch_loop.DRY_SIZES
    versions = list(range(1, steps + 1))
    assert section["status"] == "pass" and section["problems"] == [], section["problems"]
    assert section["path"] == torch_loop.PATH and section["generator_device"] == "cpu"
    assert section["steps_run"] == steps and [r["step"] for r in section["steps"]] == versions
    assert section["versions_published"] == versions == section["versions_loaded"]
    assert [load["version"] for load in section["loads"]] == versions
    assert all(load["seconds"] > 0 for load in section["loads"]) and section["load_s_per_version"] > 0
    assert section["generated_tokens_per_s"] > 0 and section["trained_tokens_per_s"] > 0
    for row in section["steps"]:
        assert row["groups"] == prompts and row["episodes"] == prompts * n, row
        assert 0 < row["generated_tokens"] <= prompts * n * tokens and row["tokens_trained"] == row["generated_tokens"]
        assert row["updates"] == row["step"] and len(row["rewards"]) == prompts * n
        assert row["sampled_versions"] == [max(0, row["step"] - 2)]  # generated before the previous step trained
    assert [r["policy_age_max"] for r in section["steps"]] == [0] + [1] * (steps - 1)
    assert len(section["rewards_per_step"]) == steps and all(0 <= r <= 1.2 for r in section["rewards_per_step"])
    assert f"{torch_loop.PATH}: tiny Qwen3 (dry mode)" in stdout and "(dry mode)\n" in stdout
    assert f"versions published {versions}, loaded {versions}" in stdout


def test_the_smoke_section_runs_meshrl_train_only_where_vllm_and_monarch_are_both_installed(monkeypatch, tmp_path):
    """The subprocess where both are installed and not in the dry mode; the in-process loop otherwise, saying
    why; the report names the path that ran."""
    monkeypatch.setattr(smoke.torch_loop, "run", lambda check: {"path": torch_loop.PATH, "status": "pass"})
    monkeypatch.setattr(smoke, "train", lambda check: {"path": smoke.SUBPROCESS, "status": "pass"})
    cases = [({"vllm", "monarch"}, False, smoke.SUBPROCESS, None),
             ({"vllm", "monarch"}, True, torch_loop.PATH, "dry mode"),
             ({"monarch"}, False, torch_loop.PATH, "vllm not installed here (or stood in)"),
             (set(), False, torch_loop.PATH, "vllm and monarch not installed here (or stood in)")]
    for installed, dry, path, why in cases:
        monkeypatch.setattr(smoke.standins, "available", lambda module, have=installed: module in have)
        check = gpu_check(tmp_path, dry)
        try:
            section = smoke.run(check)
        finally:
            check.loop.close()
        assert (section["path"], section.get("why")) == (path, why), (installed, dry)
    assert smoke.report({"path": smoke.SUBPROCESS, "status": "pass", "exit_code": 0, "run_s": 30.0,
                         "summary": {"steps": 2}})[0].startswith(f"{smoke.SUBPROCESS}: exit code 0")


def gpu_check(tmp_path, dry: bool):
    from meshrl.tools.checks import gpu

    return gpu.Check(torch.device("cpu"), dry, tmp_path)


def test_the_weights_digest_changes_with_any_changed_or_moved_bits(monkeypatch):
    t = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert weights.digest(t.clone()) == weights.digest(t)
    flipped = t.clone()
    flipped.view(torch.int16)[1, 7] ^= 1  # the lowest bit of one element
    swapped = t.clone()
    swapped[0, 0], swapped[2, 999] = t[2, 999], t[0, 0]
    assert t[0, 0] != t[2, 999]
    assert len({weights.digest(t), weights.digest(flipped), weights.digest(swapped)}) == 3
    whole = weights.digest(t)
    monkeypatch.setattr(weights, "CHUNK", 7)  # in pieces, each word keeps its position's weight
    assert weights.digest(t) == whole


def test_the_weights_shapes_are_what_the_trainer_publishes_for_those_qwen3_configs(tmp_path):
    """Each config's tensors (scaled down: the rules, not the sizes) under HF names, as the trainer publishes
    a Qwen3 model built from it (a tied head once); and the real sizes' parameter counts."""
    from meshrl.models.model import read_hf_config, resolve_checkpoint
    from meshrl.weight_sync import published_weights

    base = read_hf_config(resolve_checkpoint("tiny_qwen3"))
    for name, config in weights.SHAPES.items():
        small = weights.tiny(config)
        (tmp_path / "config.json").write_text(json.dumps(base | small))
        layout, to_hf = published_weights(tmp_path, "bfloat16")
        hf = to_hf({s.name: torch.empty(s.shape, device="meta") for s in layout.specs})
        assert {n: tuple(t.shape) for n, t in hf.items()} == weights.hf_shapes(small), name
    counts = {name: sum(math.prod(s) for s in weights.hf_shapes(c).values()) for name, c in weights.SHAPES.items()}
    assert counts == {"qwen3-1.7b": 1_720_574_976, "qwen3-4b": 4_022_468_096, "qwen3-8b": 8_190_735_360}


def workloads_sizes():
    from meshrl.tools.checks import memory

    return memory.DRY_SIZES


def test_step_flops_counts_the_blocks_the_head_at_loss_positions_and_attention():
    hf = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 64, "intermediate_size": 256, "vocab_size": 1000}
    batch = workloads.batch(16, 1000, sequence=8)  # 2 sequences of 8, 6 loss positions each
    # per block: q and o 128*128 each, k and v 128*64 each, the MLP 3*128*256 -> 147,456 parameters
    blocks = 6 * 2 * 147_456 * 16
    head = 6 * 128 * 1000 * 12
    attention = 12 * 2 * 2 * 64 * 8 * 16
    assert mfu.step_flops(hf, batch) == blocks + head + attention == 37_920_768


def test_the_peak_table_knows_gpus_by_name_and_longer_names_first():
    assert mfu.peak_by_name("NVIDIA H100 80GB HBM3") == 989.0
    assert mfu.peak_by_name("NVIDIA H100 PCIe") == 756.0
    assert mfu.peak_by_name("NVIDIA H200") == 989.0
    assert mfu.peak_by_name("NVIDIA A100-SXM4-80GB") == 312.0
    assert mfu.peak_by_name("NVIDIA A10G") == 125.0
    assert mfu.peak_by_name("NVIDIA L40S") == 362.0
    assert mfu.peak_by_name("Tesla T4") is None


def test_an_unknown_section_is_one_clear_error(cli, tmp_path):
    code, out, err = cli("check", "gpu", "--json", tmp_path / "gpu.json", "--sections", "parity,nope")
    assert code == 2 and err.strip() == "meshrl: error: --sections: unknown nope; known: " + ", ".join(
        ["parity", "endpoints", "memory", "mfu", "publish", "weights", "smoke"])
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.processes
def test_with_monarch_installed_the_endpoints_run_on_its_real_actor_class(tmp_path):
    """Where Monarch is installed the check builds the real actor class in process and calls its endpoints,
    the concurrent publish_weights unwrapped from the task Monarch would start."""
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "-m", "meshrl", "check", "gpu", "--json", str(out), "--sections",
                           "endpoints"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["installed"]["monarch"] and not any(p.startswith("monarch") for p in result["stood_in"])
    assert result["sections"]["endpoints"]["status"] == "pass"


def test_a_chunked_head_stays_gathered_through_the_backward_then_is_resharded():
    """Found by the check on an H200: FSDP2 reshards the LM head's unit after the first chunk's backward,
    and the next chunk's recompute met sharded weights. `head_kept_gathered` keeps the unit gathered until
    the backward ends, then reshards it; without it the unit is resharded by the backward."""
    import torch
    from torch.distributed.tensor import DTensor

    from meshrl.actors.distributed import Rank, head_kept_gathered, load_on_ranks
    from meshrl.losses import policy_terms
    from meshrl.models.model import resolve_checkpoint
    from meshrl.tools.checks import gpu

    gpu.init_group(torch.device("cpu"))
    try:
        model, _ = load_on_ranks(resolve_checkpoint("tiny"), Rank(0, 1, torch.device("cpu")))
        batch = workloads.batch(256, 49152, sequence=64)
        assert int(batch.loss_mask.sum()) > 32  # several chunks of 32 positions

        def step():
            logprobs, _ = policy_terms(model, batch, False, 32)
            logprobs.sum().backward()

        step()
        assert isinstance(model.lm_head.weight, DTensor)  # what the backward does alone
        with head_kept_gathered(model, True):
            step()
            assert not isinstance(model.lm_head.weight, DTensor)
        assert isinstance(model.lm_head.weight, DTensor)
    finally:
        gpu.end_group()
