"""Starting vLLM inside an actor's process, as a generator replica and a judge grader both do: the
engine's options and the environment vLLM reads at import, resolved for the device in one pure function
(`engine_settings`), this process pinned to its cores, then the engine.

On a GPU the engine captures CUDA graphs and takes the memory fraction the GPU plan gives it (all but a
margin of a GPU of its own, a share of one it shares: meshrl/runtime/gpu_plan.py); on the CPU it runs
eager with a share of host memory and its own KV-cache size. Its engine core always runs in this process
(the generator steps it between its own work, and a replica of tensor parallel size 1 loads weights into
its one worker, here, without a copy); with tensor parallelism the workers run in processes of their own
(vLLM's multiprocessing executor) and weights reach them through `LLM.collective_rpc`."""

import atexit
import gc
import os
from dataclasses import dataclass

from meshrl.actors import parse_cpus, pin_cpus, resolve_device
from meshrl.actors.dtypes import bf16_choice
from meshrl.checks import AUTO_ON_OFF, one_of

GPU_MEMORY_FRACTION = 0.9  # of a GPU to itself (vLLM's own default is 0.92): the margin is the CUDA context's and NCCL's
CPU_MEMORY_FRACTION = 0.2  # of host memory (vLLM's default fails on a machine it shares)


@dataclass
class EngineConfig:
    """The `generator.engine` section: vLLM's engine options that differ between a GPU and the CPU, each
    `auto` by default, resolved per device by `engine_settings` below (the GPU plan fills in the `auto`s
    that depend on the placement: meshrl/runtime/gpu_plan.py)."""

    cuda_graphs: str = "auto"  # capture CUDA graphs of the decoding steps (vLLM's enforce_eager off): auto (on a GPU; eager on the CPU) | on (GPU only) | off
    batch_invariant: bool = False  # each request's tokens and logprobs independent of what else the engine runs with it (exact resume and restarts compare bits across runs whose batches differ): on a GPU vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1; NVIDIA compute capability >= 8.0); on the CPU one sequence per engine step and no prefix cache (oneDNN's bf16 kernels round by batch shape on Intel CPUs with AMX), 5.4x the generation time measured (docs/running.md)
    sleep: str = "auto"  # vLLM's sleep mode: the engine frees its KV cache (and moves its weights to host memory) while a synchronous step trains on the GPU it shares; auto (on where the GPU plan puts the generator on a GPU with trainer or reference ranks and controller.max_policy_age is 0) | on (GPU only) | off

    def check(self) -> None:
        one_of(self, "generator.engine", cuda_graphs=AUTO_ON_OFF, sleep=AUTO_ON_OFF)


@dataclass(frozen=True)
class EngineSettings:
    options: dict  # keyword arguments of vllm.LLM
    environment: dict[str, str]  # set before vLLM is imported


def engine_settings(engine: EngineConfig, *, on_gpu: bool, tensor_parallel_size: int = 1,
                    memory_fraction: float = 0.0, num_threads: int = 1, cpus: str = "", kv_cache_gib: int = 1,
                    devices: str = "", cores: list[int] | None = None) -> EngineSettings:
    """vLLM's options and environment for `engine` on a GPU (`on_gpu`) or the CPU: CUDA graphs on a GPU,
    eager on the CPU (or by `cuda_graphs off`); `memory_fraction` 0 takes GPU_MEMORY_FRACTION or
    CPU_MEMORY_FRACTION; tensor parallelism runs vLLM's multiprocessing executor ("mp": a worker process
    per GPU), a size of 1 its executor in this process ("uni"); sleep mode only on a GPU (`sleep auto`
    here, not resolved by a GPU plan, is off); `batch_invariant` as EngineConfig says. On the CPU vLLM binds its OpenMP threads to `cpus`, and with
    tensor parallelism each worker to its share of `cores` (the replica's cores, in order: vLLM's own binding
    wants a NUMA node per worker). ValueError (one line) for a GPU option on the CPU, or fewer cores than
    workers."""
    engine.check()
    if not on_gpu:
        for name in ("cuda_graphs", "sleep"):
            if getattr(engine, name) == "on":
                raise ValueError(f"generator.engine.{name} on needs a GPU; vLLM runs on the CPU here")
    graphs = on_gpu and engine.cuda_graphs != "off"
    options = {"enforce_eager": not graphs, "tensor_parallel_size": tensor_parallel_size,
               "distributed_executor_backend": "mp" if tensor_parallel_size > 1 else "uni",
               "gpu_memory_utilization": memory_fraction or (GPU_MEMORY_FRACTION if on_gpu else CPU_MEMORY_FRACTION),
               "enable_sleep_mode": on_gpu and engine.sleep == "on"}
    environment = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process
                   "OMP_NUM_THREADS": str(num_threads)}  # the count we pin, rather than vLLM lowering it to 1
    if engine.batch_invariant and on_gpu:
        environment["VLLM_BATCH_INVARIANT"] = "1"
    elif engine.batch_invariant:  # the CPU has no batch-invariant kernels: every step a batch of one sequence
        options.update(max_num_seqs=1, enable_prefix_caching=False)
    if not on_gpu:
        environment["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        if tensor_parallel_size > 1:  # "0-3|4-7": each worker its own cores
            cores = list(cores or [])
            if len(cores) < tensor_parallel_size:
                raise ValueError(f"generator.tensor_parallel_size {tensor_parallel_size} on the CPU needs a core per "
                                 f"worker; the replica has {len(cores)}")
            each = len(cores) // tensor_parallel_size
            environment["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(map(str, cores[w * each:(w + 1) * each])) for w in range(tensor_parallel_size))
        elif cpus:  # vLLM binds its OpenMP threads itself: to our cores, not to all of them
            environment["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    if devices:  # this replica's GPUs (meshrl/runtime/gpu_plan.py), before anything starts CUDA
        environment["CUDA_VISIBLE_DEVICES"] = devices
    return EngineSettings(options, environment)


def start_vllm(checkpoint: str, *, dtype: str, max_model_len: int, memory_fraction: float, seed: int,
               num_threads: int, cpus: str, kv_cache_gib: int, devices: str = "", tensor_parallel_size: int = 1,
               engine: EngineConfig | None = None, **options):
    """A `vllm.LLM` of `checkpoint` in this process, set up by `engine_settings` for the device it finds
    (a GPU if `devices`, or the process, sees one); `options` go to `LLM`. It answers one greedy token
    before it is returned, so that a model this engine cannot run here (vLLM's CPU attention refuses some
    head sizes only at the first request) fails the start with one line, not every replica's first call."""
    if devices:  # before torch counts the GPUs (through NVML: no CUDA context is made here)
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    import torch

    settings = engine_settings(engine or EngineConfig(), on_gpu=torch.cuda.device_count() > 0,
                               tensor_parallel_size=tensor_parallel_size, memory_fraction=memory_fraction,
                               num_threads=num_threads, cpus=cpus, kv_cache_gib=kv_cache_gib, devices=devices,
                               cores=sorted(parse_cpus(cpus)))
    os.environ.update(settings.environment)
    # vLLM's per-call CPU notices would drown the progress bar; VLLM_LOGGING_LEVEL=INFO brings them back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    pin_cpus(cpus, num_threads)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(checkpoint, dtype=vllm_dtype(dtype), max_model_len=max_model_len, seed=seed,
              **settings.options, **options)
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
