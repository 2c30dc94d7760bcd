"""One controller, three settings: max_policy_age=0 is synchronous; 1 overlaps generation with training,
with generators that drain before loading new weights or that load them in flight.

Runs `meshrl bench sync-vs-async` on the tiny model (real actors, vLLM, torchtitan) and checks each
arm's staleness, the benchmark's figures, its plot and the timelines. In-flight loads themselves are
tested in test_weight_updates.py.
"""

import json
import subprocess
import sys
from statistics import fmean

import pytest
from assertions import assert_staleness_bound, read_jsonl

pytestmark = pytest.mark.processes

ARMS = ("sync", "async_drain", "async_in_flight")


def test_bench_runs_sync_and_both_async_arms_with_bounded_staleness(tmp_path):
    out, png, runs = tmp_path / "bench.json", tmp_path / "bench.png", tmp_path / "runs"
    result = subprocess.run([sys.executable, "-m", "meshrl", "bench", "sync-vs-async", "--config", "bench_smoke",
                             "--steps", "3", "--json", str(out), "--plot", str(png), "--run-dir", str(runs)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "speedup over sync" in result.stdout

    rows = {arm: [json.loads(line) for line in (runs / arm / "metrics.jsonl").read_text().splitlines()]
            for arm in ARMS}
    # max_policy_age=0 is the synchronous loop: every step trains on episodes of the current policy,
    # sampled after the previous step's weights were published, so the trainer always waits for them.
    sync = rows["sync"]
    assert_staleness_bound(sync, read_jsonl(runs / "sync" / "rollouts.jsonl"), 0)
    assert all(r["wait_time_s"] > 0.5 * r["rollout_time_s"] for r in sync)
    assert all(r["batches_ready"] == 0 and r["groups_stale"] == 0 for r in sync)
    for arm in ("async_drain", "async_in_flight"):  # the generators sample ahead: one step old at most, and reach it
        assert_staleness_bound(rows[arm], read_jsonl(runs / arm / "rollouts.jsonl"), 1, reached=True)
    for arm in ("sync", "async_drain"):  # a draining replica never swaps weights under running requests
        assert rows[arm][-1]["weight_swaps_in_flight"] == 0 and sum(r["tokens_after_swap"] for r in rows[arm]) == 0
    assert all(r["prefix_cache_resets_refused"] == 0 for arm in ARMS for r in rows[arm])
    assert {tuple(r["policy_version"] for r in rows[arm]) for arm in ARMS} == {(1, 2, 3)}

    for arm, age, update in (("sync", 0, "drain"), ("async_drain", 1, "drain"), ("async_in_flight", 1, "in_flight")):
        f, mine = figures[arm], rows[arm]
        config = json.loads((runs / arm / "config.json").read_text())  # what the arm's run really used
        assert (config["controller"]["max_policy_age"], config["generator"]["weight_update"], f["steps"]) == (age, update, 3)
        # each figure recomputed from the arm's own rows: over the steps' wall time
        wall = sum(r["step_time_s"] for r in mine)
        assert f["trained_tokens_per_s"] == pytest.approx(sum(r["tokens_trained"] for r in mine) / wall)
        assert f["generated_tokens_per_s"] == pytest.approx(sum(r["tokens_generated"] for r in mine) / wall)
        assert f["trainer_busy"] == pytest.approx(sum(r["trainer_busy"] * r["step_time_s"] for r in mine) / wall)
        assert 0 < f["generator_busy"] and f["generator_idle"] < 1
        # the trainer is busy while it trains and publishes: its share of each step lies between the two
        assert all(r["train_time_s"] - 1e-3 <= r["trainer_busy"] * r["step_time_s"]
                   <= r["train_time_s"] + r["publish_wait_s"] + 1e-3 for r in mine), arm
        assert [t for t, _ in f["reward_vs_time"]] == pytest.approx(
            [sum(r["step_time_s"] for r in mine[:i + 1]) for i in range(3)])
    for arm in ("drain", "in_flight"):
        assert figures[f"speedup_{arm}"] == (figures[f"async_{arm}"]["trained_tokens_per_s"]
                                             / figures["sync"]["trained_tokens_per_s"])
    # what overlapping the sync run's two phases could give at most, from its own phase times
    t_gen, t_train = fmean(r["rollout_time_s"] for r in sync), fmean(r["step_time_s"] - r["wait_time_s"] for r in sync)
    assert figures["ideal_speedup"] == pytest.approx((t_gen + t_train) / max(t_gen, t_train))

    # the timeline: every role's calls, one at a time per actor except the generator's groups (batched
    # together by vLLM); async overlaps generation with training, sync never does
    from meshrl.actors.trace import lane, read_spans

    def overlap(a, b):
        return a["start"] < b["end"] and b["start"] < a["end"]

    for arm in ARMS:
        spans = read_spans(runs / arm)
        # a single-turn task's grading is the generators' call (its "grade" spans on their lanes): no grader lane
        assert {s["role"] for s in spans} == {"generator", "trainer", "replay_buffer"}
        assert {"generate", "pull", "evaluate", "grade", "train", "publish"} <= {s["what"] for s in spans}
        # the trainer's own times beside the controller's: one call at a time on each lane (a publish
        # copies while the next step's passes run, below)
        assert {lane(s) for s in spans if s["role"] == "trainer"} == {"trainer 0", "trainer 0 asked"}
        for name in {lane(s) for s in spans if s["role"] != "generator"}:
            mine = sorted((s for s in spans if lane(s) == name and s["what"] != "publish"), key=lambda s: s["start"])
            assert all(a["end"] <= b["start"] for a, b in zip(mine, mine[1:])), f"{arm}: {name} spans overlap"
        # the weights a publish copies are never changed under it: the next optimizer update ends after it
        on_trainer = [s for s in spans if lane(s) == "trainer 0"]
        for p in (s for s in on_trainer if s["what"] == "publish"):
            assert all(p["end"] <= o["end"] for o in on_trainer if o["what"] == "optim_step" and o["start"] > p["start"])
        generating = [s for s in spans if s["what"] == "generate"]
        training = [s for s in spans if s["what"] == "train"]
        assert any(overlap(g, t) for g in generating for t in training) == (arm != "sync"), arm
        assert all(s["policy_version"] is not None for s in generating + training)
        chrome = json.loads((runs / arm / "trace.json").read_text())
        complete = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
        assert sorted((e["ts"], e["dur"], e["name"]) for e in complete) == sorted(  # every span, at its own times
            (s["start"] * 1e6, (s["end"] - s["start"]) * 1e6, s["what"]) for s in spans)
        assert (runs / arm / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
