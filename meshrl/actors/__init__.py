"""Monarch actors, one role each. The controller finds each by the "module:Class" its config names."""

import importlib


def load_actor_class(impl: str):
    module, _, name = impl.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot load actor implementation {impl!r}: {e}") from None
