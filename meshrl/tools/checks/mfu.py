"""Section `mfu` of `meshrl check gpu`: the trainer's model FLOPs utilisation on a random ~1B Llama
(workloads.LLAMA_1B) at 8k tokens a micro-batch, with its config's defaults (every memory switch `auto`).

Model FLOPs of a forward and backward (3x the forward's), as torchtitan and PaLM count them: 6 x the
blocks' matmul parameters per position, the LM head (6 x dim x vocab) only at the loss positions (the
trainer skips it elsewhere), and attention 12 x layers x heads x head_dim x sequence length per position.
Recomputation (activation checkpointing) is not model FLOPs. The GPU's peak dense bf16 rate comes from
its datasheet by name (PEAK_TFLOPS), else from a large matmul measured here, which is reported anyway.
For comparison: prime-rl reports 11-35% for its RL trainer on H100s, torchtitan 33-39% pretraining Llama 3.
"""

from meshrl.tools.checks import standins, workloads

TOKENS, DRY_TOKENS, REPEATS = 8192, 256, 3  # the dry mode times 2 repeats
# dense bf16 tensor-core TFLOP/s by GPU name (datasheets, without sparsity); the first name found in the
# device's name wins, so longer names come before their prefixes
PEAK_TFLOPS = (("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
               ("H800", 989.0), ("H20", 148.0), ("B200", 2250.0), ("B100", 1750.0), ("A100", 312.0),
               ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10", 125.0))
REFERENCES = {"prime-rl (RL trainer, H100)": (0.11, 0.35), "torchtitan (Llama 3 pretraining)": (0.33, 0.39)}


def peak_by_name(name: str) -> float | None:
    """The datasheet's dense bf16 TFLOP/s of a GPU called `name`, or None if the table lacks it."""
    upper = name.upper()
    return next((tflops for key, tflops in PEAK_TFLOPS if key.upper() in upper), None)


def measured_tflops(device, dtype, size: int, repeats: int = 10) -> float:
    """A size^3 matmul's rate in `dtype` on `device` (TFLOP/s), the best of `repeats` after warming up."""
    import time

    import torch

    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    times = []
    for i in range(repeats + 3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times) / 1e12


def step_flops(hf: dict, batch) -> float:
    """Model FLOPs of one forward and backward of `batch` (see the module's docstring)."""
    d, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    block = d * heads * head_dim * 2 + 2 * d * kv * head_dim + 3 * d * hf["intermediate_size"]
    positions, sequence = batch.input_ids.numel(), batch.input_ids.shape[1]
    return (6 * layers * block * positions + 6 * d * vocab * int(batch.loss_mask.sum())
            + 12 * layers * heads * head_dim * sequence * positions)


def run(check) -> dict:
    import torch

    from meshrl.models.model import read_hf_config

    checkpoint = workloads.big_model(check)
    hf = read_hf_config(checkpoint)
    config, _ = workloads.trainer_config(check.device, True)
    trainer = workloads.trainer(checkpoint, config)
    check.cache["big_trainer"] = trainer  # the publish section's too
    batch = workloads.batch(DRY_TOKENS if check.dry else TOKENS, hf["vocab_size"], seed=3,
                            sequence=DRY_TOKENS // 4 if check.dry else workloads.SEQUENCE)
    check.run(workloads.on_batch(trainer, "forward_backward", batch))  # warm: kernels, the allocator, AdamW's states
    check.run(standins.call(trainer, "optim_step"))
    fb, step = [], []
    for _ in range(2 if check.dry else REPEATS):
        fb.append(check.timed(workloads.on_batch(trainer, "forward_backward", batch))[1])
        step.append(check.timed(standins.call(trainer, "optim_step"))[1])
    flops = step_flops(hf, batch)
    from meshrl.losses import bf16_compute

    bf16 = bf16_compute(check.device, config.bf16_autocast)
    measured = measured_tflops(check.device, torch.bfloat16 if bf16 else torch.float32, 1024 if check.dry else 8192)
    name = torch.cuda.get_device_name(check.device) if check.device.type == "cuda" else ""
    peak = peak_by_name(name) if name else None
    out = {"model": "random Llama-3.2-1B shape" if not check.dry else "tiny Llama (dry mode)",
           "parameters": sum(p.numel() for p in trainer.model.parameters()), "tokens": batch.input_ids.numel(),
           "loss_tokens": int(batch.loss_mask.sum()), "fsdp2": torch.distributed.is_initialized(), "flops_per_step": flops, "compute_dtype": "bf16" if bf16 else "fp32",
           "switches": {k: getattr(config, k, None) for k in ("activation_checkpointing", "bf16_all_gather",
                                                               "logprob_chunk_tokens")},
           "forward_backward_s": min(fb), "optim_step_s": min(step), "measured_matmul_tflops": measured,
           "peak_tflops": peak or measured, "peak_from": "datasheet" if peak else "measured matmul",
           "references": REFERENCES}
    out["tflops"] = flops / min(fb) / 1e12
    out["mfu"] = out["tflops"] / out["peak_tflops"]
    out["mfu_with_optim_step"] = flops / (min(fb) + min(step)) / 1e12 / out["peak_tflops"]
    out["mfu_of_measured_matmul"] = out["tflops"] / measured
    out["status"] = "ran"
    return out


def report(section: dict) -> list[str]:
    s = section
    return [f"{s['model']}, {s['parameters'] / 1e9:.2f}B parameters, {s['tokens']} tokens ({s['loss_tokens']} trained), "
            f"{s['compute_dtype']}; switches {s['switches']}",
            f"forward_backward {s['forward_backward_s']:.3f} s, optim_step {s['optim_step_s']:.3f} s: "
            f"{s['tflops']:.3g} TFLOP/s; MFU {s['mfu']:.1%} of {s['peak_tflops']:.3g} ({s['peak_from']}), "
            f"{s['mfu_with_optim_step']:.1%} with the optimizer step; {s['mfu_of_measured_matmul']:.1%} of a "
            f"measured matmul ({s['measured_matmul_tflops']:.3g} TFLOP/s)",
            "for comparison: " + ", ".join(f"{k} {lo:.0%}-{hi:.0%}" for k, (lo, hi) in s["references"].items())]
