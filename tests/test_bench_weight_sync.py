"""`meshrl bench weight-sync` runs end to end and writes every figure it prints (tiny model, short)."""

import json
import subprocess
import sys

from meshrl.model import load_hf_weights
from meshrl.weight_sync import WeightLayout

KEYS = {"bytes", "memcpy_gbps", "raw_rdma_gbps", "ring_rdma_gbps", "ring_shm_gbps", "publish_to_loaded_s",
        "torn_reads_detected", "torn_reads_loaded"}


def test_weight_sync_bench_writes_its_figures(tmp_path, tiny_checkpoint):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "meshrl", "bench", "weight-sync", "--model", "tiny", "--repeats", "3",
                             "--stress-seconds", "3", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert KEYS <= figures.keys()
    assert figures["bytes"] == WeightLayout.of_tensors(load_hf_weights(tiny_checkpoint)).nbytes
    assert all(figures[k] > 0 for k in ("memcpy_gbps", "raw_rdma_gbps", "ring_rdma_gbps", "ring_shm_gbps"))
    assert 0 < figures["publish_to_loaded_s"] < 60
    assert figures["torn_reads_loaded"] == 0 and figures["stress"]["versions_published"] > 0
    assert "ring_rdma_gbps" in result.stdout and "publish_to_loaded_s" in result.stdout
