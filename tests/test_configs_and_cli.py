import subprocess
import sys

import pytest

from meshrl.configs import CONFIGS, ConfigError, load_config


def test_registry_has_the_demo_and_smoke_configs():
    assert {"smoke", "sum_digits_smollm2"} <= set(CONFIGS)
    assert load_config("smoke", []).model.source == "tiny"
    assert load_config("sum_digits_smollm2", []).model.source == "smollm2"


def test_dotted_overrides_are_typed():
    config = load_config("smoke", ["--trainer.lr", "3e-4", "--controller.steps=5", "--trainer.bf16_autocast", "false",
                                   "--generator.impl", "my.module:MyGenerator", "--sum_digits.num_terms", "3"])
    assert config.trainer.lr == 3e-4 and config.controller.steps == 5
    assert config.trainer.bf16_autocast is False
    assert config.generator.impl == "my.module:MyGenerator"
    assert config.sum_digits.num_terms == 3


@pytest.mark.parametrize("overrides, message", [
    (["--trainer.lrr", "1"], "unknown config key 'trainer.lrr'"),
    (["--nope.lr", "1"], "unknown config key 'nope.lr'"),
    (["--trainer", "1"], "unknown config key 'trainer'"),
    (["--controller.steps", "many"], "bad value for controller.steps: 'many' is not int"),
    (["--trainer.bf16_autocast", "maybe"], "not a boolean"),
    (["--trainer.lr"], "has no value"),
    (["trainer.lr=1"], "bad override"),
])
def test_bad_overrides_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("smoke", overrides)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "meshrl", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["train", "--config", "nope"], "unknown config 'nope'"),
    (["train", "--config", "smoke", "--controller.steps", "x"], "bad value for controller.steps"),
    (["train", "--config", "smoke", "--model.source", "/no/such/model"], "model '/no/such/model' not found"),
    (["train", "--config", "smoke", "--replay_buffer.max_policy_age", "-1"], "max_policy_age must be at least 0"),
    (["train", "--config", "smoke", "--controller.group_size", "1"], "group_size must be at least 2"),
    (["train", "--config", "smoke", "--generator.impl", "no_module:Gen"], "cannot load actor implementation"),
    (["train", "--config", "smoke", "--trainer.mini_batches", "0"], "trainer.mini_batches and"),
    (["train", "--config", "smoke", "--trainer.loss.tis_level", "batch"], "unknown trainer.loss.tis_level 'batch'"),
])
def test_cli_bad_input_is_one_error_line_and_nonzero_exit(args, message, tmp_path):
    result = run_cli(*args, "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshrl: error: ") and message in lines[0], result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cli_lists_configs():
    result = run_cli("configs")
    assert result.returncode == 0 and "smoke" in result.stdout and "sum_digits_smollm2" in result.stdout
