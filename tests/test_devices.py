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


def test_vllm_gets_bf16_only_where_the_device_has_bf16_math():
    from meshrl.actors import has_bf16_math, resolve_device
    from meshrl.actors.engine import vllm_dtype

    assert vllm_dtype("auto") == ("bfloat16" if has_bf16_math(resolve_device("auto")) else "float32")
    assert vllm_dtype("bfloat16") == "bfloat16" and vllm_dtype("float32") == "float32"


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_smoke_trains_on_the_gpu(tmp_path):
    result = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(tmp_path),
                             "--trainer.device", "cuda", "--reference.device", "cuda", "--trainer.loss.kl_coef", "0.01"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["kl"] == r["kl"] for r in rows)
    assert (tmp_path / "final" / "model.safetensors").is_file()
