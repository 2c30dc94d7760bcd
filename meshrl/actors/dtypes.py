"""bf16 or fp32 on a device, and why: the one rule behind vLLM's `dtype auto` (generator and judge), the
published weights' `weight_sync.dtype auto` that follows the generators, and the trainer's and reference's
bf16 autocast.

On a GPU, bf16 wherever torch says the GPU supports it. On a CPU, bf16 only where bf16 matrix products are
faster than fp32 there: without native bf16 instructions (AVX2 only) torch and vLLM emulate them (a SmolLM2
forward and backward took 26x as long as in fp32, vLLM sampled at a third of its fp32 speed), and even with
AVX512-BF16 they can be slower (2 cores of an Intel Xeon with AVX512-BF16 and no AMX: 153-167 GFLOP/s
against fp32's 228-318). So a CPU with native bf16 is measured: a few matmuls of a SmolLM2-sized linear
layer in each dtype (0.15-0.4 s on 2 cores), once per machine, cached in ~/.cache/meshrl keyed by what decides the
figures (the CPU's model and bf16 flags, torch's version, the thread count).

A run decides once, at its start, for every role (meshrl/runtime/dtypes.py) and hands the roles the result
in their configs, so that no actor process measures and all agree.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshrl.actors import cpu_name, has_bf16_math
from meshrl.models.model import cache_dir

if TYPE_CHECKING:
    import torch

# [tokens, 576] @ [576, 1536]: SmolLM2's MLP up-projection, at a decoding batch's and a training
# micro-batch's tokens
SHAPES = ((128, 576, 1536), (1024, 576, 1536))
REPEATS = 3  # timed products of each shape and dtype, the best kept (after one untimed)
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")  # /proc/cpuinfo's flags that decide bf16 speed
CACHE = "bf16_matmul.json"  # in meshrl's cache directory (MESHRL_CACHE, default ~/.cache/meshrl)


@dataclass(frozen=True)
class Bf16Choice:
    """What a device computes in, why, and the figures the reason rests on (CPUs that were measured)."""

    bf16: bool
    reason: str
    device: str = "cpu"  # cpu | cuda
    threads: int = 0  # the torch threads measured with (CPUs)
    bf16_gflops: float | None = None
    fp32_gflops: float | None = None

    @property
    def dtype(self) -> str:
        """vLLM's name for it."""
        return "bfloat16" if self.bf16 else "float32"

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def choose(native: bool, bf16_gflops: float | None = None, fp32_gflops: float | None = None) -> tuple[bool, str]:
    """The CPU rule: (bf16?, why). No native bf16 instructions: fp32, without measuring. Otherwise bf16
    only when its matrix products were measured faster than fp32's."""
    if not native:
        return False, "no native bf16 on this CPU (AVX2 only: bf16 would be emulated, many times slower than fp32)"
    if bf16_gflops is None or fp32_gflops is None:
        raise ValueError("a CPU with native bf16 is chosen for by measuring: give both figures")
    faster = bf16_gflops > fp32_gflops
    return faster, f"bf16 matmul {bf16_gflops:.0f} GFLOP/s {'>' if faster else '<='} fp32 {fp32_gflops:.0f}"


def measure(threads: int, shapes=SHAPES, repeats: int = REPEATS) -> tuple[float, float, int]:
    """(bf16 GFLOP/s, fp32 GFLOP/s, matmuls run) of `shapes` [m, k] @ [k, n] on `threads` torch threads:
    each shape's best of `repeats` timed products after one untimed, summed over the shapes."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    flops, best, runs = 0.0, {torch.bfloat16: 0.0, torch.float32: 0.0}, 0
    try:
        for m, k, n in shapes:
            pairs = {dtype: (torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)) for dtype in best}
            times = {dtype: [] for dtype in best}
            for _ in range(repeats + 1):  # the dtypes in turn: a load that comes and goes slows both alike
                for dtype, (a, b) in pairs.items():
                    start = time.perf_counter()
                    torch.mm(a, b)
                    times[dtype].append(time.perf_counter() - start)
                    runs += 1
            for dtype, taken in times.items():  # the first of each warms oneDNN's kernels and the caches
                best[dtype] += min(taken[1:])
            flops += 2 * m * k * n
    finally:
        torch.set_num_threads(before)
    return flops / best[torch.bfloat16] / 1e9, flops / best[torch.float32] / 1e9, runs


def cpu_key(threads: int) -> str:
    """What decides a CPU's figures: its model, its bf16 flags, torch's version and the threads."""
    import torch

    flags = set()
    try:
        with open("/proc/cpuinfo") as info:
            line = next((line for line in info if line.startswith("flags")), "")
        flags = set(line.split(":", 1)[-1].split())
    except OSError:
        pass
    present = ",".join(f for f in BF16_FLAGS if f in flags) or "none"
    return f"{cpu_name()} | {present} | torch {torch.__version__} | {threads} threads"


def cpu_choice(threads: int, cache: Path | None = None, native: bool | None = None) -> Bf16Choice:
    """The CPU rule on this machine with `threads` threads: from the cache when this machine (cpu_key) was
    measured before, else measured now and cached. `native` (tests): whether the CPU has bf16 instructions."""
    import torch

    if native is None:
        native = has_bf16_math(torch.device("cpu"))
    if not native:
        return Bf16Choice(*choose(False), threads=threads)
    path = cache or cache_dir() / CACHE
    key, known = cpu_key(threads), read_cache(path)
    if key not in known:
        bf16, fp32, _ = measure(threads)
        known[key] = {"bf16_gflops": round(bf16, 1), "fp32_gflops": round(fp32, 1)}
        write_cache(path, known)
    figures = known[key]
    bf16, reason = choose(True, figures["bf16_gflops"], figures["fp32_gflops"])
    return Bf16Choice(bf16, f"{reason} on {cpu_name()}, {threads} thread{'s' * (threads > 1)}", threads=threads, **figures)


def read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_cache(path: Path, known: dict) -> None:
    """Whole or not at all (a temporary file renamed): processes measuring at once each leave a valid file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(known, indent=1))
        temporary.replace(path)
    except OSError:  # a read-only home: measured again next time
        pass


def bf16_choice(device: torch.device, threads: int | None = None) -> Bf16Choice:
    """bf16 or fp32 on `device` and why: on CUDA what torch says of the GPU; on a CPU `cpu_choice` with
    `threads` threads (default: this process's torch threads)."""
    import torch

    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return Bf16Choice(ok, "CUDA: " + ("the GPU supports bf16" if ok else "this GPU has no bf16"), "cuda")
    return cpu_choice(threads or torch.get_num_threads())
