"""Monarch actors, one role each. The controller finds each by the "module:Class" its config names.
torch and Monarch are imported where they are used: a grader's process never loads torch, and the run's
config (meshrl/configs, which reads each role's section from its meshrl/actors/*_config.py) loads neither, so
`meshrl check gpu` can stand in for Monarch where it is not installed."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from meshrl.plugins import load_object

if TYPE_CHECKING:
    import torch


def load_actor_class(impl: str):
    return load_object(impl, "actor implementation")


def spawn(name: str, cls, *args, host=None):
    """`cls` on a proc mesh of its own, one process on `host` (a host mesh of one host; default the
    controller's): (the mesh, to stop it; the actor)."""
    from monarch.actor import this_host

    procs = (host or this_host()).spawn_procs(per_host={"procs": 1}, name=name)
    return procs, procs.spawn(name, cls, *args)


async def rank_procs(name: str, ranks: int, hosts=None):
    """A proc mesh of `ranks` processes spread evenly over `hosts` (a host mesh; default the controller's
    host), each a rank of one torch.distributed job (RANK, WORLD_SIZE, MASTER_ADDR... set before any actor
    starts on it)."""
    from monarch.actor import this_host

    hosts = hosts or this_host()
    procs = hosts.spawn_procs(per_host={"procs": ranks // hosts.sizes.get("hosts", 1)}, name=name)
    if ranks > 1:
        from monarch.spmd import setup_torch_elastic_env_async

        await setup_torch_elastic_env_async(procs)
    return procs


async def spawn_ranks(name: str, cls, ranks: int, *args, hosts=None):
    """`cls` on a proc mesh of `ranks` ranks (`rank_procs`): (the mesh, the actor mesh with one `procs`
    dimension, rank order)."""
    procs = await rank_procs(name, ranks, hosts)
    actors = procs.spawn(name, cls, *args)
    return procs, actors.flatten("procs") if "hosts" in actors.sizes else actors


async def in_rank_order(calls) -> list:
    """Every rank's answer of an endpoint called on a whole mesh (`mesh.endpoint.call()`), rank 0 first."""
    return [value for _, value in (await calls).items()]


async def first(calls):
    """Rank 0's answer of an endpoint called on a whole mesh (one that every rank must take part in)."""
    return (await in_rank_order(calls))[0]


def parse_cpus(cpus: str) -> set[int]:
    """ "0", "0-3" or "0,2-3" -> {0, ...}; "" -> every CPU this process may use."""
    if not cpus:
        return os.sched_getaffinity(0)
    result = set()
    for part in cpus.split(","):
        first, _, last = part.partition("-")
        result.update(range(int(first), int(last or first) + 1))
    return result


def placement(cpus: str, index: int) -> str:
    """The cores of replica or rank `index`: `cpus` names one set for each ("0;1") or one set for all."""
    sets = cpus.split(";")
    return sets[index] if len(sets) > 1 else sets[0]


def resolve_device(device: str) -> torch.device:
    """ "auto": CUDA when this process sees a GPU, else the CPU; otherwise the device named ("cuda:1")."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def has_bf16_math(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively on `device`: CUDA GPUs that support bf16, and CPUs with
    AVX512-BF16 or AMX. Elsewhere (AVX2-only CPUs) torch and vLLM emulate them: measured here, a
    SmolLM2 forward and backward took 26x as long as in fp32, and vLLM sampled at a third of its fp32
    speed. No more accurate either: fp32 is the better choice there. This is the floor (bf16 autocast
    is never turned on without it); whether bf16 is worth it where it is native is
    meshrl/actors/dtypes.py's choice (some CPUs multiply slower in bf16 than in fp32)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_name() -> str:
    """The CPU's model name, for reports of where figures were measured."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def pin_cpus(cpus: str, num_threads: int) -> None:
    """Keep this actor's process and torch's threads on `cpus`, so roles do not fight over cores."""
    import torch

    os.sched_setaffinity(0, parse_cpus(cpus))
    torch.set_num_threads(num_threads)


def return_free_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`): whether any went back
    (False too where the C library is not glibc).
    Batches whose lengths vary from step to step leave the freed blocks of torch's CPU tensors scattered
    over glibc's 64 MB arena heaps, and a trainer's resident memory then grows step after step: 7.5 to
    9.5 GB for SmolLM2-135M on four-turn Zorplex, most of it free but never returned."""
    import ctypes

    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except AttributeError:  # not glibc (musl, macOS)
        return False


def for_throughput(gc_threshold: int = 50_000, heap_pad_mb: int = 256) -> None:
    """Tune this process for taking in thousands of sequences a second (the replay buffer's): Python's
    collector runs its young generation every `gc_threshold` new objects, not every 700 (each message unpickled
    makes thousands, and a collection also walks the groups held: 30% of the buffer's CPU); glibc grows its heap
    `heap_pad_mb` at a time and keeps what is freed (up to 4x that) for the next message, not returning it to the
    system and faulting it in again (unpickling 1,024 completions of 1,024 tokens: 34 us each, 8 us kept)."""
    import ctypes
    import gc

    gc.set_threshold(gc_threshold, *gc.get_threshold()[1:])
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-2, heap_pad_mb << 20)  # M_TOP_PAD
        libc.mallopt(-1, heap_pad_mb << 22)  # M_TRIM_THRESHOLD
    except AttributeError:  # not glibc (musl, macOS)
        pass


def resident_gb() -> float:
    """This process's resident memory (host RAM), GiB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
