"""A recipe keeps its name: every named config's recipe (meshrl/configs/recipe.py: the settings that
differ from the defaults) hashes to the value pinned here, and so do the defaults. A change of a named
config's settings fails this test: give the new recipe a new name (or a version, as
sum_digits_smollm2_v1 to _v4), and re-pin only for a change that trains the same (a comment, a new
setting whose default keeps the old behaviour does not even change the hash)."""

import pytest

from meshrl.configs import Config
from meshrl.configs.named import CONFIGS, load_config
from meshrl.configs.recipe import defaults_hash, recipe, recipe_hash

RECIPES = {
    "bench_smoke": "1cce5b5de009d882",
    "bench_smollm2": "cbdc8c5d3fbc38f4",
    "qwen3_0_6b_gsm8k": "b4615196d856f29d",
    "qwen3_30b_a3b_gsm8k_one_node": "83f95f87884494db",
    "qwen3_8b_gsm8k": "dd73ff2d0caac8fd",
    "qwen3_8b_gsm8k_one_node": "7ddcf073280f5fd1",
    "qwen3_smoke": "f9744dd7b525156a",
    "reasoning_gym_smollm2": "0dacd06e43b5045f",
    "smoke": "825957e7ea9e655f",
    "sum_digits_smollm2": "454e8ad2cabc287e",
    "sum_digits_smollm2_async": "c6fc007a1e3cbbf9",
    "sum_digits_smollm2_kubernetes": "d065237df276a397",
    "sum_digits_smollm2_lora": "1b6672c81272e50e",
    "sum_digits_smollm2_slurm": "dcc6416ab5dd4071",
    "sum_digits_smollm2_v1": "aee889111fb721d5",
    "sum_digits_smollm2_v2": "ef8037d74c951531",
    "sum_digits_smollm2_v3": "86b8197195424374",
    "sum_digits_smollm2_v4": "454e8ad2cabc287e",
    "zorplex_calc_smollm2": "345213b9a89bd678",
    "zorplex_smollm2": "850b76abfdee5dfa",
}
# 2026-11-27 (issue 56): generator.top_p went (it could only be 1) and trainer.loss.constant_norm's default became
# 0, filled in with generator.max_tokens by meshrl.configs.resolve (48, as before, wherever max_tokens is 48: no named
# config uses the constant aggregation); grader.impl's class is named TaskGrader (roles.Grader is the contract). Nothing
# else changed (compared field by field with the defaults before).
# 2026-11-28 (issue 63): new settings whose defaults keep what ran before: generator.engine.batch_invariant false,
# sum_digits.split hash and sum_digits.max_term 0 (10**digits - 1, as before).
# 2026-11-28 (issue 65): new settings whose defaults keep what ran before on the CPU: weight_sync.memory auto (the
# host ring, unless the GPU plan puts the trainer on one host's GPUs beside the generators), job.gpu_memory_gib and
# job.host_memory_gib 0 (this host's own; only the memory plan reads them).
# 2026-11-28 (issue 66): new settings whose defaults keep what ran before: generator.exact false,
# generator.prefill_tokens 256 and trainer.per_sequence false (both read only by the torch generator's runs).
# 2026-11-29 (issue 67): new settings that change nothing trained: grader.warn_error_fraction 0.1 (a warning line),
# grader.max_error_fraction 0.5 and grader.max_error_steps 3 (a run whose reward raises on most replies for 3 steps
# stops instead of training on the rest).
DEFAULTS = "84529b10c9c5a586"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_named_config_is_the_recipe_pinned_for_its_name(name):
    assert name in RECIPES, f"a new named config: pin its recipe hash here ({recipe_hash(CONFIGS[name]())})"
    assert recipe_hash(CONFIGS[name]()) == RECIPES[name], (
        f"{name} now trains another recipe: {recipe(CONFIGS[name]())}; give it a new name")


def test_the_defaults_are_pinned_too():
    assert defaults_hash() == DEFAULTS, "a default changed: every recipe relying on it trains otherwise now"


def test_the_hash_sees_settings_not_locations_and_names_no_default():
    assert recipe(Config()) == {}
    base = load_config("smoke", [])
    assert recipe_hash(load_config("smoke", ["--weight_sync.disk_dir", "/somewhere"])) == recipe_hash(base)
    assert recipe_hash(load_config("smoke", ["--trainer.lr", "2e-3"])) != recipe_hash(base)
    assert recipe(load_config("smoke", ["--trainer.lr", "2e-3"]))["trainer.lr"] == 2e-3
    # the same settings reached two ways are one recipe
    assert RECIPES["sum_digits_smollm2"] == RECIPES["sum_digits_smollm2_v4"]
    assert recipe_hash(load_config("sum_digits_smollm2_v1", ["--trainer.lr", "5e-5", "--sum_digits.format_weight", "0"])) \
        == RECIPES["sum_digits_smollm2_v2"]
