"""`meshrl study`: the runner's resume logic with a fake `meshrl train` (pure logic, milliseconds), the
reports' arithmetic by hand, and the plain weight path and the bit-for-bit check in isolation."""

import json
import math
import statistics

import pytest
import torch

from meshrl.configs.named import load_config
from meshrl.configs.recipe import recipe_hash
from meshrl.tasks.zorplex import Zorplex, ZorplexConfig
from meshrl.tools.cli import main
from meshrl.tools.studies import mean_spread, time_to_reach
from meshrl.tools.studies.weight_sync_equivalence import publish_to_served, same_samples
from meshrl.tools.study import Study, StudyFailed, StudyRun, finished, run_study, selected, stale, write_report
from meshrl.weight_sync.disk import DiskHandle, DiskReader, read_version, versions, write_version
from meshrl.weight_sync.verify import bitwise_differences


class FakeTrain:
    """Stands in for `meshrl train`: writes what a finished run writes (its reward = the run's number);
    `interrupt_at`: the run whose training is cut short by a Ctrl-C (it leaves a partial run directory)."""

    def __init__(self, interrupt_at: str | None = None):
        self.calls, self.interrupt_at = [], interrupt_at

    def __call__(self, command: list[str], log) -> int:
        run_dir = log.parent
        name = run_dir.name
        self.calls.append(name)
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
        for kept in ("checkpoints/step-1", "final"):  # as a real run leaves them
            (run_dir / kept).mkdir(parents=True)
            (run_dir / kept / "model.safetensors").write_bytes(b"weights")
        if name == self.interrupt_at:
            (run_dir / "summary.json").write_text(json.dumps({"steps": 1, "stopped_by": "SIGINT"}))
            raise KeyboardInterrupt
        steps = int(command[command.index("--controller.steps") + 1])
        (run_dir / "summary.json").write_text(json.dumps({"steps": steps, "eval_accuracy_final": float(name[-1]), "config_hash": hash_of(command)}))
        return 0


def hash_of(command: list[str]) -> str:
    """The recipe hash a real run of `command` (meshrl train --config NAME --run-dir DIR ...) records."""
    return recipe_hash(load_config(command[3], command[6:]))


def recipe_of(study: Study, run_dir) -> StudyRun:
    return next(r for r in study.runs if r.name == run_dir.name)


def tiny_study(reported: list) -> Study:
    runs = [StudyRun(f"run{i}", "smoke", ["--controller.steps", "3"]) for i in range(3)]

    def report(directory, runs_):
        finals = [json.loads((directory / r.name / "summary.json").read_text())["eval_accuracy_final"] for r in runs_]
        reported.append(finals)
        return f"finals: {finals}"
    return Study("tiny", "a question", runs, report)


def test_a_study_stopped_midway_goes_on_without_redoing_finished_runs(tmp_path):
    reported = []
    study, say = tiny_study(reported), []
    interrupted = FakeTrain(interrupt_at="run1")
    with pytest.raises(KeyboardInterrupt):
        run_study(study, tmp_path, interrupted, say.append)
    assert interrupted.calls == ["run0", "run1"] and not (tmp_path / "report.md").exists()
    assert finished(tmp_path / "run0", study.runs[0]) and not finished(tmp_path / "run1", study.runs[1])
    # a finished run's checkpoints (for a resume it will never need) are removed, its final policy kept; an
    # unfinished run keeps its own for `meshrl train --resume`
    assert not (tmp_path / "run0" / "checkpoints").exists() and (tmp_path / "run0" / "final").is_dir()
    assert (tmp_path / "run1" / "checkpoints" / "step-1").is_dir()
    before = (tmp_path / "run0" / "summary.json").stat().st_mtime_ns

    again = FakeTrain()
    path = run_study(study, tmp_path, again, say.append)
    assert again.calls == ["run1", "run2"]  # run0 kept, run1 started over, run2 new
    assert (tmp_path / "run0" / "summary.json").stat().st_mtime_ns == before
    assert reported == [[0.0, 1.0, 2.0]]
    text = path.read_text()
    assert "finals: [0.0, 1.0, 2.0]" in text and "Machine: " in text
    assert "meshrl train --config smoke --run-dir " + str(tmp_path / "run2") + " --controller.steps 3" in text
    assert any("finished before, kept" in line for line in say)

    third = FakeTrain()  # everything finished: nothing runs, the report is written again
    run_study(study, tmp_path, third, say.append)
    assert third.calls == [] and reported[-1] == [0.0, 1.0, 2.0]


def test_a_part_of_a_study_runs_alone_and_the_report_covers_every_finished_run(tmp_path):
    reported = []
    study = tiny_study(reported)
    first = FakeTrain()
    run_study(study, tmp_path, first, lambda line: None, runs=selected(study, "run2"))
    assert first.calls == ["run2"] and reported == [[2.0]]
    second = FakeTrain()
    text = run_study(study, tmp_path, second, lambda line: None, runs=selected(study, "run[01]")).read_text()
    assert second.calls == ["run0", "run1"] and reported[-1] == [0.0, 1.0, 2.0]
    assert "Not finished yet" not in text


def test_a_report_only_from_the_runs_finished_so_far_names_the_others_and_needs_one(tmp_path, capsys):
    reported = []
    study = tiny_study(reported)
    with pytest.raises(StudyFailed, match=r"no run of study tiny has finished in .* yet: `meshrl study tiny --dir"):
        write_report(study, tmp_path)
    with pytest.raises(KeyboardInterrupt):  # run0 finishes, run1 is cut short, run2 never starts
        run_study(study, tmp_path, FakeTrain(interrupt_at="run1"), lambda line: None)
    text = write_report(study, tmp_path).read_text()
    assert reported == [[0.0]]  # the partial run1 is not read
    assert "finals: [0.0]" in text and "Not finished yet, left out of this report: run1, run2." in text
    # run0's recipe resolves to other settings now (as when a named config changes): stale, not current
    summary = json.loads((tmp_path / "run0" / "summary.json").read_text())
    (tmp_path / "run0" / "summary.json").write_text(json.dumps(summary | {"config_hash": "0" * 16}))
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "study_run.json").write_text(json.dumps(study.runs[2].recipe()))
    (tmp_path / "run2" / "summary.json").write_text(json.dumps(summary | {"config_hash": study.runs[2].config_hash()}))
    text = write_report(study, tmp_path).read_text()
    assert reported[-1] == [0.0] and "finals: [0.0]" in text  # run2's alone
    assert "Stale, left out of this report (they trained another recipe than the study's now): run0." in text
    assert "Not finished yet, left out of this report: run1." in text
    empty = tmp_path / "nothing-here"
    assert main(["study", "difficulty", "--report-only", "--dir", str(empty)]) == 2
    assert capsys.readouterr().err.strip() == (f"meshrl: error: no run of study difficulty has finished in {empty} "
                                               f"yet: `meshrl study difficulty --dir {empty}` runs them")


def test_the_sync_vs_async_report_from_one_finished_run_shows_its_arm_alone(tmp_path):
    from meshrl.tools.studies import STUDIES

    run_dir = tmp_path / "async_age1_seed0"
    run_dir.mkdir()
    rows = [{"step": s, "step_time_s": 20.0, "accuracy": 0.1 * s, "tokens_trained": 400, "tokens_processed": 600,
             "tokens_generated": 100, "wait_time_s": 0.0, "train_time_s": 20.0, "publish_wait_s": 0.05,
             "longest_load_s": 0.2, "generator_idle": 0.5,
             "staleness_mean": 1.0, "staleness_max": 1, "reward_mean": 0.1 * s, **({"eval_accuracy": 0.25} if s == 10 else {})} for s in range(1, 11)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    study = STUDIES["sync-vs-async"]
    (run_dir / "study_run.json").write_text(json.dumps(next(r for r in study.runs if r.name == run_dir.name).recipe()))
    (run_dir / "summary.json").write_text(json.dumps({"config_hash": recipe_of(study, run_dir).config_hash(), "steps": 10, "eval_accuracy_initial": 0.0,
                                                      "eval_accuracy_final": 0.25, "eval_format_final": 1.0}))
    (tmp_path / "sync_seed0").mkdir()  # cut short: not read
    (tmp_path / "sync_seed0" / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    text = write_report(study, tmp_path).read_text()
    arm_rows = [line for line in text.splitlines() if line.startswith("| async_age1 |")]
    assert len(arm_rows) == 2 and "0.250 (one run)" in arm_rows[0]
    assert "| 200 | 20.0 | 0.0 | 20.0 | 0.05 | 0.20 | 20 | 5 | 0.50 | 1.00 |" in arm_rows[1]  # 4000 loss tokens in 200 s
    # the train accuracy's 3-step mean first reaches 0.5 at step 6 (0.4 + 0.5 + 0.6) / 3, after 120 s
    assert "| 120 s (1/1) |" in arm_rows[0]
    assert "| sync |" not in text and "against sync" not in text
    assert "left out of this report: sync_seed0, async_age2_seed0, sync_seed1," in text


def test_the_replay_report_counts_tokens_per_point_of_accuracy_and_the_share_reused(tmp_path):
    from meshrl.tools.studies import STUDIES

    study = STUDIES["replay"]
    for name, reused, final in (("fifo_seed0", 0, 0.25), ("replay_reuse2_ahead0_seed0", 16, 0.5)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        rows = [{"step": s, "tokens_generated": 1000 if reused == 0 else 500, "episodes_trained": 64,
                 "episodes_reused": 0 if s == 1 else reused, "staleness_mean": 0.5, "step_time_s": 20.0}
                for s in range(1, 11)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run_dir / "study_run.json").write_text(json.dumps(next(r for r in study.runs if r.name == name).recipe()))
        (run_dir / "summary.json").write_text(json.dumps({"config_hash": recipe_of(study, run_dir).config_hash(), "steps": 10, "eval_accuracy_initial": 0.0, "wall_time_s": 250,
                                                          "eval_accuracy_final": final, "eval_last_number_final": 0.5}))
    text = write_report(study, tmp_path).read_text()
    fifo = next(line for line in text.splitlines() if line.startswith("| fifo |"))
    replay = next(line for line in text.splitlines() if line.startswith("| replay_reuse2_ahead0 |"))
    # 10,000 tokens for 25 points: 400 a point; 5,000 for 50 points: 100; 144 of 640 episodes reused
    assert "| 10000 | 640 | 400.000 (one run) | 0.00 |" in fifo
    assert "| 5000 | 640 | 100.000 (one run) | 0.23 |" in replay


def test_seeded_requests_are_refused_for_multi_turn_tasks():
    from meshrl.configs.named import load_config
    from meshrl.runtime.launch import actor_classes

    with pytest.raises(ValueError, match="generator.request_seeds is for single-turn tasks"):
        actor_classes(load_config("zorplex_smollm2", ["--generator.request_seeds", "true"]))
    assert actor_classes(load_config("smoke", ["--generator.request_seeds", "true"]))  # single-turn: fine


def test_a_run_that_fails_stops_the_study_with_one_line_naming_its_log(tmp_path):
    study = tiny_study([])
    with pytest.raises(StudyFailed, match=r"run run0 ended with exit code 1 .*train.log.*goes on from it"):
        run_study(study, tmp_path, lambda command, log: 1, lambda line: None)


def test_finished_needs_every_step_and_an_ending_of_its_own(tmp_path):
    run = StudyRun("r", "smoke", ["--controller.steps", "4"])
    ours = {"config_hash": run.config_hash()}
    for name, summary in {"ok": {"steps": 4}, "short": {"steps": 3}, "stopped": {"steps": 4, "stopped_by": "SIGTERM"},
                          "failed": {"steps": 4, "failed": "the trainer died"}, "unrecorded": {"steps": 4},
                          "changed": {"steps": 4}, "no_hash": {"steps": 4}, "other_hash": {"steps": 4}}.items():
        (tmp_path / name).mkdir()
        hashed = {"no_hash": {}, "other_hash": {"config_hash": hash_of(
            ["meshrl", "train", "--config", "smoke", "--run-dir", "r", "--controller.steps", "4", "--trainer.lr", "1"])}}
        (tmp_path / name / "summary.json").write_text(json.dumps(summary | hashed.get(name, ours)))
        if name != "unrecorded":
            (tmp_path / name / "study_run.json").write_text(json.dumps(run.recipe()))
    # the study's run has a new override since "changed" ran: it is not that run any more
    changed = StudyRun("r", "smoke", ["--controller.steps", "4", "--trainer.lr", "1"])
    (tmp_path / "changed" / "study_run.json").write_text(json.dumps(changed.recipe()))
    # "other_hash" ran the same config and overrides, but they resolved to other settings then (a named
    # config since changed): a stale run, and one with no hash at all is one from before hashes
    names = ("ok", "short", "stopped", "failed", "unrecorded", "changed", "no_hash", "other_hash", "absent")
    assert [n for n in names if finished(tmp_path / n, run)] == ["ok"]
    assert [n for n in names if stale(tmp_path / n, run)] == ["unrecorded", "changed", "no_hash", "other_hash", "absent"]


def test_the_study_command_lists_dry_runs_and_refuses_unknown_names(tmp_path, cli):
    code, listed, _ = cli("study", "--list")
    assert code == 0
    assert [line.split()[0] for line in listed.splitlines()] == ["weight-sync-equivalence", "sync-vs-async",
                                                                  "difficulty", "replay", "curriculum",
                                                                  "demo-settings", "demo-heldout", "demo-recipe", "calculator",
                                                                  "unified-model"]
    code, out, _ = cli("study", "sync-vs-async", "--dry-run", "--dir", tmp_path)
    commands = out.splitlines()
    assert code == 0
    assert len(commands) == 9 and all(c.startswith("meshrl train --config sum_digits_smollm2") for c in commands)
    assert sum("--controller.max_policy_age 2" in c for c in commands) == 3
    assert {c.split("--generator.seed ")[1].split()[0] for c in commands} == {"0", "1", "2"}
    assert not any(tmp_path.iterdir())  # a dry run starts nothing
    code, out, _ = cli("study", "sync-vs-async", "--dry-run", "--dir", tmp_path, "--runs", "async_*_seed0, sync_seed2")
    assert code == 0
    assert [c.split("--run-dir ")[1].split()[0] for c in out.splitlines()] == [
        str(tmp_path / name) for name in ("async_age1_seed0", "async_age2_seed0", "sync_seed2")]  # the study's order
    code, _, err = cli("study", "sync-vs-async", "--dry-run", "--runs", "sync_seed0,lr_*")
    assert code == 2 and "no run of study sync-vs-async matches lr_*; its runs: sync_seed0, " in err
    code, _, err = cli("study", "difficult")
    assert code == 2
    assert ("unknown study 'difficult'; known: weight-sync-equivalence, sync-vs-async, difficulty, replay, curriculum, "
            "demo-settings") in err


def test_mean_spread_and_time_to_reach_by_hand():
    assert mean_spread([0.5, 0.7, 0.6]) == "0.600 ± 0.100 (0.500-0.700, n=3)"
    assert mean_spread([0.25, math.nan]) == "0.250 (one run)" and mean_spread([]) == "n/a"
    times, values = [10, 20, 30, 40, 50], [0.25, 0.75, 0.5, 0.75, 1.0]
    assert time_to_reach(times, values, 0.5) == 30  # (0.25 + 0.75 + 0.5) / 3 = 0.5 at the third step
    assert time_to_reach(times, values, 0.75) == 50  # (0.5 + 0.75 + 1.0) / 3 = 0.75
    assert time_to_reach(times, values, 0.8) is None


def test_publish_to_served_and_same_samples_from_hand_written_runs(tmp_path):
    spans = [{"what": "publish", "start": 10.0, "end": 10.5, "policy_version": 1},
             {"what": "pull", "start": 10.6, "end": 11.0, "policy_version": 1},
             {"what": "pull", "start": 10.6, "end": 11.5, "policy_version": 1},  # a second replica, slower
             {"what": "publish", "start": 20.0, "end": 20.2, "policy_version": 2}]  # never loaded: not counted
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    assert publish_to_served(tmp_path) == [pytest.approx({"version": 1, "publish_s": 0.5, "load_s": 0.9,
                                                          "total_s": 1.5})]
    for name, texts in {"a": ["x", "y", "z", "w"], "b": ["x", "y", "q", "w"]}.items():
        (tmp_path / name).mkdir()
        records = [{"step": 1 + i // 2, "prompt_index": 0, "completion": t, "logprob": -1.0 - 0.25 * (name == "b") * i}
                   for i, t in enumerate(texts)]
        (tmp_path / name / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    total, same, first, gap = same_samples(tmp_path / "a", tmp_path / "b")
    assert (total, same, first, gap) == (2, 2, 2, 0.25)  # step 1: both alike, logprobs 0 and 0.25 apart


def test_the_plain_path_writes_whole_files_keeps_the_newest_and_loads_the_newest(tmp_path):
    for version in (1, 2, 3):
        write_version(tmp_path, version, {"w": torch.full((2, 3), float(version)), "b": torch.zeros(3)}, keep=2)
    assert versions(tmp_path) == [2, 3] and not list(tmp_path.glob(".*partial"))
    (tmp_path / ".v4.safetensors.partial").write_bytes(b"half")  # a write in progress is no version
    assert versions(tmp_path) == [2, 3]
    reader, loaded = DiskReader(DiskHandle(str(tmp_path))), []
    import asyncio

    assert asyncio.run(reader.load_latest(lambda v, w: loaded.append((v, dict(w))), newer_than=1)) == 3
    assert loaded[0][0] == 3 and torch.equal(loaded[0][1]["w"], torch.full((2, 3), 3.0))
    assert asyncio.run(reader.load_latest(lambda v, w: loaded.append(v), newer_than=3)) is None
    assert dict(read_version(tmp_path, 2))["w"][0, 0] == 2.0
    # a resume goes on from version 1: the run's discarded versions 2 and 3 go, and 1 is the newest served
    write_version(tmp_path, 1, {"w": torch.full((2, 3), -1.0), "b": torch.zeros(3)}, keep=2)
    assert versions(tmp_path) == [1]
    assert asyncio.run(reader.load_latest(lambda v, w: loaded.append((v, dict(w))))) == 1
    assert torch.equal(loaded[-1][1]["w"], torch.full((2, 3), -1.0))


def test_bitwise_differences_sees_bits_not_values():
    a = {"x": torch.tensor([0.0, 1.0]), "s": torch.tensor(2.0), "n": torch.tensor([math.nan])}
    same = {k: v.clone() for k, v in a.items()}
    assert bitwise_differences(a, same) == {}  # a NaN equals itself bit for bit; 0-dim tensors compare too
    other = {**same, "x": torch.tensor([-0.0, 1.0 + 2 ** -20]), "s": torch.tensor(2.0, dtype=torch.float64)}
    diff = bitwise_differences(a, other)
    assert diff.keys() == {"x", "s"} and diff["x"] == pytest.approx(2 ** -20) and diff["s"] == math.inf
    assert bitwise_differences(a, {"x": a["x"]}) == {"n": math.inf, "s": math.inf}


def test_the_zorplex_curriculum_moves_from_level_1_to_the_configured_level_by_prompt_index():
    task = Zorplex(ZorplexConfig(level=2, curriculum="10-29"))
    levels = [task.train_level(i) for i in range(40)]
    assert set(levels[:10]) == {1} and set(levels[29:]) == {2}
    # the share of level 2 rises linearly over the schedule: over a long one, each quarter's share is near its mean
    wide = Zorplex(ZorplexConfig(level=2, curriculum="100-1099"))
    shares = [statistics.fmean(wide.train_level(i) == 2 for i in range(100 + 250 * q, 350 + 250 * q)) for q in range(4)]
    assert shares == [pytest.approx(m, abs=0.08) for m in (0.125, 0.375, 0.625, 0.875)], shares
    assert levels == [Zorplex(ZorplexConfig(level=2, curriculum="10-29")).train_level(i) for i in range(40)]
    sample = task.train_sample(0)
    assert len(sample.info["values"]) == 1 and "value of blick?" in task.opening(sample)[1]["content"]
    assert len(task.train_sample(35).info["values"]) == 2
    assert all(len(s.info["values"]) == 2 for s in task.eval_samples())  # eval stays at the level
    assert {Zorplex(ZorplexConfig(level=2)).train_level(i) for i in range(40)} == {2}
    for bad in ("10", "5-x", "20-10"):
        with pytest.raises(ValueError, match="zorplex.curriculum"):
            Zorplex(ZorplexConfig(level=2, curriculum=bad))


def test_disk_and_verify_are_checked_before_anything_starts():
    from meshrl.configs.named import load_config
    for overrides, message in ((["--weight_sync.transport", "nfs"], "unknown weight_sync.transport 'nfs'"),
                               (["--weight_sync.transport", "disk", "--weight_sync.verify", "true"],
                                "weight_sync.verify checks the ring's loads")):
        with pytest.raises(ValueError, match=message):
            load_config("smoke", overrides).check()
    load_config("smoke", ["--weight_sync.transport", "disk"]).check()


def test_level2_steps_reads_only_the_runs_level_2_prompts_by_its_own_config(tmp_path):
    from meshrl.configs import to_dict
    from meshrl.configs.named import load_config
    from meshrl.tools.studies.difficulty import level2_steps

    config = load_config("zorplex_smollm2", ["--zorplex.level", "2", "--zorplex.curriculum", "2-3"])
    (tmp_path / "config.json").write_text(json.dumps(to_dict(config)))
    # prompts 0 and 1 are level 1 (all right: left out), 4 and 5 level 2; (reward, correct, looked up both)
    samples = {0: [(1.0, 1, 1), (1.0, 1, 1)], 1: [(1.0, 1, 1), (1.0, 1, 1)],
               4: [(1.0, 1, 1), (0.0, 0, 1)], 5: [(0.5, 0, 1), (0.5, 0, 0)]}
    records = [{"step": 1, "prompt_index": i, "reward": r, "reward_components": {"correct": c, "tool_call": t}}
               for i, group in samples.items() for r, c, t in group]
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # accuracy 1 of 4, one group of two with differing rewards, 3 of 4 looked up both words
    assert level2_steps(tmp_path) == {1: (0.25, 0.5, 0.75)}


def test_the_curriculum_report_reads_level_2_alone_by_its_own_config_and_shows_a_right_conversation(tmp_path):
    from meshrl.configs import to_dict
    from meshrl.configs.named import load_config
    from meshrl.tools.studies import STUDIES
    from meshrl.tools.studies.curriculum import STEPS

    study = STUDIES["curriculum"]
    evals_of = {"curriculum_seed0": [0.0, 0.1, 0.5] + [0.4] * (STEPS // 10 - 2),  # at steps 0, 10, 20, ...
                "level2_alone_seed0": [0.0] * (STEPS // 10 + 1)}
    for name, evals in evals_of.items():
        run = next(r for r in study.runs if r.name == name)
        run_dir = tmp_path / name
        run_dir.mkdir()
        config = load_config(run.config, run.overrides)
        (run_dir / "config.json").write_text(json.dumps(to_dict(config)))
        (run_dir / "study_run.json").write_text(json.dumps(run.recipe()))
        rows = [{"step": s, **({"eval_accuracy": evals[s // 10]} if s % 10 == 0 else {})} for s in range(1, STEPS + 1)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run_dir / "summary.json").write_text(json.dumps({"config_hash": run.config_hash(), "steps": STEPS, "eval_accuracy_initial": evals[0],
                                                          "eval_accuracy_final": evals[-1], "eval_tool_call_final": 0.5,
                                                          "eval_tagged_final": 0.25}))
        # two conversations a step on prompt 8 * step (level 2 from step 13 under the curriculum, always alone):
        # the first tags nothing; the second tags its first looked-up value, except under the curriculum over
        # the last ten steps, where it tags the right sum
        task = Zorplex(config.zorplex)
        records = []
        for s in range(1, STEPS + 1):
            sample = task.train_sample(8 * s)
            right = name.startswith("curriculum") and s > STEPS - 10
            tagged = sample.answer if right else next(iter(sample.info["values"].values()))
            records += [{"step": s, "prompt_index": 8 * s, "prompt": f"q{s}", "completion": f"c{s}.{i}"
                         + (f" Answer: {tagged}" if i == 1 else ""), "reward": 1.1 if right and i == 1 else 0.1,
                         "reward_components": {"correct": float(right and i == 1), "tool_call": float(s > 20)}}
                        for i in (0, 1)]
        (run_dir / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = write_report(study, tmp_path).read_text()
    lines = text.splitlines()
    curriculum, alone = (next(line for line in lines if line.startswith(f"| {arm} | 1 |"))
                         for arm in ("curriculum", "level2_alone"))
    # final 0.4, best 0.5, looked up both 0.5, tagged 0.25, train accuracy on level 2 over the last 5 steps:
    # one of two right
    assert curriculum == ("| curriculum | 1 | 0.000 (one run) | 0.400 (one run) | 0.500 | 0.500 (one run) | "
                          "0.250 (one run) | 0.500 (one run) |")
    assert alone == ("| level2_alone | 1 | 0.000 (one run) | 0.000 (one run) | 0.000 | 0.500 (one run) | "
                     "0.250 (one run) | 0.000 (one run) |")
    # the last 5 steps' 10 conversations by their tagged answer: right, a value, another number, none
    assert "| curriculum | 10 | 0.500 | 0.000 | 0.000 | 0.500 |" in lines
    assert "| level2_alone | 10 | 0.000 | 0.500 | 0.000 | 0.500 |" in lines
    examples = text.split("## Example conversations")[1]
    # the curriculum's first level-2 prompt is at step 13 at the latest; at the last step the right one is shown
    right = task.train_sample(8 * STEPS).answer  # the same prompts in both runs
    assert f"curriculum, seed 0: step {STEPS}" in examples
    assert f"q{STEPS}\nc{STEPS}.1 Answer: {right}\n-> reward 1.10 (right)" in examples
    assert "q1\nc1.0\n-> reward 0.10 (not right)" in examples  # level 2 alone: step 1, nothing right
    for png in ("eval_level2.png", "looked_up_both.png", "train_level2.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_demo_settings_report_picks_by_the_worst_seed_among_settings_that_keep_the_arithmetic(tmp_path):
    from meshrl.tools.studies import STUDIES

    study = STUDIES["demo-settings"]
    # (final tagged accuracy, last-number accuracy after; untrained 0.6 everywhere)
    runs = {"demo_seed0": (0.5, 0.6), "demo_seed1": (0.7, 0.65),
            "lr_1e-4_seed0": (0.95, 0.7), "lr_1e-4_seed1": (0.99, 0.5),  # the best accuracy, arithmetic lost once
            "lr_5e-5_seed0": (0.9, 0.6), "lr_5e-5_seed1": (0.6, 0.7)}  # worst seed 0.6 beats the demo's 0.5
    for name, (final, last_number) in runs.items():
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "study_run.json").write_text(json.dumps(next(r for r in study.runs if r.name == name).recipe()))
        rows = [{"step": s, "step_time_s": 10.0, "groups_with_signal": 0.25 * (s % 2),
                 **({"eval_accuracy": final * s / 20} if s % 5 == 0 else {})} for s in range(1, 21)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run_dir / "summary.json").write_text(json.dumps({"config_hash": recipe_of(study, run_dir).config_hash(),
            "steps": 20, "eval_accuracy_initial": 0.0, "eval_accuracy_final": final, "eval_last_number_initial": 0.6,
            "eval_last_number_final": last_number, "eval_copied_final": 0.1, "wall_time_s": 300,
            **({"eval_truncated_final": 0.25} if name != "demo_seed1" else {})}))  # a run from before the metric
    text = write_report(study, tmp_path).read_text()
    demo = next(line for line in text.splitlines() if line.startswith("| demo |"))
    assert demo == ("| demo | 2 | 0.600 ± 0.141 (0.500-0.700, n=2) | 0.500 | 0.625 ± 0.035 (0.600-0.650, n=2) | "
                    "0.600 ± 0.000 (0.600-0.600, n=2) | 2 of 2 | 0.100 ± 0.000 (0.100-0.100, n=2) | 0.250 (one run) | 0.12 | "
                    "300 |")
    assert "| lr_1e-4 | 2 |" in text and "| 1 of 2 |" in text
    assert "by its worst seed: **lr_5e-5** (worst seed 0.600; target 0.9 on every seed: not met)" in text
    for png in ("eval_by_step.png", "eval_by_time.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def finished_heldout_run(study: Study, run_dir, final: float, test: float) -> None:
    """What a finished 20-step run of a held-out study leaves: its validation at step 20 `final` (evals every
    5 steps rising to it), and `meshrl eval --split test`'s files for it (`test`) and the untrained model (0)."""
    run_dir.mkdir()
    (run_dir / "study_run.json").write_text(json.dumps(recipe_of(study, run_dir).recipe()))
    rows = [{"step": s, "step_time_s": 10.0, "groups_with_signal": 0.5,
             **({"eval_accuracy": final * s / 20} if s % 5 == 0 else {})} for s in range(1, 21)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(json.dumps({
        "config_hash": recipe_of(study, run_dir).config_hash(), "steps": 20, "eval_accuracy_initial": 0.0,
        "eval_accuracy_final": final, "eval_last_number_initial": 0.5, "eval_last_number_final": final,
        "wall_time_s": 300}))
    for out, accuracy in (("eval-test", test), ("eval-test-base", 0.0)):  # meshrl eval's, cached
        (run_dir / out).mkdir()
        (run_dir / out / "eval.json").write_text(json.dumps({"rates": {
            "eval_accuracy": accuracy, "eval_last_number": accuracy, "eval_truncated": 0.0}}))


def test_demo_heldout_chooses_on_validation_alone_and_reports_the_chosen_recipes_test_split(tmp_path, monkeypatch):
    from meshrl.tools.studies import STUDIES, demo_heldout

    study = STUDIES["demo-heldout"]
    # validation at step 20 per seed: v3's mean is highest by a hair over v4's, v2's lowest; test is kept
    # worst for the chosen one, so a choice made on test would pick another
    validation = {"demo_recipe+dynamic_sampling": (0.6, 0.7, 0.8), "lr_5e-5+format_0": (0.5, 0.5, 0.5),
                  "lr_7e-5+format_0+decay+zero_truncated": (0.9, 0.9, 0.31)}
    test = {"demo_recipe+dynamic_sampling": 0.95, "lr_5e-5+format_0": 0.99, "lr_7e-5+format_0+decay+zero_truncated": 0.2}
    for arm, finals in validation.items():
        for seed, final in enumerate(finals):
            finished_heldout_run(study, tmp_path / f"{arm}_seed{seed}", final, test[arm])
    monkeypatch.setattr(demo_heldout, "resolve_checkpoint", lambda source: tmp_path / "base")
    assert demo_heldout.ranked({arm: [{"final": v} for v in finals] for arm, finals in validation.items()}) == [
        "lr_7e-5+format_0+decay+zero_truncated", "demo_recipe+dynamic_sampling", "lr_5e-5+format_0"]
    text = write_report(study, tmp_path).read_text()
    assert "Chosen: **lr_7e-5+format_0+decay+zero_truncated**" in text
    assert "| worst seed | 0.200 | 0.200 | 0.000 |" in text and "| untrained model | 0.000 | 0.000 | 0.000 |" in text
    assert "0.990" not in text and "0.950" not in text  # the other recipes' test figures are not read


def test_demo_recipe_ranks_on_its_first_seed_of_validation_and_scores_the_chosen_recipes_five_seeds_on_test(
        tmp_path, monkeypatch):
    from meshrl.tools.studies import STUDIES, demo_heldout

    study = STUDIES["demo-recipe"]
    arms = ("v4", "tokens_32+rounds_2")
    assert {r.name for r in study.runs} == {f"{arm}_seed{s}" for arm in arms for s in range(5)}
    assert all(["--sum_digits.split", "stratified"] == r.overrides[:2] for r in study.runs)
    # seed 0 ranks (tokens_32+rounds_2 first); v4's seeds 1-4 would outrank it by their mean but are not the
    # ranking's; the chosen one's test: 0.95 on four seeds and `worst` on seed 4
    validation = {"v4": (0.6, 1.0, 1.0, 1.0, 1.0), "tokens_32+rounds_2": (0.8,)}
    monkeypatch.setattr(demo_heldout, "resolve_checkpoint", lambda source: tmp_path / "base")
    for worst, verdict in ((0.875, "not met"), (0.917, "met")):
        directory = tmp_path / verdict.replace(" ", "_")
        directory.mkdir()
        for arm, finals in validation.items():
            for seed, final in enumerate(finals):
                finished_heldout_run(study, directory / f"{arm}_seed{seed}", final, 0.95 if seed < 4 else worst)
        for seed in range(1, 5):
            finished_heldout_run(study, directory / f"tokens_32+rounds_2_seed{seed}", 0.0, 0.95 if seed < 4 else worst)
        text = write_report(study, directory).read_text()
        assert "Chosen: **tokens_32+rounds_2**" in text and "| 1 | tokens_32+rounds_2 | 1 | 0.800 |" in text
        assert "| v4 | 1 | 0.600 |" in text
        assert f"| worst seed | {worst:.3f} |" in text and "| seed 4 |" in text and "| seed 1 | 0.950 |" in text
        assert f"Worst seed's test accuracy {worst:.3f} over 5 seeds: the target (0.9 on every seed) is {verdict}." in text
    # three of the five seeds, each above 0.9: not met either, the other two not run
    directory = tmp_path / "three_seeds"
    directory.mkdir()
    for arm, seeds in (("v4", 1), ("tokens_32+rounds_2", 3)):
        for seed in range(seeds):
            finished_heldout_run(study, directory / f"{arm}_seed{seed}", 0.8 if arm != "v4" else 0.6, 0.95)
    text = write_report(study, directory).read_text()
    assert "Worst seed's test accuracy 0.950 over 3 seeds: the target (0.9 on every seed) is not met." in text


def test_the_calculator_report_shows_validation_by_eval_and_each_seeds_test_split_beside_the_untrained(
        tmp_path, monkeypatch):
    from meshrl.configs import to_dict
    from meshrl.tools.studies import STUDIES, calculator

    study = STUDIES["calculator"]
    test = {"seed0": 0.75, "seed1": 0.5, "seed2": 0.25}
    for run in study.runs:
        run_dir = tmp_path / run.name
        run_dir.mkdir()
        config = load_config(run.config, run.overrides)
        (run_dir / "config.json").write_text(json.dumps(to_dict(config)))
        (run_dir / "study_run.json").write_text(json.dumps(run.recipe()))
        rows = [{"step": s, **({"eval_accuracy": s / 40} if s % 10 == 0 else {})} for s in range(1, 31)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run_dir / "summary.json").write_text(json.dumps({
            "config_hash": run.config_hash(), "steps": 30, "eval_accuracy_initial": 0.0, "wall_time_s": 600,
            **{f"eval_{c}_final": 0.5 for c in ("tool_call", "calculated", "tagged")}}))
        # one level-2 conversation at step 30 (prompt 240: level 2 under the curriculum), right
        sample = Zorplex(config.zorplex).train_sample(240)
        (run_dir / "rollouts.jsonl").write_text(json.dumps({
            "step": 30, "prompt_index": 240, "prompt": "q", "completion": f"CALC[..] Answer: {sample.answer}",
            "reward": 1.1, "reward_components": {"correct": 1.0, "tool_call": 1.0}}) + "\n")
        for out, accuracy in (("eval-test", test[run.name]), ("eval-test-base", 0.0)):  # meshrl eval's, cached
            (run_dir / out).mkdir()
            (run_dir / out / "eval.json").write_text(json.dumps({"rates": {
                "eval_accuracy": accuracy, "eval_tool_call": 1.0, "eval_calculated": accuracy, "eval_tagged": 1.0}}))
    monkeypatch.setattr(calculator, "resolve_checkpoint", lambda source: tmp_path / "base")
    text = write_report(study, tmp_path).read_text()
    assert "| seed0 | 0.000 / 0.250 / 0.500 / 0.750 | 0.500 | 0.500 | 0.500 | 600 |" in text
    assert "| seed1 | 0.500 | 1.000 | 0.500 | 1.000 |" in text  # test: accuracy, tool_call, calculated, tagged
    assert "| worst seed | 0.250 | 1.000 | 0.250 | 1.000 |" in text
    assert "| untrained model | 0.000 | 1.000 | 0.000 | 1.000 |" in text
    assert f"### seed2, step 30\n\n```\nq\nCALC[..] Answer: {sample.answer}\n-> reward 1.10 (right)" in text
    assert (tmp_path / "validation_level2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_unified_model_report_gives_each_arms_test_accuracy_and_training_figures(tmp_path):
    """Three arms (vllm, torch, torch_exact) on the demo recipe as it is, three seeds each: each seed's final
    policy's test accuracy (its cached `meshrl eval --split test`), and the training rows' mismatch, clip,
    behaviour KL, tokens/s and seconds a step, as means over the arm's seeds."""
    from meshrl.configs import to_dict
    from meshrl.tools.studies import STUDIES, unified_model

    study = STUDIES["unified-model"]
    assert [r.name for r in study.runs][:3] == ["vllm_seed0", "torch_seed0", "torch_exact_seed0"]
    assert all(r.config == "sum_digits_smollm2" for r in study.runs)  # the demo's recipe, nothing chosen
    assert [r.overrides[:4] for r in study.runs[:3]] == [
        ["--generator.seed", "0", "--trainer.seed", "0"], ["--generator.impl", "torch", "--generator.seed", "0"],
        ["--generator.impl", "torch", "--generator.exact", "true"]]
    mismatch = {"vllm": 0.02, "torch": 0.001, "torch_exact": 0.0}
    for run in study.runs:
        arm, seed = run.name.rsplit("_seed", 1)
        run_dir = tmp_path / run.name
        (run_dir / "eval-test").mkdir(parents=True)
        (run_dir / "config.json").write_text(json.dumps(to_dict(load_config(run.config, run.overrides))))
        (run_dir / "study_run.json").write_text(json.dumps(run.recipe()))
        rows = [{"step": s, "tokens_trained": 100, "logprob_mismatch": mismatch[arm], "clip_fraction_low": 0.01,
                 "clip_fraction_high": 0.02 * (arm == "vllm"), "behaviour_kl": mismatch[arm] / 10,
                 "tokens_generated": 1000, "step_time_s": 10.0} for s in (1, 2)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run_dir / "summary.json").write_text(json.dumps({"config_hash": run.config_hash(), "steps": run.steps()}))
        (run_dir / "eval-test" / "eval.json").write_text(json.dumps({"rates": {"eval_accuracy": 0.5 + int(seed) / 10}}))
    text = write_report(study, tmp_path).read_text()
    assert "| vllm | 3 | 0.600 ± 0.100 (0.500-0.700, n=3) | 0.500 | 0.020 ± 0.000 (0.020-0.020, n=3) | " in text
    assert "| torch_exact | 3 | 0.600 ± 0.100 (0.500-0.700, n=3) | 0.500 | 0.000 ± 0.000 (0.000-0.000, n=3) | " \
        "0.010 ± 0.000 (0.010-0.010, n=3) | 0.000 ± 0.000 (0.000-0.000, n=3) | 100 | 10.0 |" in text
    assert unified_model.ARMS["torch_exact"] == ["--generator.impl", "torch", "--generator.exact", "true"]
