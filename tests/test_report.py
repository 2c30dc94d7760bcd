"""`meshrl report` on hand-written run directories (fake runs: the figures are computed by hand)."""

import json

import pytest

from meshrl.tools.report import report, summarize


def write_fake_run(run_dir, rewards, tokens_trained, step_time, staleness_max=0, summary=None, trace=True):
    run_dir.mkdir(parents=True)
    """A run whose rows each train `tokens_trained` loss tokens of sequences three times as long (their prompts)."""
    rows = [{"step": i + 1, "reward_mean": r, "accuracy": r, "tokens_trained": tokens_trained,
             "tokens_processed": 3 * tokens_trained, "tokens_generated": tokens_trained // 4, "step_time_s": step_time,
             "staleness_mean": staleness_max / 2, "staleness_max": staleness_max, "publish_wait_s": 0.1,
             "longest_load_s": 0.5} for i, r in enumerate(rewards)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    if trace:
        spans = [{"role": "generator", "replica": 0, "what": "generate", "start": 0.0, "end": 1.0, "policy_version": 0},
                 {"role": "trainer", "replica": 0, "what": "train", "start": 0.5, "end": 2.0, "policy_version": 0}]
        (run_dir / "trace.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    return rows


def test_summarize_by_hand(tmp_path):
    rows = write_fake_run(tmp_path / "a", [0.1, 0.3, 0.8], tokens_trained=400, step_time=2.0, staleness_max=1,
                          summary={"eval_accuracy_initial": 0.25, "eval_accuracy_final": 0.75, "steps": 3})
    figures = summarize(rows, {"eval_accuracy_initial": 0.25, "eval_accuracy_final": 0.75, "steps": 3})
    assert figures == pytest.approx({
        "steps": 3, "wall_time_s": 6.0, "trained_tokens_per_s": 200.0, "processed_tokens_per_s": 600.0,
        "generated_tokens_per_s": 50.0, "reward_first": 0.1, "reward_last": 0.8, "eval_accuracy_initial": 0.25,
        "eval_accuracy_final": 0.75, "staleness_mean": 0.5, "staleness_max": 1, "publish_wait_s": 0.1,
        "longest_load_s": 0.5})


def test_a_run_from_before_the_token_split_reports_its_tokens_as_processed_and_no_weight_figures(tmp_path):
    rows = write_fake_run(tmp_path / "a", [0.1, 0.3], tokens_trained=100, step_time=1.0)
    for row in rows:  # as rows were written then: tokens_trained counted every token; one weight-sync figure
        row["tokens_trained"] = row.pop("tokens_processed")
        row["weight_sync_s"] = row.pop("publish_wait_s") + row.pop("longest_load_s")
    figures = summarize(rows, {})
    assert figures["processed_tokens_per_s"] == 300.0
    assert not {"trained_tokens_per_s", "publish_wait_s", "longest_load_s", "weight_sync_s"} & set(figures)


def test_restarts_per_role_are_the_runs_totals_from_its_last_row(tmp_path):
    rows = write_fake_run(tmp_path / "a", [0.1, 0.3], tokens_trained=100, step_time=1.0)
    rows[0] |= {"generator_restarts": 1, "grader_restarts": 0, "trainer_restarts": 0, "restart_seconds": 0.0}
    rows[1] |= {"generator_restarts": 2, "grader_restarts": 0, "trainer_restarts": 1, "restart_seconds": 3.5}
    figures = summarize(rows, {})
    assert {k: figures[k] for k in ("generator_restarts", "grader_restarts", "trainer_restarts", "restart_seconds")} == {
        "generator_restarts": 2, "grader_restarts": 0, "trainer_restarts": 1, "restart_seconds": 3.5}
    assert "reference_restarts" not in figures  # a run from before the reference was restarted: no blank figure


def test_report_puts_runs_side_by_side_and_redraws_their_plots(tmp_path):
    write_fake_run(tmp_path / "sync", [0.1, 0.5], tokens_trained=100, step_time=1.0,
                   summary={"eval_accuracy_initial": 0.2, "eval_accuracy_final": 0.6})
    write_fake_run(tmp_path / "async", [0.2, 0.4, 0.9], tokens_trained=300, step_time=0.5, staleness_max=1, trace=False)
    lines = report([tmp_path / "sync", tmp_path / "async"]).splitlines()
    assert lines[0].split() == ["sync", "async"]
    cells = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert cells["steps"] == ["2", "3"]
    assert cells["trained_tokens_per_s"] == ["100.000", "600.000"]
    assert cells["reward_last"] == ["0.500", "0.900"]
    assert cells["eval_accuracy_final"] == ["0.600"]  # the async run has no summary.json: a blank
    assert cells["staleness_max"] == ["0", "1"]
    for run in ("sync", "async"):
        assert (tmp_path / run / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "sync" / "timeline.png").is_file() and not (tmp_path / "async" / "timeline.png").exists()


def test_report_cli_prints_one_run_and_rejects_a_directory_that_is_not_a_run(tmp_path, cli):
    write_fake_run(tmp_path / "one", [0.1, 0.2], tokens_trained=100, step_time=1.0)
    code, out, _ = cli("report", tmp_path / "one")
    assert code == 0 and out.split()[0] == "one" and "trained_tokens_per_s" in out
    code, _, err = cli("report", tmp_path)
    assert code == 2
    assert err.strip().splitlines() == [f"meshrl: error: {tmp_path} is not a run directory: it has no metrics.jsonl"]
