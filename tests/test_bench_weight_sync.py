"""`meshrl bench weight-sync` runs end to end and writes every figure it prints (tiny model, short, 2
trainer ranks: the one-rank ring is the same code with one ring, run by the stress and actor tests;
no stress phase: tests/test_weight_stress.py runs it)."""

import json
import subprocess
import sys
import time

import pytest

from meshrl.models.model import load_hf_weights
from meshrl.weight_sync import WeightLayout

pytestmark = pytest.mark.processes

PER_RANKS = {"ring_rdma_gbps", "ring_shm_gbps", "publish_to_loaded_s", "ring_rdma_vs_raw", "ring_shm_vs_memcpy", "generator_transport", "publish_s", "generator_read_s",
             "generator_load_s", "vllm_reload_floor_s"}


def test_weight_sync_bench_writes_its_figures_for_the_rank_counts_asked(tmp_path, tiny_checkpoint):
    out = tmp_path / "bench.json"
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "meshrl", "bench", "weight-sync", "--model", "tiny", "--repeats", "2",
                             "--stress-seconds", "0", "--ranks", "2", "--lora-rank", "8", "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    # the whole model's bytes, whatever the ranks: two ranks' shards add up to it
    assert figures["bytes"] == WeightLayout.of_tensors(load_hf_weights(tiny_checkpoint)).nbytes
    streams = [figures[f"raw_rdma_{n}_streams_gbps"] for n in (1, 2, 4, 8, 16)]
    assert figures["raw_rdma_gbps"] == max(streams)  # the floor: the best stream count
    # bytes through the RDMA layer over TCP (on this CPU machine) move slower than one copy of them in memory
    assert figures["rdma_backend"] == "tcp" and figures["raw_rdma_gbps"] < figures["memcpy_gbps"], figures
    # every figure is the best, or the median of 2, of `repeats` timed runs that ran one after another
    # within the bench: each counted `repeats` times, their seconds add up to less than its wall time
    timed = [figures["bytes"] / 1e9 / gbps for gbps in [figures["memcpy_gbps"], *streams]]
    assert "ranks_1" not in figures
    for ranks in ("ranks_2",):
        r = figures[ranks]
        assert PER_RANKS <= r.keys(), ranks
        # the ratios against their floors, as printed, from the figures written
        assert r["ring_shm_vs_memcpy"] == pytest.approx(r["ring_shm_gbps"] / figures["memcpy_gbps"])
        assert r["ring_rdma_vs_raw"] == pytest.approx(r["ring_rdma_gbps"] / figures["raw_rdma_gbps"])
        # publish to loaded holds the publish, the read and the load (medians of 2: means, which add up)
        assert 0 < r["publish_s"] + r["generator_read_s"] + r["generator_load_s"] <= r["publish_to_loaded_s"]
        # and the load in it reloads the same tensors into vLLM, which the floor times alone
        assert r["vllm_reload_floor_s"] < r["publish_to_loaded_s"], r
        timed += [figures["bytes"] / 1e9 / r["ring_rdma_gbps"], figures["bytes"] / 1e9 / r["ring_shm_gbps"],
                  r["publish_to_loaded_s"], r["vllm_reload_floor_s"]]
        assert "stress" not in r and "target ring_shm_vs_memcpy >= 0.6" in result.stdout
        assert f"trainer {ranks.replace('_', ' ')}" in result.stdout
    assert "ring_rdma_gbps" in result.stdout and "publish_to_loaded_s" in result.stdout
    # a LoRA adapter of rank 8 in the same run: its bytes are the adapter's, loaded by vLLM in place
    lora = figures["lora"]
    assert lora["rank"] == 8 and lora["bytes"] == 65536  # 28 matrices of 8 x 128 or 256, in the checkpoint's bf16
    assert 0 < lora["publish_s"] + lora["generator_read_s"] + lora["generator_load_s"] <= lora["publish_to_loaded_s"]
    timed.append(lora["publish_to_loaded_s"])
    assert figures["repeats"] * sum(timed) < elapsed, (timed, elapsed)
    assert lora["publish_to_loaded_vs_full"] == pytest.approx(lora["publish_to_loaded_s"]
                                                              / figures["ranks_2"]["publish_to_loaded_s"])
    assert f"a LoRA adapter of rank 8 instead (one rank): {65536 / 1e6:.2f} MB" in result.stdout
