"""Held-out splits by construction: every built-in task puts each underlying item (the numbers of a sum,
a made-up word, a value, a file's prompt) in exactly one of `train`, `validation` and `test`, by a hash
of the item alone, so no seed, config or index can move it, and a prompt of one split is never a prompt
of another. Validation chooses settings; test is reported once they are chosen.
"""

import functools
import random
from typing import Callable, Hashable, TypeVar

SPLITS = ("train", "validation", "test")
HELD_OUT = SPLITS[1:]  # what `meshrl eval --split` and the eval during training take
T = TypeVar("T")


@functools.lru_cache(maxsize=2**16)
def split_of(item: Hashable, test: float = 0.2, validation: float = 0.2) -> str:
    """The split of `item` (its `repr` hashed): `test` with probability `test`, `validation` with
    `validation`, else `train`; the same on every machine and Python (random's string seeding is sha512)."""
    u = random.Random(f"split-{item!r}").random()
    return "test" if u < test else "validation" if u < test + validation else "train"


def check_split(split: str) -> str:
    if split not in HELD_OUT:
        raise ValueError(f"an eval split is one of {', '.join(HELD_OUT)}, not {split!r}")
    return split


def distinct(draw: Callable[[int], T], key: Callable[[T], str], size: int, exclude: set = frozenset(),
             tries: int = 50) -> list[T]:
    """Up to `size` draws `draw(0), draw(1), ...` with distinct `key`s (a prompt's text), none in `exclude`,
    in order; it stops after `tries * size` draws, so a split smaller than `size` gives all it has."""
    seen, kept = set(exclude), []
    for i in range(tries * size):
        if len(kept) == size:
            break
        sample = draw(i)
        if key(sample) not in seen:
            seen.add(key(sample))
            kept.append(sample)
    return kept
