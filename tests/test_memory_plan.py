"""The memory plan (meshrl/runtime/memory_plan.py, meshrl/runtime/memory_estimate.py): its estimates against the
peaks `meshrl check gpu` measured on an H200 (docs/gpu_check_h200.json), its per-layer count against the bytes
autograd saves on the CPU, its refusal of Qwen3-30B-A3B fully fine-tuned on one node, and `--plan-only`."""

import json
import re
from pathlib import Path

import pytest
import torch

from meshrl.configs import resolve
from meshrl.configs.named import CONFIGS, load_config
from meshrl.models.model import build_policy, read_hf_config, resolve_checkpoint
from meshrl.models.shapes import PUBLISHED
from meshrl.runtime.memory_estimate import Dtypes, Pass, Shape, layer_saved, reference_peak, trainer_phases
from meshrl.runtime.memory_plan import refusal
from meshrl.tools.checks import workloads
from meshrl.tools.cli import main

H200 = Path(__file__).resolve().parent.parent / "docs" / "gpu_check_h200.json"
GIB = 2**30


def h200_cells(tiny_checkpoint):
    """Each measured cell of the H200 check's memory section with the estimate for what ran: the ~1B Llama,
    micro-batches as workloads.batch makes them, the switches as the section records them."""
    section = json.loads(H200.read_text())["sections"]["memory"]
    shape = Shape.of(read_hf_config(tiny_checkpoint) | workloads.LLAMA_1B)
    trainer_config, _ = workloads.trainer_config(torch.device("cpu"), True)
    for setting in ("off", "on"):
        switch = {name: values[setting] for name, values in section["switches"].items()}
        gathers = 2 if switch["trainer.bf16_all_gather"] == "on" else 4
        reference = 2 if switch["reference.dtype"] == "bfloat16" else 4
        for tokens in section["tokens"]:
            batch = workloads.batch(tokens, shape.vocab)
            n, m = batch.input_ids.numel(), batch.loss_tokens
            run = Pass(n, m, switch["trainer.activation_checkpointing"], switch["trainer.logprob_chunk_tokens"],
                       trainer_config.loss.entropy_coef > 0)
            # one forward_backward of a fresh trainer: no AdamW state, no gradient before it
            trainer = max(trainer_phases(shape, run, Dtypes(gathers, 2), 1, section["fsdp2"], steady=False).values())
            yield f"trainer {setting} {tokens}", trainer, section["trainer"][setting][str(tokens)]["peak_gib"]
            ref = reference_peak(shape, n, m, Dtypes(reference, 2), 1, section["fsdp2"])
            yield f"reference {setting} {tokens}", ref, section["reference"][setting][str(tokens)]["peak_gib"]


def test_the_estimates_are_within_15_percent_of_the_h200_checks_measured_peaks(tiny_checkpoint):
    cells = list(h200_cells(tiny_checkpoint))
    assert len(cells) == 12
    for name, estimate, measured in cells:
        assert abs(estimate / GIB / measured - 1) < 0.15, f"{name}: estimated {estimate / GIB:.2f}, measured {measured}"


def saved_per_token(model, vocab: int) -> float:
    """The bytes autograd saves for the backward of a forward under bf16 autocast, per token: the difference
    between 192 and 96 tokens (what does not grow with the tokens, weight copies and RoPE tables, cancels)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved(tokens: int) -> int:
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, vocab, (2, tokens // 2), generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            model(ids)
        return sum(storages.values())

    return (saved(192) - saved(96)) / 96


@pytest.mark.filterwarnings("ignore:Mismatch dtype", "ignore:In CPU autocast")  # the kernels the formula counts
@pytest.mark.parametrize("source", ["tiny", "tiny_qwen3", "tiny_qwen3_moe"])
@pytest.mark.parametrize("weights", [4, 2])
def test_each_layer_saves_the_bytes_the_formula_counts(source, weights):
    """fp32 weights (the trainer's, gathered in fp32) and bf16 ones (gathered in bf16): every layer's saved
    tensors, the final norm's and the token ids (int64), to the byte, in the CPU's kernels (composite
    RMSNorm, the router's scores in the weights' dtype)."""
    hf = read_hf_config(resolve_checkpoint(source)) | {"num_hidden_layers": 3}
    model, _ = build_policy(hf)
    model.init_states()
    model._skip_lm_head = True
    for param in model.parameters():  # as FSDP2 gathers them: the parameters only, RoPE's tables as they are
        param.data = param.data.to(torch.float32 if weights == 4 else torch.bfloat16)
    shape, cpu = Shape.of(hf), Dtypes(weights, 2, cuda=False)
    counted = sum(layer_saved(shape, i, cpu) for i in range(shape.layers)) + cpu.norm(shape.hidden, 1, weights) + 8
    assert saved_per_token(model, hf["vocab_size"]) == counted


def test_the_published_shapes_give_the_published_parameter_counts():
    # by hand from config.json: layers x (attention + FFN or experts and router + norms) + embedding and head;
    # the model cards say 8.2B and 30.5B
    per_layer = 4096 * (2 * 4096 + 2 * 1024) + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    dense = Shape.of(PUBLISHED["Qwen3-8B"]).params()
    assert dense == 36 * per_layer + 2 * 151936 * 4096 + 4096 and round(dense / 1e9, 1) == 8.2
    per_layer = 2048 * (2 * 4096 + 2 * 512) + 3 * 128 * 768 * 2048 + 128 * 2048 + 2 * 2048 + 2 * 128
    moe = Shape.of(PUBLISHED["Qwen3-30B-A3B"]).params()
    assert moe == 48 * per_layer + 2 * 151936 * 2048 + 2048 and round(moe / 1e9, 1) == 30.5


def planned(name: str, *overrides: str):
    """A one-node recipe's resolved config, and the GPUs of its host."""
    config = resolve(load_config(name, list(overrides)))
    return config, config.job.gpus_per_host


def test_qwen3_30b_a3b_fully_fine_tuned_beside_its_generators_is_refused_in_one_line_that_names_lora():
    config, counts = planned("qwen3_30b_a3b_gsm8k_one_node", "--trainer.lora.rank", "0")
    line = refusal(config, PUBLISHED["Qwen3-30B-A3B"], counts)
    assert line is not None and "\n" not in line
    found = re.search(r"GPU 4 of the controller's host needs ([\d.]+) GiB of its (\d+) \(([\d.]+) over", line)
    needs, of, over = found.groups()
    assert float(needs) - float(of) == pytest.approx(float(over), abs=0.1 + 1e-9)  # each printed to 0.1
    # fp32 weights, gradients and two AdamW moments of 30.5B parameters over 4 ranks alone exceed 80 GiB
    assert 16 * Shape.of(PUBLISHED["Qwen3-30B-A3B"]).params() / 4 / GIB > float(of)
    fix = line.split("the cheapest change that fits: ")[1].split()
    assert fix[:2] == ["--trainer.lora.rank", "16"]
    assert refusal(resolve(load_config("qwen3_30b_a3b_gsm8k_one_node", ["--trainer.lora.rank", "0", *fix])),
                   PUBLISHED["Qwen3-30B-A3B"], counts) is None


def test_placements_that_fit_are_accepted():
    # the recipe: LoRA beside the generators on one node
    config, counts = planned("qwen3_30b_a3b_gsm8k_one_node")
    assert refusal(config, PUBLISHED["Qwen3-30B-A3B"], counts) is None
    # full fine-tuning with the trainer's 8 ranks on a node of their own, the generators on another
    config = resolve(load_config("qwen3_8b_gsm8k", ["--model.source", "Qwen3-30B-A3B",
                                                    "--trainer.micro_batch_size", "8"]))
    assert refusal(config, PUBLISHED["Qwen3-30B-A3B"], config.job.slurm.gpus_per_node) is None


@pytest.mark.parametrize("overrides,fix", [
    (["--trainer.activation_checkpointing", "off"], "--trainer.activation_checkpointing full"),
    (["--trainer.micro_batch_size", "64"], "--trainer.micro_batch_size 32"),
    (["--trainer.ranks", "2", "--generator.replicas", "6"],
     "--trainer.lora.rank 16 --trainer.lora.targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
])
def test_a_refusal_names_the_first_change_that_fits_checkpointing_then_micro_batch_then_lora(overrides, fix):
    config, counts = planned("qwen3_8b_gsm8k_one_node", *overrides)
    line = refusal(config, PUBLISHED["Qwen3-8B"], counts)
    assert line.split("the cheapest change that fits: ")[1] == fix


@pytest.mark.parametrize("name", ["qwen3_8b_gsm8k_one_node", "qwen3_30b_a3b_gsm8k_one_node"])
def test_plan_only_prints_each_one_node_recipes_plan_without_the_checkpoint_or_a_gpu(name, capsys):
    assert not Path(load_config(name, []).model.source).exists() and not torch.cuda.is_available()
    assert main(["train", "--config", name, "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "gpus: trainer ranks on each host, local rank 0 first: cuda:4 cuda:5 cuda:6 cuda:7" in out
    generator = re.search(r"GPU 0 of the controller's host: ([\d.]+) of 80 GiB: generator replica 0", out).group(1)
    trainer = re.search(r"GPU 7 of the controller's host: ([\d.]+) of 80 GiB: trainer rank 3", out).group(1)
    assert "memory: fits" in out
    doc = " ".join(CONFIGS[name].__doc__.split())  # the recipe documents the plan's figures
    assert f"GPUs 0-3 {generator} GiB" in doc and f"GPUs 4-7 {trainer} GiB" in doc


def test_plan_only_and_a_dry_run_refuse_what_cannot_fit_with_one_error_line(capsys):
    assert main(["train", "--config", "qwen3_30b_a3b_gsm8k_one_node", "--plan-only", "--trainer.lora.rank", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshrl: error: memory plan: GPU 4 of the controller's host needs")
    # a run (here its dry run, the tiny model) planned on one GPU of 2 GiB: refused before anything is spawned
    assert main(["train", "--config", "smoke", "--dry-run", "--job.gpus_per_host", "1",
                 "--job.gpu_memory_gib", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshrl: error: memory plan: GPU 0 of the controller's host needs")
