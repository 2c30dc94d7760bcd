"""vLLM's options per device (meshrl/actors/engine.py: engine_settings, pure): CUDA graphs on a GPU and
eager on the CPU, the memory fraction a GPU plan gives or the device's default, tensor parallelism on
vLLM's multiprocessing executor, sleep mode only on a GPU, and the environment each device needs."""

import pytest

from meshrl.actors.engine import engine_settings
from meshrl.actors.engine import EngineConfig


def test_a_gpu_engine_captures_cuda_graphs_and_takes_most_of_its_gpu():
    s = engine_settings(EngineConfig(), on_gpu=True, devices="3")
    assert s.options == {"enforce_eager": False, "tensor_parallel_size": 1, "distributed_executor_backend": "uni",
                         "gpu_memory_utilization": 0.9, "enable_sleep_mode": False}
    assert s.environment == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "3"}
    # the plan's share of a GPU it shares, eager by option, sleep mode when the plan (or the user) says so
    s = engine_settings(EngineConfig(cuda_graphs="off", sleep="on"), on_gpu=True, memory_fraction=0.3)
    assert s.options["enforce_eager"] and s.options["gpu_memory_utilization"] == 0.3
    assert s.options["enable_sleep_mode"]


def test_a_cpu_engine_runs_eager_with_a_share_of_host_memory_and_its_own_kv_cache():
    s = engine_settings(EngineConfig(), on_gpu=False, num_threads=2, cpus="0-1", kv_cache_gib=3)
    assert s.options == {"enforce_eager": True, "tensor_parallel_size": 1, "distributed_executor_backend": "uni",
                         "gpu_memory_utilization": 0.2, "enable_sleep_mode": False}
    assert s.environment == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2",
                             "VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    # `auto` sleep not resolved by a GPU plan is off; GPU-only options asked for on the CPU are one clear error
    assert not engine_settings(EngineConfig(sleep="auto"), on_gpu=False).options["enable_sleep_mode"]
    for name in ("cuda_graphs", "sleep"):
        with pytest.raises(ValueError, match=f"generator.engine.{name} on needs a GPU; vLLM runs on the CPU here"):
            engine_settings(EngineConfig(**{name: "on"}), on_gpu=False)
    with pytest.raises(ValueError, match="unknown generator.engine.cuda_graphs 'yes'; known: auto, on, off"):
        engine_settings(EngineConfig(cuda_graphs="yes"), on_gpu=True)


def test_tensor_parallelism_runs_the_workers_on_vllms_multiprocessing_executor():
    """The engine core stays in the actor's process (the generator steps it); its workers, one per GPU,
    are processes of their own."""
    s = engine_settings(EngineConfig(), on_gpu=True, tensor_parallel_size=4, devices="4,5,6,7")
    assert s.options["distributed_executor_backend"] == "mp" and s.options["tensor_parallel_size"] == 4
    assert not s.options["enforce_eager"]
    assert s.environment["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert s.environment["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_tensor_parallelism_on_the_cpu_gives_each_worker_its_share_of_the_replicas_cores():
    s = engine_settings(EngineConfig(), on_gpu=False, tensor_parallel_size=2, cpus="4-7", cores=[4, 5, 6, 7])
    assert s.environment["VLLM_CPU_OMP_THREADS_BIND"] == "4,5|6,7"
    assert s.options["distributed_executor_backend"] == "mp"
    # an odd core left over goes unused rather than unevenly
    s = engine_settings(EngineConfig(), on_gpu=False, tensor_parallel_size=2, cores=[0, 1, 2])
    assert s.environment["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    with pytest.raises(ValueError, match="generator.tensor_parallel_size 4 on the CPU needs a core per worker; the "
                                         "replica has 2"):
        engine_settings(EngineConfig(), on_gpu=False, tensor_parallel_size=4, cores=[0, 1])


def test_batch_invariance_is_vllms_kernels_on_a_gpu_and_one_sequence_a_step_without_prefix_cache_on_the_cpu():
    """`batch_invariant`: vLLM's batch-invariant mode where it has one (a GPU); on the CPU, which has none, every
    engine step runs one sequence, and no prompt is computed from another's cached prefix: each sequence's
    numbers are then those of its own shapes alone (tests/test_checkpoint.py compares runs whose batches
    differ); off, neither."""
    gpu = engine_settings(EngineConfig(batch_invariant=True), on_gpu=True)
    assert gpu.environment["VLLM_BATCH_INVARIANT"] == "1" and "max_num_seqs" not in gpu.options
    cpu = engine_settings(EngineConfig(batch_invariant=True), on_gpu=False)
    assert "VLLM_BATCH_INVARIANT" not in cpu.environment
    assert cpu.options["max_num_seqs"] == 1 and cpu.options["enable_prefix_caching"] is False
    for on_gpu in (True, False):
        plain = engine_settings(EngineConfig(), on_gpu=on_gpu)
        assert "VLLM_BATCH_INVARIANT" not in plain.environment and "max_num_seqs" not in plain.options
        assert "enable_prefix_caching" not in plain.options
