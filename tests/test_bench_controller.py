"""`meshrl bench controller` (fake actors, so seconds): it writes the controller's cost for each replica
count, and its placement prediction follows the cost model it is given."""

import json
import subprocess
import sys


def test_controller_bench_writes_its_curve_and_a_prediction_that_follows_the_cost_model(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "meshrl", "bench", "controller", "--replicas", "1,16",
                             "--groups", "128", "--placement", "2:1:4", "--generate-s-per-token", "0.01",
                             "--train-s-per-token", "0.0003", "--time-scale", "10", "--json", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert [c["replicas"] for c in figures["cost"]] == [1, 16]
    for c in figures["cost"]:
        # at least 128 groups: whole steps of one group per replica, and the two evals' two prompts each
        assert c["steps"] == max(3, -(-128 // c["replicas"])) and c["groups"] == c["steps"] * c["replicas"] + 4
        assert c["groups_per_s"] == c["groups"] / c["wall_s"]
        # the controller's own CPU, on the one core the bench pins it to, fits in the wall time it took
        assert 0 < c["cpu_ms_per_group"] * c["groups"] / 1000 <= 1.05 * c["wall_s"], c
    # 4 groups of 8 x 32 tokens on 2 replicas: generation 32 x 0.01 s; training 1024 tokens x 0.0003 s
    p, generate, train = figures["placement"], 32 * 0.01, 4 * 8 * 32 * 0.0003
    assert generate + train <= p["sync_step_s"] < 1.5 * (generate + train), p  # the phases one after the other
    assert max(generate, train) <= p["async_step_s"] < p["sync_step_s"], p  # overlapped
    assert p["async_speedup"] == p["sync_step_s"] / p["async_step_s"]
    assert "groups/s" in result.stdout and "async speedup" in result.stdout
