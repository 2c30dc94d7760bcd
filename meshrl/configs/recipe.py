"""A run's recipe as one hash: what a run trains, whatever it was named. A named config is a fixed
recipe (tests/test_recipes.py pins each one's hash: a change of settings is a new name), every run
records the hash of its config as given (before meshrl.configs.resolve fills anything in) in
summary.json (`config_hash`), and a study counts a run as finished only while its recipe still hashes
the same, naming the others as stale.

The hash is of the settings that differ from `Config()`'s defaults, so that a new setting whose default
keeps the old behaviour (the way settings are added) leaves every recipe as it was. A changed default
changes every recipe that relies on it without changing their hashes: tests/test_recipes.py pins the
defaults' own hash, so that such a change is made knowingly (and the runs it affects are re-run).
"""

import copy
import hashlib
import json

from meshrl.configs import Config, to_dict

# where a run writes, not what it trains: left out
LOCATIONS = ("weight_sync.disk_dir",)


def flat(settings: dict, prefix: str = "") -> dict:
    """{"trainer": {"lr": 1e-5}} -> {"trainer.lr": 1e-5}."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def recipe(config: Config) -> dict:
    """The checked config's settings that differ from the defaults (dotted keys), less its locations."""
    config = copy.deepcopy(config)
    config.check()
    defaults, settings = flat(to_dict(Config())), flat(to_dict(config))
    return {k: v for k, v in settings.items() if k not in LOCATIONS and (k not in defaults or defaults[k] != v)}


def digest(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def recipe_hash(config: Config) -> str:
    """The first 16 hex digits of the sha256 of `recipe(config)` as sorted JSON."""
    return digest(recipe(config))


def defaults_hash() -> str:
    """The hash of every default setting: what a changed default changes."""
    return digest(flat(to_dict(Config())))
