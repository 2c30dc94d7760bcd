import dataclasses
import re
import subprocess
import sys
import typing

import pytest

from meshrl.configs import Config, ConfigError, from_saved, resolve, resumable_overrides, to_dict
from meshrl.configs.named import CONFIGS, load_config


def test_registry_has_the_demo_and_smoke_configs():
    assert {"smoke", "sum_digits_smollm2", "reasoning_gym_smollm2"} <= set(CONFIGS)
    assert load_config("smoke", []).model.source == "tiny"
    assert load_config("sum_digits_smollm2", []).model.source == "smollm2"


def test_dotted_overrides_are_typed():
    config = load_config("smoke", ["--trainer.lr", "3e-4", "--controller.steps=5", "--trainer.bf16_autocast", "false",
                                   "--generator.impl", "my.module:MyGenerator", "--sum_digits.num_terms", "3"])
    assert config.trainer.lr == 3e-4 and config.controller.steps == 5
    assert config.trainer.bf16_autocast is False
    assert config.generator.impl == "my.module:MyGenerator"
    assert config.sum_digits.num_terms == 3


def test_the_same_overrides_parse_once_and_each_caller_gets_a_config_of_its_own(monkeypatch):
    from meshrl.configs import overrides

    parses = []
    monkeypatch.setattr(overrides, "_PARSED", {})
    monkeypatch.setattr(overrides, "_parse", lambda config, args: parses.append(args) or overrides.tyro.cli(
        type(config), default=config, args=list(args), **overrides.TYRO_OPTIONS))
    args = ["--trainer.lr", "3e-4"]
    first = load_config("smoke", args)
    first.trainer.lr = 1.0  # the caller's own copy: the next caller still gets the parsed value
    again = load_config("smoke", list(args))
    assert again.trainer.lr == 3e-4 and again == load_config("smoke", args) and parses == [args]
    # another config's defaults, or other overrides, are parsed anew
    assert load_config("sum_digits_smollm2", args).model.source == "smollm2"
    assert load_config("smoke", ["--trainer.lr", "1e-3"]).trainer.lr == 1e-3 and len(parses) == 3


@pytest.mark.parametrize("overrides, message", [
    (["--trainer.lrr", "1"], "unknown config key or bad override: --trainer.lrr, 1 (did you mean --trainer.lr?)"),
    (["--nope.lr", "1"], "unknown config key or bad override: --nope.lr, 1"),
    (["--trainer", "1"], "unknown config key or bad override: --trainer, 1"),
    (["--controller.steps", "many"], "Error parsing --controller.steps: invalid literal for int() with base 10: 'many'"),
    (["--trainer.bf16_autocast", "maybe"], "invalid choice 'maybe' for argument '--trainer.bf16_autocast'"),
    (["--trainer.lr"], "Missing value for argument '--trainer.lr'"),
    (["trainer.lr=1"], "unknown config key or bad override: trainer.lr=1"),
    (["--replay_buffer.max_policy_age", "1"], "--replay_buffer.max_policy_age is now --controller.max_policy_age"),
])
def test_bad_overrides_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        load_config("smoke", overrides)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("overrides, message", [
    (["--controller.max_failed_fraction", "2"], "controller.max_failed_fraction must be between 0 and 1"),
    (["--weight_sync.dtype", "int8"], "unknown weight_sync.dtype 'int8'"),
    (["--trainer.max_restarts", "-1"], "trainer.max_restarts must be at least 0, not -1"),
    (["--controller.restart_window_s", "-5"], "controller.restart_window_s must be at least 0, not -5.0"),
    # each section checks its own fields: one of each
    (["--generator.max_tokens", "0"], "generator.max_tokens must be at least 1, not 0"),
    (["--grader.replicas", "0"], "grader.replicas must be at least 1, not 0"),
    (["--grader.judge.rule_weight", "2"], "grader.judge.rule_weight must be in [0, 1], not 2"),
    (["--reference.ranks", "0"], "reference.ranks must be at least 1, not 0"),
    (["--weight_sync.slots", "0"], "weight_sync.slots must be at least 1, not 0"),
    (["--logging.rollouts_fraction", "1.5"], "logging.rollouts_fraction must be between 0 and 1"),
    (["--logging.wandb_mode", "maybe"], "unknown logging.wandb_mode 'maybe'; known: auto, online, offline"),
    (["--checkpoint.every", "-1"], "checkpoint.every must be at least 0, not -1"),
    (["--controller.advantage", "ppo"], "unknown controller.advantage 'ppo'; known: grpo, dr_grpo, rloo, or step_wise_<one of them>"),
    (["--trainer.loss.name", "dpo"], "unknown trainer.loss.name 'dpo'"),
    # and the whole config what spans sections
    (["--replay_buffer.impl", "replay"], "replay_buffer.impl replay trains groups again in later steps"),
    (["--weight_sync.verify", "true", "--generator.tensor_parallel_size", "2"], "it needs generator.tensor_parallel_size 1"),
])
def test_values_that_cannot_work_together_are_refused_before_anything_starts(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config("smoke", overrides).check()
    load_config("smoke", ["--controller.eval_top_p", "0.9"]).check()  # eval samples as it likes


def test_a_resume_may_change_placement_and_rank_counts_but_not_what_the_run_computes():
    """The trainer's checkpoint loads on any number of ranks (tests/test_trainer_ranks.py), so a resume may
    change them; a learning rate it may not."""
    saved = load_config("smoke", [])
    for overrides in (["--trainer.ranks", "2", "--reference.ranks", "2"], ["--generator.replicas", "2"],
                      ["--controller.steps", "9", "--trainer.num_threads", "1"]):
        resumable_overrides(saved, load_config("smoke", overrides))
    with pytest.raises(ConfigError, match=r"--trainer\.lr cannot change on resume"):
        resumable_overrides(saved, load_config("smoke", ["--trainer.lr", "0.5"]))


def test_a_config_json_written_before_top_p_went_and_classes_were_renamed_reads_as_it_trains_now():
    """A run from before issue 56 resumes: its generator.top_p 1 (the only value it could have) is dropped, the
    task grader's old class name read as TaskGrader; a top_p that could not train stays one clear error."""
    saved = to_dict(load_config("smoke", ["--replay_buffer.impl", "meshrl.actors.replay_buffer:ReuseBuffer"]))
    old = to_dict(load_config("smoke", []))
    old["generator"]["top_p"] = 1.0
    old["grader"]["impl"] = "meshrl.actors.grader:Grader"
    old["replay_buffer"]["impl"] = "meshrl.actors.replay_buffer:ReplayBuffer"
    assert to_dict(from_saved(old)) == saved
    old["generator"]["top_p"] = 0.9
    with pytest.raises(ConfigError, match=r"unknown config keys \['top_p'\] in GeneratorConfig"):
        from_saved(old)


def test_resolve_fills_in_every_derived_value_once_and_leaves_the_given_config_as_it_was(tmp_path):
    given = load_config("smoke", ["--controller.steps", "5", "--trainer.mini_batches", "2",
                                  "--trainer.loss.aggregation", "constant", "--generator.max_tokens", "32",
                                  "--weight_sync.transport", "disk"])
    before = to_dict(given)
    resolved = resolve(given, tmp_path)
    assert to_dict(given) == before  # config.json and the recipe hash are of the config as given
    assert resolved.generator.weight_update == "drain"  # synchronous: max_policy_age 0
    assert resolved.controller.generate_ahead == 0
    assert resolved.trainer.lr_schedule.total_updates == 10
    assert resolved.trainer.loss.constant_norm == 32
    assert resolved.weight_sync.disk_dir == str((tmp_path / "weights").absolute())
    assert to_dict(resolve(resolved, tmp_path)) == to_dict(resolved)  # resolving twice changes nothing
    ahead = resolve(load_config("smoke", ["--controller.max_policy_age", "2"]))
    assert (ahead.generator.weight_update, ahead.controller.generate_ahead) == ("in_flight", 2)
    reuse = resolve(load_config("smoke", ["--controller.max_policy_age", "2", "--replay_buffer.impl", "replay"]))
    assert reuse.controller.generate_ahead == 0  # its groups trained again need the bound's room
    kept = resolve(load_config("smoke", ["--controller.max_policy_age", "2", "--controller.generate_ahead", "1",
                                         "--generator.weight_update", "recompute", "--trainer.loss.constant_norm", "7"]))
    assert (kept.controller.generate_ahead, kept.generator.weight_update, kept.trainer.loss.constant_norm) == (
        1, "recompute", 7)  # a value the user set is kept


def test_booleans_take_the_usual_spellings():
    for text, value in (("false", False), ("NO", False), ("0", False), ("True", True), ("yes", True), ("1", True)):
        assert load_config("smoke", ["--logging.wandb", text]).logging.wandb is value
        assert load_config("smoke", [f"--logging.wandb={text}"]).logging.wandb is value


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "meshrl", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["train", "--config", "nope"], "unknown config 'nope'"),
    (["train", "--config", "smoke", "--controller.steps", "x"], "Error parsing --controller.steps"),
    (["train", "--config", "smoke", "--trainer.lrr", "1"], "did you mean --trainer.lr?"),
    (["train", "--config", "smoke", "--logging.wandb_mode", "sometimes"], "unknown logging.wandb_mode 'sometimes'"),
    (["train", "--run-dir", "x"], "train needs --config NAME"),
    (["train", "--config", "smoke", "--model.source", "/no/such/model"], "model '/no/such/model' not found"),
    (["train", "--config", "smoke", "--controller.max_policy_age", "-1"], "max_policy_age must be at least 0"),
    (["train", "--config", "smoke", "--controller.group_size", "1"], "group_size must be at least 2"),
    (["train", "--config", "smoke", "--controller.eval_samples", "4"], "greedy sampling gives one answer per prompt"),
    (["train", "--config", "smoke", "--controller.advantage", "step_wise_ppo"], "unknown controller.advantage 'step_wise_ppo'; known: grpo, dr_grpo, rloo, or step_wise_<one of them>"),
    (["train", "--config", "smoke", "--task", "zorplex", "--zorplex.level", "5"], "zorplex level must be one of"),
    (["train", "--config", "smoke", "--generator.impl", "no_module:Gen"], "cannot load actor implementation"),
    (["train", "--config", "smoke", "--generator.impl", "meshrl.actors.grader:TaskGrader"],
     "meshrl.actors.grader:TaskGrader cannot be the generator: it has no generate, completions, forget, attach_weights, "
     "pull_weights, weight_updates, weight_sync_stats endpoint (the contract is meshrl.actors.roles.Generator)"),
    (["train", "--config", "smoke", "--replay_buffer.impl", "meshrl.actors.grader:TaskGrader"],
     "meshrl.actors.grader:TaskGrader cannot be the replay_buffer: it has no stage, discard, add, record_rollouts, sample, "
     "micro_batch, attach, trained, checkpointed, logged, save_state, load_state endpoint (the contract is "
     "meshrl.actors.roles.ReplayBuffer)"),
    (["train", "--config", "smoke", "--replay_buffer.impl", "replay"], "set controller.max_policy_age to 1 or more"),
    (["train", "--config", "smoke", "--controller.generate_ahead", "1"],
     "controller.generate_ahead (1) cannot be more than controller.max_policy_age (0)"),
    (["train", "--config", "smoke", "--replay_buffer.impl", "replay", "--controller.max_policy_age", "1",
      "--replay_buffer.priority", "oldest"], "unknown replay_buffer.priority 'oldest'"),
    (["train", "--config", "smoke", "--trainer.mini_batches", "0"], "trainer.mini_batches must be at least 1, not 0"),
    (["train", "--config", "smoke", "--trainer.loss.tis_level", "batch"], "unknown trainer.loss.tis_level 'batch'"),
])
def test_cli_bad_input_is_one_error_line_and_nonzero_exit(args, message, tmp_path, cli):
    code, _, stderr = cli(*args, "--run-dir", tmp_path / "run")
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshrl: error: ") and message in lines[0], stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.processes
def test_a_bad_command_line_is_one_line_from_the_real_process_too(tmp_path):
    result = run_cli("train", "--config", "smoke", "--generator.impl", "meshrl.actors.grader:TaskGrader",
                     "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "meshrl: error: meshrl.actors.grader:TaskGrader cannot be the generator: it has no generate, completions, forget, "
        "attach_weights, pull_weights, weight_updates, weight_sync_stats endpoint (the contract is "
        "meshrl.actors.roles.Generator)"]
    assert not (tmp_path / "run").exists()


def leaf_fields(cls, prefix=""):
    for f in dataclasses.fields(cls):
        kind = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(kind):
            yield from leaf_fields(kind, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", kind


@pytest.mark.processes
def test_train_help_lists_every_field_with_its_type_default_and_comment():
    result = run_cli("train", "--config", "smoke", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    names = {float: "FLOAT", int: "INT", str: "STR", bool: "{True,False}"}
    for name, kind in leaf_fields(Config):
        assert f"--{name} {names[kind]}" in text, name
    assert "--model.source STR smollm2 (embedded SmolLM2-135M-Instruct)" in text  # the field's comment
    assert "(default: tiny)" in text  # the smoke config's own value
    assert "optimizer updates per step" in text


@pytest.mark.processes
def test_cli_lists_configs():
    result = run_cli("configs")
    assert result.returncode == 0 and "smoke" in result.stdout and "sum_digits_smollm2" in result.stdout
