"""User code a config names as "module:Name": an actor implementation, a task, a reward function."""

import importlib


def load_object(target: str, what: str):
    """The object "module:Name" names; one ValueError line, naming `what`, if it cannot be loaded."""
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot load {what} {target!r}: {e}") from None
