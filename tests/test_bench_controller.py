"""`meshrl bench controller` (fake actors, so seconds): it writes the controller's cost for each replica
count, and its placement prediction follows the cost model it is given. With `--real` (stand-in actors in
Monarch processes, a minute): what it reports adds up, and it leaves no process behind."""

import json
import subprocess
import sys

import pytest
import psutil

pytestmark = pytest.mark.processes


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


def test_controller_bench_on_real_processes_counts_its_groups_carries_no_tokens_and_leaves_no_process(tmp_path):
    out = tmp_path / "real.json"
    result = subprocess.run([sys.executable, "-m", "meshrl", "bench", "controller", "--real", "--real-runs",
                             "4x16,4x2048", "--groups", "8", "--processes", "2", "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    short, long = figures["real"]
    for run, tokens in ((short, 16), (long, 2048)):
        # one group per actor each step, at least 3 steps, and the two evals' two prompts each
        assert run["max_tokens"] == tokens and run["steps"] == 3 and run["rows"] == 3
        assert run["groups"] == 3 * 4 + 4 and run["groups_per_s"] == run["groups"] / run["wall_s"]
        assert run["groups_regenerated"] == 0
        # the trainer stand-in took every trained token from the replay buffer, by BatchRef
        assert run["trainer_fetched"]["tokens"] >= 3 * 4 * 8 * tokens
        assert 0 < run["main_thread_cpu_ms_per_group"] < run["controller_cpu_ms_per_group"]
        assert run["groups_per_core_s"] == pytest.approx(1000 / run["controller_cpu_ms_per_group"])
        assert run["messages"]["generate"] >= run["groups"] and "score" not in run["messages"]  # graded on the way
        kill = run["supervision"]  # a generator process killed: its two replicas replaced on a fresh one
        assert kill["replicas_on_process"] == 2 and kill["serving_again"] == 2 and kill["restarts"] == 2
        assert kill["noticed_s"] <= kill["replaced_s"]
    # what reached the controller per group stayed flat while each completion grew 128 times
    assert abs(long["controller_bytes_in_per_group"] / short["controller_bytes_in_per_group"] - 1) < 0.1
    assert long["controller_bytes_in_per_group"] < 8 * 2048  # less than the group's tokens, a byte each
    assert [f["replicas"] for f in figures["in_process"]] == [4, 4]
    assert figures["processes_left"] == []
    assert figures["spawned_pids"] and not [p for p in figures["spawned_pids"] if psutil.pid_exists(p)]


def test_buffer_bench_puts_every_group_through_one_buffer_process_and_leaves_no_process(tmp_path):
    out = tmp_path / "buffer.json"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    result = subprocess.run([sys.executable, "-m", "meshrl", "bench", "buffer", "--max-tokens", "16", "--batches",
                             "2", "--batch-size", "16", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert [length["stage_add_sample"]["max_tokens"] for length in figures["lengths"]] == [16]
    for length in figures["lengths"]:
        for run in length.values():  # two timed batches of 16 groups, each staged, added, sampled and trained
            assert run["groups"] == 32 and run["groups_per_s"] == run["groups"] / run["seconds"]
            assert run["buffer_cpu_ms_per_group"] > 0
            assert run["groups_per_core_s"] == pytest.approx(1000 / run["buffer_cpu_ms_per_group"])
    assert "groups/s" in result.stdout
    assert not {p.pid for p in psutil.Process().children(recursive=True)} - before
