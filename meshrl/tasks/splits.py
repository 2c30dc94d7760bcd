"""Held-out splits by construction: every built-in task puts each underlying item (the numbers of a sum,
a made-up word, a value, a file's prompt) in exactly one of `train`, `validation` and `test`, by a hash
of the item (`split_of`: of the item alone; `stratified_splits`: the items of each kind dealt out in hash
order, so each split holds each kind in training's proportions), so no seed or index can move it, and a
prompt of one split is never a prompt of another. Validation chooses settings; test is reported once they
are chosen.
"""

import functools
import random
from typing import Callable, Hashable, Iterable, TypeVar

SPLITS = ("train", "validation", "test")
HELD_OUT = SPLITS[1:]  # what `meshrl eval --split` and the eval during training take
T = TypeVar("T")


def item_hash(item) -> float:
    """`item`'s place in [0, 1), from its `repr` alone: the same on every machine and Python (random's string
    seeding is sha512). Both split rules order items by it."""
    return random.Random(f"split-{item!r}").random()


@functools.lru_cache(maxsize=2**16)
def split_of(item: Hashable, test: float = 0.2, validation: float = 0.2) -> str:
    """The split of `item` (its `item_hash`): `test` with probability `test`, `validation` with
    `validation`, else `train`."""
    u = item_hash(item)
    return "test" if u < test else "validation" if u < test + validation else "train"


def stratified_splits(items: Iterable[T], stratum: Callable[[T], Hashable], test: float = 0.2,
                      validation: float = 0.2) -> dict[str, list[T]]:
    """Every one of `items` in one split, each `stratum` (a kind of item) dealt out in the items' hash order:
    its first round(n * test) to test, the next round(n * validation) to validation, the rest to train, so
    each split holds each kind in the same proportions (to one item per kind), whatever chance gives a hash
    split of few items. An item's split depends on the others of its kind: the same for the same item set."""
    kinds: dict[Hashable, list[T]] = {}
    for item in items:
        kinds.setdefault(stratum(item), []).append(item)
    splits: dict[str, list[T]] = {split: [] for split in SPLITS}
    for kind in kinds.values():
        kind.sort(key=item_hash)
        n_test, n_validation = round(len(kind) * test), round(len(kind) * validation)
        splits["test"] += kind[:n_test]
        splits["validation"] += kind[n_test:n_test + n_validation]
        splits["train"] += kind[n_test + n_validation:]
    for held in splits.values():  # one order for the whole split, by hash: the kinds interleaved
        held.sort(key=item_hash)
    return splits


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
