"""Starting vLLM inside an actor's process, as a generator replica and a judge grader both do: the
environment vLLM reads at import (the engine in this process, its CPU KV cache, the cores its OpenMP
threads bind to, quiet logs, the GPUs), this process pinned to its cores, then the engine."""

import atexit
import gc
import os

from meshrl.actors import pin_cpus, resolve_device
from meshrl.actors.dtypes import bf16_choice


def start_vllm(checkpoint: str, *, dtype: str, max_model_len: int, memory_fraction: float, seed: int,
               num_threads: int, cpus: str, kv_cache_gib: int, devices: str = "", **options):
    """A `vllm.LLM` of `checkpoint` in this process (eager: no graph capture); `options` go to `LLM`. It
    answers one greedy token before it is returned, so that a model this engine cannot run here (vLLM's CPU
    attention refuses some head sizes only at the first request) fails the start with one line, not every
    replica's first call."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)  # the count we pin, rather than vLLM lowering it to 1
    if cpus:  # vLLM binds its OpenMP threads itself: to our cores, not to all of them
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    # vLLM's per-call CPU notices would drown the progress bar; VLLM_LOGGING_LEVEL=INFO brings them back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if devices:  # this replica's GPUs (meshrl/runtime/gpu_plan.py), before anything starts CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    pin_cpus(cpus, num_threads)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(checkpoint, dtype=vllm_dtype(dtype), max_model_len=max_model_len, gpu_memory_utilization=memory_fraction,
              seed=seed, enforce_eager=True, **options)
    try:  # greedy: draws nothing from the engine's random generator
        llm.generate([TokensPrompt(prompt_token_ids=[0])], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    except Exception as e:
        raise RuntimeError(f"vLLM cannot run {checkpoint} here: {e}") from None
    # vLLM shuts its in-process engine down when the process exits, with full garbage collections of a heap
    # the exit frees anyway (1.5 s of CPU a replica in a smoke run): the same shutdown, run just before
    # (atexit runs this first), without them.
    core = llm.llm_engine.engine_core
    if type(core).__name__ == "InprocClient" and (finalizer := getattr(core, "_finalizer", None)):
        atexit.register(_without_collections, finalizer)
    return llm


def _without_collections(shutdown) -> None:
    collect, gc.collect = gc.collect, lambda generation=2: 0
    try:
        shutdown()
    finally:
        gc.collect = collect


def vllm_dtype(dtype: str) -> str:
    """`auto`: bf16 or fp32 as meshrl/actors/dtypes.py chooses for vLLM's device (a GPU if there is one,
    else the CPU, measured with this process's threads; a run decides before its actors start and passes the
    answer); any other value goes to vLLM as it is."""
    if dtype != "auto":
        return dtype
    return bf16_choice(resolve_device("auto")).dtype
