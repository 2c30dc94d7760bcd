"""The trainer, the reference model and the losses follow the device they are given: nothing in them
names the CPU, and a GPU host trains on its GPU (that test runs only where CUDA is)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import meshrl

SOURCE = Path(meshrl.__file__).parent


@pytest.mark.parametrize("module", ["actors/trainer.py", "actors/reference.py", "actors/distributed.py", "losses.py",
                                    "train_step.py"])
def test_no_line_assumes_the_cpu(module):
    text = (SOURCE / module).read_text()
    assert not re.findall(r"""["']cpu["']""", text), f"{module} names the CPU"


def test_auto_picks_cuda_only_when_there_is_one():
    from meshrl.actors import resolve_device

    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_a_batch_and_what_the_losses_make_follow_the_device():
    from meshrl.losses import on_positions
    from meshrl.types import Episode, TrainBatch

    episode = Episode(tokens=[1, 2, 3, 4], loss_mask=[False, False, True, True], behaviour_logprobs=[0, 0, -1, -2],
                      advantage=1.0, policy_version=0, group_id=0)
    batch = TrainBatch.collate([episode], 2, 1).to(torch.device("meta"))
    tensors = [v for v in vars(batch).values() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 6 and all(t.device.type == "meta" for t in tensors)
    assert batch.loss_tokens == 2
    values = torch.zeros(2, device="meta")
    assert on_positions(values, batch.loss_mask).device.type == "meta"


def test_bf16_autocast_only_where_the_cpu_has_bf16_math():
    from meshrl.losses import autocast

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    with autocast(torch.device("cpu"), True):
        on = torch.ones(2, 2) @ torch.ones(2, 2)
    with autocast(torch.device("cpu"), False):
        off = torch.ones(2, 2) @ torch.ones(2, 2)
    assert on.dtype == (torch.bfloat16 if native else torch.float32)  # emulated bf16 is slower than fp32
    assert off.dtype == torch.float32


def test_the_cpu_rule_picks_bf16_only_where_its_matmuls_are_faster_and_never_without_native_bf16():
    from meshrl.actors.dtypes import choose

    assert choose(True, 310.0, 240.0) == (True, "bf16 matmul 310 GFLOP/s > fp32 240")  # AMD EPYC-like
    assert choose(True, 160.0, 250.0) == (False, "bf16 matmul 160 GFLOP/s <= fp32 250")  # Xeon without AMX
    assert choose(True, 200.0, 200.0)[0] is False  # no gain: fp32's precision for free
    bf16, reason = choose(False)  # AVX2 only: nothing to measure
    assert bf16 is False and reason.startswith("no native bf16")
    with pytest.raises(ValueError, match="measuring"):
        choose(True)


class FakeMatmuls:
    """Stands in for meshrl.actors.dtypes.measure: counts its calls and gives fixed figures."""

    def __init__(self, bf16: float, fp32: float):
        self.figures, self.calls = (bf16, fp32), []

    def __call__(self, threads: int):
        self.calls.append(threads)
        return (*self.figures, 16)


def test_a_cpu_is_measured_once_per_model_threads_and_torch_version_then_read_from_the_cache(tmp_path, monkeypatch):
    from meshrl.actors import dtypes

    fake, cache = FakeMatmuls(120.0, 60.0), tmp_path / "bf16.json"
    monkeypatch.setattr(dtypes, "measure", fake)
    first = dtypes.cpu_choice(2, cache, native=True)
    assert first.bf16 and (first.bf16_gflops, first.fp32_gflops, first.threads) == (120.0, 60.0, 2)
    assert fake.calls == [2] and cache.is_file()
    fake.figures = (1.0, 1000.0)  # a second call reads the cache: these figures are never seen
    assert dtypes.cpu_choice(2, cache, native=True) == first and fake.calls == [2]
    assert dtypes.cpu_choice(1, cache, native=True).bf16 is False and fake.calls == [2, 1]  # other threads
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert dtypes.cpu_choice(2, cache, native=True).bf16 is False and fake.calls == [2, 1, 2]  # other torch
    assert len(json.loads(cache.read_text())) == 3
    # no native bf16: fp32 without a measurement, and nothing cached
    plain = dtypes.cpu_choice(4, tmp_path / "avx2.json", native=False)
    assert plain.dtype == "float32" and plain.bf16_gflops is None and fake.calls == [2, 1, 2]
    assert not (tmp_path / "avx2.json").exists()


def test_a_measurement_runs_sixteen_matmuls_of_a_smollm2_linear_layer(monkeypatch):
    """What keeps the start-up's measurement well under a second: 16 products, 16.3 GFLOP in all (at the
    40-60 GFLOP/s fp32 and 100-180 bf16 measured on 2 loaded cores here: about 0.35 s)."""
    from meshrl.actors import dtypes

    done = []

    def counted(a, b):  # counts the products and skips them: bf16's are emulated, slowly, on a CPU without it
        done.append((a.dtype, 2 * a.shape[0] * a.shape[1] * b.shape[1]))
        return a.new_empty(a.shape[0], b.shape[1])

    monkeypatch.setattr(torch, "mm", counted)
    bf16, fp32, runs = dtypes.measure(1)
    assert runs == len(done) == 16 and bf16 > 0 and fp32 > 0
    assert [d for d, _ in done].count(torch.bfloat16) == 8
    assert sum(f for _, f in done) == 8 * 2 * (128 + 1024) * 576 * 1536  # 16.3e9


def test_vllms_auto_dtype_follows_the_measured_rule(tmp_path, monkeypatch):
    from meshrl.actors import dtypes, has_bf16_math, resolve_device
    from meshrl.actors.engine import vllm_dtype

    if resolve_device("auto").type == "cuda":
        pytest.skip("vLLM's device here is a GPU: torch.cuda.is_bf16_supported() decides")
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path))
    native = has_bf16_math(torch.device("cpu"))
    monkeypatch.setattr(dtypes, "measure", FakeMatmuls(300.0, 200.0))
    assert vllm_dtype("auto") == ("bfloat16" if native else "float32")
    (tmp_path / dtypes.CACHE).unlink(missing_ok=True)
    monkeypatch.setattr(dtypes, "measure", FakeMatmuls(150.0, 250.0))
    assert vllm_dtype("auto") == "float32"
    assert vllm_dtype("bfloat16") == "bfloat16" and vllm_dtype("float32") == "float32"


def test_a_runs_auto_dtypes_are_written_into_its_config_and_each_role_says_why():
    from meshrl.actors.dtypes import Bf16Choice
    from meshrl.configs import Config
    from meshrl.runtime.dtypes import apply, wanted
    from meshrl.runtime.jobs import plan

    config = Config()
    config.trainer.loss.kl_coef, config.reference.num_threads = 0.1, 1
    roles = {"generator", "grader", "trainer", "reference", "replay_buffer", "judge"}
    assert wanted(config, plan(config), roles) == {"generator": ("", "auto", 2), "judge": ("", "auto", 1),
                                                   "trainer": ("", "auto", 2), "reference": ("", "auto", 1)}
    slow = Bf16Choice(False, "bf16 matmul 160 GFLOP/s <= fp32 250 on a Xeon, 2 threads", threads=2,
                      bf16_gflops=160.0, fp32_gflops=250.0)
    fast = Bf16Choice(True, "bf16 matmul 200 GFLOP/s > fp32 90 on a Xeon, 1 threads", threads=1,
                      bf16_gflops=200.0, fp32_gflops=90.0)
    chosen = apply(config, {"generator": slow, "judge": fast, "trainer": slow, "reference": fast}, roles)
    assert (config.generator.dtype, config.weight_sync.dtype, config.grader.judge.dtype) == (
        "float32", "float32", "bfloat16")
    assert (config.trainer.bf16_autocast, config.reference.bf16_autocast) == (False, True)
    assert chosen.summary()["trainer"] == {"dtype": "float32", "reason": slow.reason, "device": "cpu", "threads": 2,
                                           "bf16_gflops": 160.0, "fp32_gflops": 250.0}
    assert chosen.summary()["weight_sync"] == {"dtype": "float32", "reason": "what the generators serve"}
    assert chosen.describe() == [f"dtype: generator float32, trainer float32 ({slow.reason})",
                                 f"dtype: judge bfloat16, reference bf16 autocast ({fast.reason})"]

    # what the user set is kept, and said so; a role the run does not start is not asked about
    config = Config()
    config.generator.dtype, config.trainer.bf16_autocast = "bfloat16", False
    assert wanted(config, plan(config), {"generator", "trainer"}) == {}
    chosen = apply(config, {}, {"generator", "trainer"})
    assert chosen.summary() == {"generator": {"dtype": "bfloat16", "reason": "set by generator.dtype"},
                                "weight_sync": {"dtype": "bfloat16", "reason": "what the generators serve"},
                                "trainer": {"dtype": "float32", "reason": "set by trainer.bf16_autocast false"}}


class FakeHosts:
    """Stands in for a run's Hosts: every group's host is this one (a real Monarch host), and the roles
    whose host was asked for are noted."""

    def __init__(self):
        self.asked = []

    def host(self, role: str, index: int):
        from monarch.actor import this_host

        self.asked.append(role)
        return this_host()


@pytest.mark.processes
def test_roles_on_other_hosts_are_asked_there_once_per_host_by_a_probe_actor():
    import asyncio

    from meshrl.actors import resolve_device
    from meshrl.actors.dtypes import bf16_choice
    from meshrl.configs import Config
    from meshrl.runtime.dtypes import choose_dtypes
    from meshrl.runtime.jobs import RolePlacement

    config = Config()
    config.generator.num_threads = config.trainer.num_threads = 1
    placement = {"generator": RolePlacement("", 1, 1), "grader": RolePlacement("g", 1, 1),
                 "trainer": RolePlacement("g", 1, 1), "replay_buffer": RolePlacement("", 1, 1)}
    hosts = FakeHosts()
    chosen = asyncio.run(choose_dtypes(config, placement, hosts, {"generator", "grader", "judge", "trainer"}))
    assert hosts.asked == ["grader"]  # the judge is served in the grader replicas; one probe for group g
    rule = bf16_choice(resolve_device("auto"), 1)
    roles = chosen.summary()
    assert roles["generator"]["reason"] == roles["judge"]["reason"] == roles["trainer"]["reason"] == rule.reason
    assert (config.generator.dtype, config.grader.judge.dtype, config.trainer.bf16_autocast) == (
        rule.dtype, rule.dtype, rule.bf16)


def test_free_heap_memory_scattered_below_a_live_block_goes_back_to_the_system():
    """What a trainer's step leaves behind (meshrl/actors/__init__.py: return_free_memory): freed blocks
    that glibc's free() keeps because a live block lies above them."""
    import ctypes

    from meshrl.actors import resident_gb, return_free_memory

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    blocks = [libc.malloc(64 * 1024) for _ in range(2000)]  # 125 MB below glibc's mmap threshold: its heap
    for block in blocks:
        ctypes.memset(block, 1, 64 * 1024)
    for block in blocks[:-1]:
        libc.free(block)
    kept = resident_gb()
    assert return_free_memory()
    assert (kept - resident_gb()) * 1024 > 100
    libc.free(blocks[-1])


@pytest.mark.processes
def test_a_process_tuned_for_throughput_keeps_freed_heap_memory_and_collects_less_often():
    """The replay buffer's process (meshrl/actors/__init__.py: for_throughput): 125 MB of messages freed stay in
    its heap for the next ones, and its young generation is collected every 50,000 new objects, not 700. Each side
    in a fresh interpreter. What an untuned process gives back depends on what else its heap holds (glibc returns
    only the heap's free top, past a threshold it moves by itself): 0 MB in one venv here, 112 MB in a fresh
    clone's, so only the tuned side's memory is asserted."""
    script = """if True:
        import ctypes, gc, sys
        from meshrl.actors import for_throughput, resident_gb
        if sys.argv[1] == "tuned":
            for_throughput()
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        before = resident_gb()
        blocks = [libc.malloc(64 * 1024) for _ in range(2000)]
        for block in blocks:
            ctypes.memset(block, 1, 64 * 1024)
        for block in reversed(blocks):  # the heap's top last: all of it free
            libc.free(block)
        print((resident_gb() - before) * 1024, gc.get_threshold()[0])
    """
    kept = {}
    for side in ("plain", "tuned"):
        done = subprocess.run([sys.executable, "-c", script, side], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        mb, threshold = done.stdout.split()
        kept[side] = (float(mb), int(threshold))
    assert kept["plain"][1] == 700
    assert kept["tuned"][0] > 100 and kept["tuned"][1] == 50_000


@pytest.mark.processes
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_smoke_trains_on_the_gpu(tmp_path):
    result = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(tmp_path),
                             "--trainer.device", "cuda", "--reference.device", "cuda", "--trainer.loss.kl_coef", "0.01"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["kl"] == r["kl"] for r in rows)
    assert (tmp_path / "final" / "model.safetensors").is_file()
