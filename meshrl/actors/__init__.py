"""Monarch actors, one role each. The controller finds each by the "module:Class" its config names."""

import importlib
import os

import torch
from monarch.actor import this_host


def load_actor_class(impl: str):
    module, _, name = impl.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot load actor implementation {impl!r}: {e}") from None


def spawn(name: str, cls, *args):
    """`cls` on a proc mesh of its own (one process here): (the mesh, to stop it; the actor)."""
    procs = this_host().spawn_procs(per_host={"procs": 1}, name=name)
    return procs, procs.spawn(name, cls, *args)


def parse_cpus(cpus: str) -> set[int]:
    """ "0", "0-3" or "0,2-3" -> {0, ...}; "" -> every CPU this process may use."""
    if not cpus:
        return os.sched_getaffinity(0)
    result = set()
    for part in cpus.split(","):
        first, _, last = part.partition("-")
        result.update(range(int(first), int(last or first) + 1))
    return result


def pin_cpus(cpus: str, num_threads: int) -> None:
    """Keep this actor's process and torch's threads on `cpus`, so roles do not fight over cores."""
    os.sched_setaffinity(0, parse_cpus(cpus))
    torch.set_num_threads(num_threads)
