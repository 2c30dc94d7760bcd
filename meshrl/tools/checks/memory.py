"""Section `memory` of `meshrl check gpu`: the device's peak memory (torch.cuda.max_memory_allocated)
during one forward_backward of the trainer, and one logprobs pass of the reference, on the random ~1B
Llama at 4k, 8k and 16k tokens a micro-batch, with the memory switches of issue 53 item 3 all off and all
on (workloads.SWITCHES: trainer.activation_checkpointing, trainer.bf16_all_gather,
trainer.logprob_chunk_tokens, reference.dtype). A switch the config lacks is listed as not available; a
size that does not fit is recorded as out of memory. A bf16 reference needs bf16 math (a run refuses it
elsewhere): on a device without (an AVX2-only CPU) its "on" setting stays fp32, listed as not on this device. Each pass is timed too, so the cost of the
switches shows beside what they save (TFLOP/s by mfu.step_flops). On the CPU (the dry mode) the same
passes run at tiny sizes, unmeasured: torch keeps no peak for host memory.
"""

from meshrl.losses import bf16_compute
from meshrl.tools.checks import mfu, standins, workloads

SIZES, DRY_SIZES = (4096, 8192, 16384), (64, 128, 256)


def run(check) -> dict:
    from meshrl.models.model import read_hf_config

    checkpoint = workloads.big_model(check)
    hf = read_hf_config(checkpoint)
    sizes = DRY_SIZES if check.dry else SIZES
    batches = {n: workloads.batch(n, hf["vocab_size"], seed=4, sequence=n // 4 if check.dry else workloads.SEQUENCE)
               for n in sizes}
    import torch.distributed as dist

    out = {"measured": check.device.type == "cuda", "tokens": list(sizes), "trainer": {}, "reference": {},
           "fsdp2": dist.is_initialized(),  # one rank in a process group of world 1: sharded as on several
           "switches": {f"{section}.{name}": {"off": off, "on": on} for (section, name), (off, on)
                        in workloads.SWITCHES.items()}}
    missing = set()
    out["not_on_this_device"] = [] if bf16_compute(check.device, True) else ["reference.dtype bfloat16"]
    for setting in ("off", "on"):
        values = workloads.switches(setting == "on")
        if out["not_on_this_device"]:
            values["reference"]["dtype"] = "float32"
        config, lacking = workloads.trainer_config(check.device, True, **values["trainer"])
        missing.update(lacking)
        trainer = workloads.trainer(checkpoint, config, ring=False)
        cells = {}
        for n, batch in batches.items():
            cells[n] = workloads.peak_memory(check, lambda b=batch: check.run(
                workloads.on_batch(trainer, "forward_backward", b)))
            if "seconds" in cells[n]:
                cells[n]["tflops"] = mfu.step_flops(hf, batch) / cells[n]["seconds"] / 1e12
            check.run(standins.call(trainer, "drop_gradients"))
        out["trainer"][setting] = cells
        del trainer
        workloads.free(check.device)
        reference, lacking = workloads.reference(checkpoint, check.device, **values["reference"])
        missing.update(lacking)
        out["reference"][setting] = {n: workloads.peak_memory(check, lambda b=batch: check.run(
            workloads.on_batch(reference, "logprobs", b))) for n, batch in batches.items()}
        del reference
        workloads.free(check.device)
    out["not_available"] = sorted(missing)  # switches this checkout's configs lack: measured without them
    out["status"] = "ran"
    return out


def report(section: dict) -> list[str]:
    def cell(c: dict) -> str:
        if c.get("oom"):
            return "out of memory"
        if c.get("peak_gib") is None:
            return f"ran {c['seconds']:.2f} s"
        return f"{c['peak_gib']:.1f} GiB {c['seconds']:.2f} s"

    lines = [f"{'tokens':>7s}  {'trainer off':>20s}  {'trainer on':>20s}  {'reference off':>20s}  {'reference on':>20s}"]
    for n in section["tokens"]:
        n = str(n) if str(n) in section["trainer"]["off"] else n  # JSON keys are strings once read back
        lines.append(f"{n:>7}  " + "  ".join(f"{cell(section[role][s][n]):>20s}" for role in ("trainer", "reference")
                                             for s in ("off", "on")))
    if section["not_available"]:
        lines.append(f"switch not available: {', '.join(section['not_available'])}")
    if section.get("not_on_this_device"):
        lines.append(f"not on this device (no bf16 math): {', '.join(section['not_on_this_device'])}")
    return lines
