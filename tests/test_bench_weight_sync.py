"""`meshrl bench weight-sync` runs end to end and writes every figure it prints (tiny model, short, 2
trainer ranks: the one-rank ring is the same code with one ring, run by the stress and actor tests)."""

import json
import subprocess
import sys

from meshrl.model import load_hf_weights
from meshrl.weight_sync import WeightLayout

PER_RANKS = {"ring_rdma_gbps", "ring_shm_gbps", "publish_to_loaded_s", "torn_reads_detected", "torn_reads_loaded",
             "ring_rdma_vs_raw", "ring_shm_vs_memcpy", "generator_transport"}


def test_weight_sync_bench_writes_its_figures_for_the_rank_counts_asked(tmp_path, tiny_checkpoint):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "meshrl", "bench", "weight-sync", "--model", "tiny", "--repeats", "2",
                             "--stress-seconds", "3", "--ranks", "2", "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    # the whole model's bytes, whatever the ranks: two ranks' shards add up to it
    assert figures["bytes"] == WeightLayout.of_tensors(load_hf_weights(tiny_checkpoint)).nbytes
    assert figures["memcpy_gbps"] > 0 and figures["raw_rdma_gbps"] > 0
    assert "ranks_1" not in figures
    for ranks in ("ranks_2",):
        r = figures[ranks]
        assert PER_RANKS <= r.keys(), ranks
        assert r["ring_rdma_gbps"] > 0 and r["ring_shm_gbps"] > 0 and 0 < r["publish_to_loaded_s"] < 60
        assert r["torn_reads_loaded"] == 0 and r["stress"]["versions_published"] > 0
        assert all(n > 0 for n in r["stress"]["versions_loaded_per_generator"])
        assert f"trainer {ranks.replace('_', ' ')}" in result.stdout
    assert "ring_rdma_gbps" in result.stdout and "publish_to_loaded_s" in result.stdout
