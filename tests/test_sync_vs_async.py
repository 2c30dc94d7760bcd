"""One controller, two settings: max_policy_age=0 is synchronous, 1 overlaps generation with training.

Runs `meshrl bench sync-vs-async` on the tiny model (real actors, vLLM, torchtitan) and checks each
mode's staleness, the benchmark's figures and its plot.
"""

import json
import subprocess
import sys


def test_bench_runs_both_modes_with_bounded_staleness(tmp_path):
    out, png, runs = tmp_path / "bench.json", tmp_path / "bench.png", tmp_path / "runs"
    result = subprocess.run([sys.executable, "-m", "meshrl", "bench", "sync-vs-async", "--config", "bench_smoke",
                             "--steps", "3", "--json", str(out), "--plot", str(png), "--run-dir", str(runs)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "speedup" in result.stdout

    sync = [json.loads(line) for line in (runs / "sync" / "metrics.jsonl").read_text().splitlines()]
    async_ = [json.loads(line) for line in (runs / "async" / "metrics.jsonl").read_text().splitlines()]
    # max_policy_age=0 is the synchronous loop: every step trains on episodes of the current policy,
    # sampled after the previous step's weights were published, so the trainer always waits for them.
    assert [r["staleness_max"] for r in sync] == [0, 0, 0]
    assert all(r["wait_time_s"] > 0.5 * r["rollout_time_s"] for r in sync)
    assert all(r["batches_ready"] == 0 for r in sync)
    # max_policy_age=1: the generator samples ahead, so episodes are up to (and never more than) 1 step old
    assert max(r["staleness_max"] for r in async_) == 1
    assert all(0 <= r["staleness_mean"] <= r["staleness_max"] <= 1 for r in async_)
    assert all(r["groups_stale"] == 0 for r in sync)
    assert [r["policy_version"] for r in sync] == [r["policy_version"] for r in async_] == [1, 2, 3]

    for mode, age in (("sync", 0), ("async", 1)):
        f = figures[mode]
        assert f["max_policy_age"] == age and f["steps"] == 3
        assert f["trained_tokens_per_s"] > 0 and f["generated_tokens_per_s"] > 0
        assert 0 < f["generator_busy"] <= 1.05 and 0 < f["trainer_busy"] <= 1.05
        assert len(f["reward_vs_time"]) == 3
    assert figures["speedup"] == figures["async"]["trained_tokens_per_s"] / figures["sync"]["trained_tokens_per_s"]
    assert 1.0 <= figures["ideal_speedup"] <= 2.0

    # the timeline: every role's calls, one at a time per actor except the generator's groups (batched
    # together by vLLM); async overlaps generation with training, sync never does
    from meshrl.trace import read_spans

    def overlap(a, b):
        return a["start"] < b["end"] and b["start"] < a["end"]

    for mode, overlaps in (("sync", False), ("async", True)):
        spans = read_spans(runs / mode)
        assert {s["role"] for s in spans} == {"generator", "grader", "trainer"}
        assert {"generate", "pull", "evaluate", "grade", "train", "publish"} <= {s["what"] for s in spans}
        for role in ("grader", "trainer"):
            mine = sorted((s for s in spans if s["role"] == role), key=lambda s: s["start"])
            assert all(a["end"] <= b["start"] for a, b in zip(mine, mine[1:])), f"{mode}: {role} spans overlap"
        generating = [s for s in spans if s["what"] == "generate"]
        # sync: a replica loads a version before its groups of the batch start, never while they generate
        # (async: groups in flight finish under the new weights, stamped with the version they started from)
        pulls = [s for s in spans if s["what"] == "pull"]
        assert overlaps or not any(overlap(g, p) for g in generating for p in pulls if g["replica"] == p["replica"])
        training = [s for s in spans if s["what"] == "train"]
        assert any(overlap(g, t) for g in generating for t in training) == overlaps, mode
        assert all(s["policy_version"] is not None for s in generating + training)
        chrome = json.loads((runs / mode / "trace.json").read_text())
        complete = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
        assert len(complete) == len(spans) and all(e["dur"] >= 0 and "ts" in e for e in complete)
        assert (runs / mode / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
