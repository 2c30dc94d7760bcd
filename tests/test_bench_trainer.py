"""`meshrl bench trainer` runs the plain torch loop and the trainer actor (fed by the caller, and from a
replay buffer actor) on 2 ranks (real actors, tiny model, one timed step: one rank is the same code
with one rank, run by test_actors.py and the smoke runs) and writes every figure it prints."""

import json
import subprocess
import sys
import time


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
    for ranks in ("ranks_2",):
        r = figures[ranks]
        for k in ("plain_tokens_per_s", "trainer_tokens_per_s", "from_buffer_tokens_per_s"):  # a step's time,
            assert 0 < figures["tokens_per_step"] / r[k] < elapsed, k  # in seconds: within the bench's own
        assert abs(r["trainer_vs_plain"] - r["trainer_tokens_per_s"] / r["plain_tokens_per_s"]) < 1e-9
        assert abs(r["from_buffer_vs_plain"] - r["from_buffer_tokens_per_s"] / r["plain_tokens_per_s"]) < 1e-9
        # what it prints is what it wrote
        assert (f"loading: +{r['load_mb_per_rank']:.0f} MB per rank (peak {r['load_peak_rss_mb_per_rank']:.0f} MB)"
                in result.stdout)
        assert f"{r['trainer_tokens_per_s']:7.1f} tokens/s   ({r['trainer_vs_plain']:.2f} x plain)" in result.stdout
    # a LoRA adapter on the same ranks in the same run: its step against full fine-tuning's, and its peak memory
    lora, full = figures["lora"], figures["ranks_2"]
    assert lora["rank"] == 8 and 0 < figures["tokens_per_step"] / lora["trainer_tokens_per_s"] < elapsed
    assert abs(lora["vs_full"] - lora["trainer_tokens_per_s"] / full["trainer_tokens_per_s"]) < 1e-9
    assert abs(lora["peak_vs_full"] - lora["trainer_peak_rss_mb"] / full["trainer_peak_rss_mb"]) < 1e-9
    assert lora["trainer_peak_rss_mb"] < full["trainer_peak_rss_mb"]  # no gradient or AdamW state for the base
    assert "a LoRA adapter of rank 8 instead (2 rank(s))" in result.stdout


def test_a_batch_that_does_not_split_over_the_ranks_is_one_clear_error(tmp_path, cli):
    code, _, err = cli("bench", "trainer", "--model", "tiny", "--ranks", "2", "--batch", "3", "--json", tmp_path / "b.json")
    assert code == 2
    assert err.strip().splitlines() == ["meshrl: error: --batch 3 does not split over 2 ranks"]
    assert not (tmp_path / "b.json").exists()
