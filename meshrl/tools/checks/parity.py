"""Section `parity` of `meshrl check gpu`: the trainer's loss and gradients on the device against the CPU's.

For each model kind (the tiny random Llama, Qwen3 and Qwen3-MoE, and the Llama with a LoRA adapter) a
trainer actor on the CPU in fp32 is the reference; a trainer on the device takes one `forward_backward`
of the same micro-batch in fp32 and one in bf16 autocast (the gradients dropped in between). Figures:
the loss's relative difference, and the gradients' (per tensor ||g - g_ref|| / ||g_ref||, the largest;
and over all tensors at once), each against a tolerance per dtype. In the dry mode the device is the
CPU too, and the CPU's trainer takes every pass: the fp32 row is the same pass twice (it must agree to
rounding), the bf16 row the CPU's autocast against its fp32, where the trainer runs the CPU in bf16 at
all (`autocast` says whether it did).
"""

from meshrl.tools.checks import standins, workloads

KINDS = {"llama": ("tiny", 0), "qwen3": ("tiny_qwen3", 0), "qwen3_moe": ("tiny_qwen3_moe", 0),
         "llama_lora": ("tiny", 8)}  # (model.source, LoRA rank)
# relative differences allowed: fp32 is rounding (and the GPU's other summation order); bf16 autocast
# rounds every matmul's operands to 8 bits of mantissa (relative 4e-3 each), compounded over the layers
TOLERANCE = {"fp32": {"loss": 1e-4, "grad": 1e-3, "grad_tensor": 1e-2},
             "bf16": {"loss": 2e-2, "grad": 5e-2, "grad_tensor": 2e-1}}
TOKENS, SEQUENCE = 256, 64  # 4 sequences


def run(check) -> dict:
    import torch

    from meshrl.models.lora import is_adapter
    from meshrl.models.model import read_hf_config, resolve_checkpoint

    out, passed = {"device": str(check.device), "tolerance": TOLERANCE, "kinds": {},
                   "tf32": torch.backends.cuda.matmul.allow_tf32}, True  # on: CUDA's fp32 matmuls round to 10 bits
    for kind, (source, lora_rank) in KINDS.items():
        checkpoint = resolve_checkpoint(source)
        batch = workloads.batch(TOKENS, read_hf_config(checkpoint)["vocab_size"], seed=1, sequence=SEQUENCE)
        cpu = workloads.trainer(checkpoint, workloads.trainer_config(torch.device("cpu"), False, lora_rank)[0], ring=False)
        reference = one_pass(check, cpu, False, batch)
        mine = cpu if check.device.type == "cpu" else workloads.trainer(
            checkpoint, workloads.trainer_config(check.device, False, lora_rank)[0], ring=False)
        rows = {}
        for dtype, bf16 in (("fp32", False), ("bf16", True)):
            rows[dtype] = compare(reference, one_pass(check, mine, bf16, batch), TOLERANCE[dtype])
            passed &= rows[dtype]["pass"]
        out["kinds"][kind] = rows | {"tensors": len(reference["grads"]), "loss_cpu_fp32": reference["loss"],
                                     "adapter_tensors": sum(is_adapter(name) for name in reference["grads"])}
        del cpu, mine
        workloads.free(check.device)
    out["status"] = "pass" if passed else "fail"
    return out


def one_pass(check, trainer, bf16: bool, batch) -> dict:
    """One forward_backward of `trainer` (a fresh one: nothing trained yet) with its forward in bf16 autocast
    or not (the trainer's `bf16_autocast`, which it reads at each pass): its loss and every gradient (on the
    CPU, fp32), which are then dropped, and whether the forward ran in autocast."""
    import dataclasses

    import torch

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX as CHECKPOINT_PREFIX

    from meshrl.losses import autocast

    trainer.config = dataclasses.replace(trainer.config, bf16_autocast=bf16)
    metrics = check.run(workloads.on_batch(trainer, "forward_backward", batch))
    with autocast(trainer.device, bf16):
        in_autocast = torch.is_autocast_enabled(trainer.device.type)
    # under names without activation checkpointing's wrapper (on by default on CUDA, off on the CPU reference)
    grads = {name.replace(CHECKPOINT_PREFIX, ""): p.grad.detach().float().cpu()
             for name, p in trainer.model.named_parameters() if p.grad is not None}
    check.run(standins.call(trainer, "drop_gradients"))
    return {"loss": metrics["loss"], "grads": grads, "autocast": in_autocast}


def compare(reference: dict, mine: dict, tolerance: dict) -> dict:
    """Relative differences of `mine` from `reference` (losses and gradients), and whether each is within
    `tolerance`."""
    import torch

    if reference["grads"].keys() != mine["grads"].keys():
        raise RuntimeError(f"different parameters got gradients: {sorted(reference['grads'].keys() ^ mine['grads'].keys())}")
    loss = abs(mine["loss"] - reference["loss"]) / max(abs(reference["loss"]), 1e-12)
    per_tensor, worst = 0.0, ""
    diff_sq = ref_sq = 0.0
    for name, g in reference["grads"].items():
        d = float(torch.linalg.vector_norm(mine["grads"][name] - g))
        n = float(torch.linalg.vector_norm(g))
        diff_sq, ref_sq = diff_sq + d * d, ref_sq + n * n
        if n > 0 and d / n >= per_tensor:
            per_tensor, worst = d / n, name
    grad = (diff_sq / ref_sq) ** 0.5 if ref_sq > 0 else float("inf")
    ok = loss <= tolerance["loss"] and grad <= tolerance["grad"] and per_tensor <= tolerance["grad_tensor"]
    return {"loss_rel": loss, "grad_rel": grad, "grad_rel_max_tensor": per_tensor, "worst_tensor": worst,
            "autocast": mine["autocast"], "pass": ok}


def report(section: dict) -> list[str]:
    lines = [f"{'kind':11s} {'dtype':5s} {'loss rel':>9s} {'grad rel':>9s} {'worst tensor':>12s}  autocast  ok"]
    for kind, rows in section["kinds"].items():
        for dtype in ("fp32", "bf16"):
            r = rows[dtype]
            lines.append(f"{kind:11s} {dtype:5s} {r['loss_rel']:9.2e} {r['grad_rel']:9.2e} "
                         f"{r['grad_rel_max_tensor']:12.2e}  {str(r['autocast']):8s}  {'yes' if r['pass'] else 'NO'}")
    return lines
