"""`meshrl bench trainer --memory`: the trainer's peak memory against tokens per micro-batch, with the
memory switches of meshrl/models/memory.py on and off, and the loss and gradients each switch gives
against none.

Each size runs in a fresh process: a warm-up step, then each configuration in turn on the policy loaded
as the trainer loads it on one rank (once per checkpointing mode): one forward and backward of the trainer's loss
(`policy_terms` + `policy_loss`, bf16 autocast where the device has bf16 math, as the trainer's default) on
a fixed batch of `tokens`
positions. Peak memory is what that step adds over the loaded model: on the CPU the kernel's high-water
mark of resident memory (VmHWM, reset just before the step) minus the resident memory then, the C heap's
free pages handed back to the system first (`malloc_trim`), so that memory freed by the configuration
before is not reused unseen; on CUDA `torch.cuda.max_memory_allocated` minus the allocated memory before
it. Either includes the gradients (the trained parameters' size in fp32). The reference model is measured
alike in a process of its own: the resident memory its weights add in fp32 and in bf16 (its linear layers'
and experts' weights: meshrl/actors/distributed.py `bf16_matmul_weights`), and its logprobs in bf16 against
fp32's; where the device has no bf16 math (an AVX2-only CPU) autocast is off and a run keeps its reference
in fp32, so only fp32's is measured.

Times are reported as ratios to the configuration with every switch off at the same size, measured in the
same run: on a shared CPU the absolute figures are noise.
"""

import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# the configurations measured: (activation checkpointing, logprob chunk tokens)
SWITCHES = {"off": ("off", 0), "chunked": ("off", 1024), "checkpointed": ("full", 0), "both": ("full", 1024)}
SEQUENCE = 256  # positions per sequence: 32 of prompt, the rest trained


def run(model: str, tokens: list[int], device: str = "auto") -> dict:
    from meshrl.models.model import resolve_checkpoint

    for n in tokens:
        if n < SEQUENCE or n % SEQUENCE:
            raise ValueError(f"--tokens {n}: each size must be a multiple of {SEQUENCE} (tokens per sequence)")
    checkpoint = str(resolve_checkpoint(model))
    result = {"model": model, "sequence_tokens": SEQUENCE, "switches": {
        k: {"activation_checkpointing": ac, "logprob_chunk_tokens": chunk} for k, (ac, chunk) in SWITCHES.items()},
              "sizes": {str(n): _fresh(_sizes, checkpoint, n, device) for n in tokens}}
    result["reference"] = _fresh(_reference, checkpoint, max(tokens), device)
    result["device"] = result["reference"].pop("device")
    result["bf16_autocast"] = result["reference"].pop("bf16_autocast")
    return result


def _fresh(fn, *args) -> dict:
    """`fn(*args)` in a new Python process of its own."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _sizes(checkpoint: str, tokens: int, device: str) -> dict:
    """Every configuration at `tokens` positions, one after another in this fresh process (the policy loaded
    once per checkpointing mode, gradients dropped and the C heap's free pages returned to the system before
    each step), after a warm-up step of 256 positions (oneDNN's kernels, torch's first allocations):
    {configuration: figures}, times as ratios to "off"'s."""
    import gc

    from meshrl.actors.distributed import Rank, load_on_ranks
    from meshrl.models.memory import MemoryChoice

    where = _setup(device)
    figures, off = {}, None
    for ac in dict.fromkeys(ac for ac, _ in SWITCHES.values()):
        model, _ = load_on_ranks(checkpoint, Rank(0, 1, where), None, MemoryChoice(ac, "float32", "float32"))
        if off is None:
            _train_step(model, SEQUENCE, 0, where)  # warm-up
        for name in (n for n, (mode, _) in SWITCHES.items() if mode == ac):  # "off" first: the others compare with it
            figures[name], grads = _train_step(model, tokens, SWITCHES[name][1], where)
            off = grads if off is None else off
            diff = (grads - off).abs().max().item()
            figures[name] |= {"grad_max_abs_diff_vs_off": diff, "grad_rel_diff_vs_off": diff / off.abs().max().item(),
                              "loss_diff_vs_off": figures[name]["loss"] - figures["off"]["loss"]}
            del grads
        del model
        gc.collect()
    for f in figures.values():
        f["seconds_vs_off"] = f["seconds"] / figures["off"]["seconds"]
    print(f"{tokens} tokens: " + json.dumps(figures), file=sys.stderr, flush=True)  # as it goes: a long run's figures so far
    return figures


def _batch(tokens: int):
    from meshrl.tools.bench.trainer import episodes
    from meshrl.types import TrainBatch

    data = episodes(tokens // SEQUENCE, 32, SEQUENCE - 32)
    return TrainBatch.collate(data, sum(e.num_response_tokens for e in data), len(data))


class _Peak:
    """Memory this process adds from `start()` to its peak, MB: VmHWM - VmRSS on the CPU, allocated on CUDA."""

    def __init__(self, device):
        self.device = device

    def start(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device) / 2**20
        else:
            from meshrl.actors import return_free_memory

            return_free_memory()
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.before = _status_mb("VmRSS")

    def added_mb(self) -> float:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) / 2**20 - self.before
        return _status_mb("VmHWM") - self.before


def _status_mb(field: str) -> float:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _setup(device: str):
    from meshrl.actors import resolve_device

    return resolve_device(device)


def _train_step(model, tokens: int, chunk: int, where) -> tuple[dict, object]:
    """One forward and backward of the trainer's loss: the memory it adds (gradients included: they are
    dropped first), its seconds and loss, and the gradients (flat, float32, on the host)."""
    import torch

    from meshrl.losses import LossConfig, policy_loss, policy_terms

    model.zero_grad(set_to_none=True)
    batch = _batch(tokens).to(where)
    peak = _Peak(where)
    peak.start()
    start = time.perf_counter()
    logprobs, entropy = policy_terms(model, batch, True, chunk, "metric")
    loss, _ = policy_loss(logprobs, batch, LossConfig(), entropy)
    loss.backward()
    added = peak.added_mb()
    seconds = time.perf_counter() - start
    grads = torch.cat([p.grad.flatten().float().cpu() for p in model.parameters() if p.grad is not None])
    return {"peak_added_mb": added, "seconds": seconds, "loss": loss.item(), "gradients_mb": grads.numel() * 4 / 2**20}, grads


def _reference(checkpoint: str, tokens: int, device: str) -> dict:
    """The reference in fp32, then in bf16 where the device has bf16 math (elsewhere a run refuses a bf16
    reference): the memory its weights add on loading, the peak its logprobs of `tokens` positions add, and
    the bf16 logprobs against fp32's."""
    import gc

    import torch

    from meshrl.actors import cpu_name
    from meshrl.actors.distributed import Rank, load_on_ranks
    from meshrl.losses import bf16_compute, policy_logprobs
    from meshrl.models.memory import MemoryChoice

    where = _setup(device)
    batch = _batch(tokens).to(where)
    load_on_ranks(checkpoint, Rank(0, 1, where), memory=MemoryChoice("off", "float32", "float32"), frozen=True)
    gc.collect()  # a first load, dropped: the model's code imported and torch's first allocations made
    bf16 = bf16_compute(where, True)
    out, values = {"device": cpu_name() if where.type == "cpu" else torch.cuda.get_device_name(where),
                   "bf16_autocast": bf16}, {}
    for dtype in ("float32", "bfloat16") if bf16 else ("float32",):
        load = _Peak(where)
        load.start()
        model, _ = load_on_ranks(checkpoint, Rank(0, 1, where), memory=MemoryChoice("off", "float32", dtype),
                                 frozen=True)
        if where.type == "cpu":  # what stays resident: the load's temporaries freed and handed back first
            from meshrl.actors import return_free_memory

            gc.collect()
            return_free_memory()
        weights = _status_mb("VmRSS") - load.before if where.type == "cpu" else load.added_mb()
        peak = _Peak(where)
        peak.start()
        values[dtype] = policy_logprobs(model, batch, True).cpu()
        out[dtype] = {"weights_mb": weights, "logprobs_peak_added_mb": peak.added_mb(),
                      "parameters_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
                      "logprob_max_abs_diff_vs_float32": (values[dtype] - values["float32"]).abs().max().item()}
        del model
        gc.collect()
    return out


def report(result: dict) -> str:
    lines = [f"trainer memory, {result['model']} on {result['device']}: what one forward and backward adds over "
             f"the loaded model (gradients included), {'bf16 autocast' if result['bf16_autocast'] else 'fp32 (no bf16 math)'}, "
             f"{result['sequence_tokens']} tokens a sequence"]
    names = list(result["switches"])
    lines.append(f"  {'tokens':>7s} " + " ".join(f"{n:>24s}" for n in names))
    for tokens, figures in result["sizes"].items():
        cells = [f"{figures[n]['peak_added_mb']:7.0f} MB {figures[n]['seconds_vs_off']:4.2f}x t "
                 f"{figures[n]['grad_rel_diff_vs_off']:6.0e}" for n in names]
        lines.append(f"  {tokens:>7s} " + " ".join(f"{c:>24s}" for c in cells))
    lines.append("  (each cell: peak memory added, time against off, largest gradient difference against off "
                 "relative to the largest gradient)")
    ref = result["reference"]
    if "bfloat16" not in ref:
        lines.append(f"  reference weights resident: float32 {ref['float32']['weights_mb']:.0f} MB (parameters "
                     f"{ref['float32']['parameters_mb']:.0f} MB); no bf16 reference here (no bf16 math: a run keeps it in fp32)")
        return "\n".join(lines)
    lines.append(f"  reference weights resident: float32 {ref['float32']['weights_mb']:.0f} MB, bfloat16 "
                 f"{ref['bfloat16']['weights_mb']:.0f} MB (parameters {ref['float32']['parameters_mb']:.0f} and "
                 f"{ref['bfloat16']['parameters_mb']:.0f} MB); bf16 logprobs within "
                 f"{ref['bfloat16']['logprob_max_abs_diff_vs_float32']:.3g} of fp32's")
    return "\n".join(lines)
