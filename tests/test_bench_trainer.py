"""`meshrl bench trainer` runs the plain torch loop and the trainer actor (taking its micro-batches from a
replay buffer actor, as in a run) on 2 ranks (real actors, tiny model, one timed step: one rank is the same code
with one rank, run by test_actors.py and the smoke runs) and writes every figure it prints."""

import json
import subprocess
import sys
import time

import pytest
import torch

from meshrl.actors import has_bf16_math
from meshrl.models.model import load_hf_weights

pytestmark = pytest.mark.processes


def test_trainer_bench_writes_its_figures_for_each_rank_count(tmp_path, tiny_checkpoint):
    out = tmp_path / "bench.json"
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "meshrl", "bench", "trainer", "--model", "tiny", "--ranks", "2",
                             "--batch", "4", "--prompt-tokens", "8", "--response-tokens", "16", "--repeats", "1", "--lora-rank", "8",
                             "--json", str(out)], capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["tokens_per_step"] == 4 * (8 + 16)
    assert "ranks_1" not in figures
    # the tiny model's parameters in float32, as the trainer holds them
    model_mb = sum(t.numel() for t in load_hf_weights(tiny_checkpoint).values()) * 4 / 2**20
    for ranks in ("ranks_2",):
        r = figures[ranks]
        seconds = {k: figures["tokens_per_step"] / r[k] for k in ("plain_tokens_per_s", "trainer_tokens_per_s")}
        # each way's warm-up and timed steps ran one after another within the bench, and each took at least
        # its best: the steps' seconds add up to less than the bench's wall time
        lora_s = figures["tokens_per_step"] / figures["lora"]["trainer_tokens_per_s"]
        assert (figures["repeats"] + 1) * (sum(seconds.values()) + lora_s) < elapsed, (seconds, lora_s, elapsed)
        # loading holds at least this rank's half of the model, and the trainer, which loads the same way
        # and then trains, peaks above the load alone
        assert r["load_mb_per_rank"] >= model_mb / 2, (r, model_mb)
        assert r["trainer_peak_rss_mb"] > r["load_peak_rss_mb_per_rank"], r
        assert abs(r["trainer_vs_plain"] - r["trainer_tokens_per_s"] / r["plain_tokens_per_s"]) < 1e-9
        # what it prints is what it wrote
        assert (f"loading: +{r['load_mb_per_rank']:.0f} MB per rank (peak {r['load_peak_rss_mb_per_rank']:.0f} MB)"
                in result.stdout)
        assert (f"{r['trainer_tokens_per_s']:7.1f} tokens/s   ({r['trainer_vs_plain']:.2f} x plain, from the replay "
                "buffer)" in result.stdout)
    # a LoRA adapter on the same ranks in the same run: its step against full fine-tuning's, and its peak memory
    lora, full = figures["lora"], figures["ranks_2"]
    assert lora["rank"] == 8
    assert abs(lora["vs_full"] - lora["trainer_tokens_per_s"] / full["trainer_tokens_per_s"]) < 1e-9
    assert abs(lora["peak_vs_full"] - lora["trainer_peak_rss_mb"] / full["trainer_peak_rss_mb"]) < 1e-9
    assert lora["trainer_peak_rss_mb"] < full["trainer_peak_rss_mb"]  # no gradient or AdamW state for the base
    assert "a LoRA adapter of rank 8 instead (2 rank(s))" in result.stdout


def test_a_batch_that_does_not_split_over_the_ranks_is_one_clear_error(tmp_path, cli):
    code, _, err = cli("bench", "trainer", "--model", "tiny", "--ranks", "2", "--batch", "3", "--json", tmp_path / "b.json")
    assert code == 2
    assert err.strip().splitlines() == ["meshrl: error: --batch 3 does not split over 2 ranks"]
    assert not (tmp_path / "b.json").exists()


def test_trainer_memory_bench_reports_less_peak_memory_with_chunked_logprobs(tmp_path):
    """`meshrl bench trainer --memory` on the tiny model at 2048 tokens (1792 trained positions of a 49k
    vocabulary, where the logits outweigh the two small layers): chunks of 1024 positions lower the peak that
    a forward and backward adds, with activation checkpointing or without; checkpointing gives the same
    loss and gradients bit for bit, chunks within bf16 rounding (autocast: the LM head's weight gradient is
    summed per chunk); the bf16 reference, where the CPU has bf16 math, holds fewer parameter bytes and gives
    fp32's logprobs exactly."""
    out = tmp_path / "memory.json"
    result = subprocess.run([sys.executable, "-m", "meshrl", "bench", "trainer", "--memory", "--model", "tiny",
                             "--tokens", "2048", "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    size = figures["sizes"]["2048"]
    assert set(size) == {"off", "chunked", "checkpointed", "both"}
    # measured: 1727 MB without chunks, 1049 MB with (whole logits: 1792 x 49152 x 4 B = 336 MB a copy)
    assert size["chunked"]["peak_added_mb"] < 0.8 * size["off"]["peak_added_mb"], size
    assert size["both"]["peak_added_mb"] < 0.8 * size["checkpointed"]["peak_added_mb"], size
    for f in size.values():  # every peak includes the gradients
        assert f["peak_added_mb"] > f["gradients_mb"] > 0
    assert size["checkpointed"]["grad_max_abs_diff_vs_off"] == 0 and size["checkpointed"]["loss_diff_vs_off"] == 0
    for name in ("chunked", "both"):  # measured: 3.6e-3 of the largest gradient
        assert 0 < size[name]["grad_rel_diff_vs_off"] < 2 ** -6 and abs(size[name]["loss_diff_vs_off"]) < 1e-5
    # the tiny model's weights are mostly its (fp32) embedding: fewer parameter bytes, the same logprobs; a CPU
    # without bf16 math (AVX2 only) computes in fp32 and has no bf16 reference to measure, and says so
    reference = figures["reference"]
    assert figures["bf16_autocast"] == has_bf16_math(torch.device("cpu"))
    if figures["bf16_autocast"]:
        assert reference["bfloat16"]["parameters_mb"] < reference["float32"]["parameters_mb"]
        assert reference["bfloat16"]["logprob_max_abs_diff_vs_float32"] == 0
    else:
        assert set(reference) == {"float32"} and "no bf16 reference here" in result.stdout
    off = size["off"]
    assert (f"{off['peak_added_mb']:7.0f} MB {off['seconds_vs_off']:4.2f}x t" in result.stdout)  # what it prints is what it wrote
