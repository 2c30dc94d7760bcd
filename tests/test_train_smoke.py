"""`meshrl train --config smoke` end to end: real actors, real vLLM, real torchtitan, tiny model."""

import json
import math
import os
import subprocess
import sys

import pytest
from actor_helpers import vllm_generates

from meshrl.models.model import cache_dir, load_hf_weights
from meshrl.weight_sync.disk import versions

KEYS = {"step", "policy_version", "reward_mean", "reward_std", "accuracy", "format", "last_number", "loss",
        "updates", "tokens_generated", "tokens_trained", "step_time_s", "gen_time_s", "train_time_s", "weight_sync_s",
        "logprob_mismatch", "clip_fraction_low", "clip_fraction_high", "clip_fraction_by_update",
        "behaviour_weight_mean", "tis_fraction", "behaviour_kl"}
EVAL_KEYS = {"eval_accuracy", "eval_format", "eval_last_number"}
ROLLOUT_FIELDS = {"step", "prompt_index", "group", "prompt", "completion", "reward", "reward_components",
                  "policy_version", "staleness", "finish_reason", "logprob"}


def test_smoke_run_writes_metrics_plot_and_a_final_policy_vllm_loads(tmp_path, tiny_checkpoint):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
                             "--controller.steps", "3", "--trainer.mini_batches", "2"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for what in ("accuracy", "format", "last number"):
        assert f"eval {what}: step 0" in result.stdout
    # each eval (before training and after the last step) prints three example prompts and replies
    assert result.stdout.count("eval at step ") == 2
    assert result.stdout.count("  prompt: ") == result.stdout.count("  reply: ") == 6

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(KEYS <= r.keys() for r in rows)
    # versions count published steps, not optimizer updates (two per step here)
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    assert all(r["updates"] == 2 and len(r["clip_fraction_by_update"]) == 2 for r in rows)
    assert all(r["tokens_generated"] > 0 and r["tokens_trained"] > r["tokens_generated"] for r in rows)
    assert EVAL_KEYS <= rows[-1].keys() and not EVAL_KEYS & rows[0].keys()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert all(summary[f"{k}_final"] == rows[-1][k] and 0 <= summary[f"{k}_initial"] <= 1 for k in EVAL_KEYS)
    assert json.loads((run_dir / "config.json").read_text())["controller"]["steps"] == 3
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # TensorBoard reads back what metrics.jsonl says, key for key, step for step (lists as key/i)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from meshrl.runtime.loggers import scalars

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    logged = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    expected = [(tag, r["step"], v) for r in rows for tag, v in scalars(r).items() if tag != "step" and v == v]
    assert {tag for tag, _, _ in expected} == set(logged)
    assert "clip_fraction_by_update/1" in logged and "eval_format" in logged
    for tag, step, value in expected:
        assert logged[tag][step] == pytest.approx(value, rel=1e-6, abs=1e-12), (tag, step)

    # one record per trained completion: 2 prompts x 4 samples a step, nothing dropped in smoke
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [step for step in (1, 2, 3) for _ in range(8)]
    assert all(ROLLOUT_FIELDS <= r.keys() and r["staleness"] == 0 and r["finish_reason"] in ("stop", "length")
               and r["logprob"] < 0  # the sampled tokens' summed logprob
               and "Answer:" in r["prompt"] and set(r["reward_components"]) == {"correct", "format", "last_number"}
               for r in records)
    assert len({(r["step"], r["prompt_index"]) for r in records}) == 6  # each step trains its own prompts
    assert [r["policy_version"] for r in records] == [v for v in (0, 1, 2) for _ in range(8)]

    final = run_dir / "final"
    assert load_hf_weights(final).keys() == load_hf_weights(tiny_checkpoint).keys()
    assert not (failure := vllm_generates(final)), failure


@pytest.mark.parametrize("overrides, check", [
    # the KL penalty starts the ReferenceModel actor; GSPO's sequence ratio; RLOO's baseline; all on the
    # tiny Qwen3-MoE (the family's end-to-end run too: see trained_and_served)
    (["--trainer.loss.name", "gspo", "--trainer.loss.kl_coef", "0.05", "--controller.advantage", "rloo",
      "--model.source", "tiny_qwen3_moe"],
     lambda rows: all(r["kl"] >= 0 and r["entropy"] > 0 and r["tokens_trained"] > 0 for r in rows)),
    # the tiny random model never earns a reward: DAPO's dynamic sampling drops every group, and
    # the trainer still steps (on nothing) so the loop goes on; the batch trained has no rewards. Its
    # weights go by the plain path (saved, loaded from the file: checked in the test)
    (["--trainer.loss.name", "dapo", "--controller.drop_equal_reward_groups", "true",
      "--controller.max_sample_rounds", "2", "--weight_sync.transport", "disk"],
     lambda rows: all(r["groups_dropped"] == r["equal_reward_groups"] == 4 and r["tokens_trained"] == 0
                      and math.isnan(r["reward_mean"]) and math.isnan(r["accuracy"]) for r in rows)),
])
def test_smoke_runs_with_other_losses_and_estimators(tmp_path, overrides, check):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
                             *overrides], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert check(rows)
    if "--model.source" in overrides:
        trained_and_served(run_dir, overrides[overrides.index("--model.source") + 1])
    if "disk" in overrides:  # each version a file; the generator loaded both from there before generating
        assert versions(run_dir / "weights") == [1, 2]
        assert json.loads((run_dir / "placement.json").read_text())["generator"]["weight_transport"] == "disk"
        spans = [json.loads(line) for line in (run_dir / "trace.jsonl").read_text().splitlines()]
        assert sorted(s["policy_version"] for s in spans if s["what"] == "pull") == [1, 2]


def test_wandb_without_network_or_key_logs_offline_into_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    # no API key (a fresh HOME: no ~/.netrc), the model cache where it was
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {
        "HOME": str(tmp_path), "MESHRL_CACHE": str(cache_dir())}
    result = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "qwen3_smoke", "--run-dir",
                             str(run_dir), "--logging.wandb", "true", "--logging.rollouts_fraction", "0.5"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb")), list((run_dir / "wandb").iterdir())
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    kept = (run_dir / "rollouts.jsonl").read_text().splitlines()
    assert 0 < len(kept) < 16  # about half of the 2 x 8 trained completions
    trained_and_served(run_dir, "tiny_qwen3")  # qwen3_smoke: the Qwen3 family end to end


def test_a_checkpoint_directory_of_another_architecture_trains_through_the_transformers_backend(
        tmp_path, qwen2_checkpoint):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
                             "--model.source", str(qwen2_checkpoint)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    trained_and_served(run_dir, str(qwen2_checkpoint))


def trained_and_served(run_dir, source: str) -> None:
    """A family's end-to-end checks on a finished 2-step run: trained, the trainer scoring vLLM's samples
    as vLLM did (the step's logprob mismatch), the final policy an HF checkpoint of the same architecture
    that vLLM serves."""
    from meshrl.models.model import resolve_checkpoint

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2] and all(r["tokens_trained"] > 0 for r in rows)
    # step 1 trains samples of the checkpoint's own weights: vLLM's and the trainer's logprobs agree
    # (test_actors.py states the tolerance per family); step 2's, of version 1 as the ring delivered it
    # Qwen3-MoE after an update: 0.047 and 0.052 in two runs here (step 1: 0.0017); router near-ties picking
    # other experts in bf16 (test_actors.py) are the likely cause, not verified; the dense families keep 0.05
    bound = 0.08 if "moe" in source else 0.05
    assert all(r["logprob_mismatch"] < bound for r in rows), [r["logprob_mismatch"] for r in rows]
    final = run_dir / "final"
    assert load_hf_weights(final).keys() == load_hf_weights(resolve_checkpoint(source)).keys()
    assert json.loads((final / "config.json").read_text())["architectures"] == json.loads(
        (resolve_checkpoint(source) / "config.json").read_text())["architectures"]
    assert not (failure := vllm_generates(final)), failure
