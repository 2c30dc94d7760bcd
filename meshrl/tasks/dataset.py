"""Prompts and reference answers from a user's file: JSONL or Parquet, read with the `datasets`
library (offline), with a reward chosen by name or given as `module:function`.

Training takes the file's rows in a shuffled order, a new order each pass (seeded: the same index is
the same row on a rerun or a resume). The validation split is a file of its own (`eval_path`) or the
last `eval_size` rows of `path`; the test split a file of its own (`test_path`) or the `test_size` rows
before those. No prompt text is in two splits: a training row whose prompt is also a held-out row's is
dropped (counted once in the log), and so is a test row whose prompt is a validation row's. Bad data (a missing or empty field, an unreadable
row, an empty file) is one error naming the file and the row, before anything starts; rows whose
prompts are too long for the generator are skipped at load, their count and row numbers said once.
"""

import importlib.util
import json
import logging
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from meshrl.tasks import Sample
from meshrl.plugins import load_object
from meshrl.tasks.splits import check_split

logger = logging.getLogger(__name__)


@dataclass
class DatasetConfig:
    """Prompts and answers from a JSONL or Parquet file (`--task dataset`)."""

    path: str = ""  # the training rows: a .jsonl (or .json lines) or .parquet file
    eval_path: str = ""  # validation rows, same format; "": the last eval_size rows of `path`
    eval_size: int = 64  # validation rows taken from `path` when there is no eval_path (at most this many of eval_path)
    test_path: str = ""  # test rows, same format; "": the test_size rows of `path` before the validation rows
    test_size: int = 64  # test rows taken from `path` when there is no test_path (at most this many of test_path)
    prompt_field: str = "prompt"  # the user's message
    answer_field: str = "answer"  # the reference answer
    reward: str = "exact"  # exact (normalised text) | numeric (the last number) | math (math-verify) | module:function
    seed: int = 0  # the order of the training rows


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def normalise(text: str) -> str:
    """Lower case, single spaces, no surrounding space, quotes or final full stop."""
    return " ".join(text.lower().split()).strip(" \"'`").rstrip(".").strip()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _same(reply: str, answer: str) -> bool:
    """Equal as numbers when both are, else equal once normalised."""
    a, b = _number(normalise(reply)), _number(normalise(answer))
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return normalise(reply) == normalise(answer)


def exact(text: str, answer: str) -> tuple[float, dict[str, float]]:
    """1 when the whole reply is the answer (normalised)."""
    correct = float(normalise(text) == normalise(answer))
    return correct, {"correct": correct}


def numeric(text: str, answer: str) -> tuple[float, dict[str, float]]:
    """1 when the last number in the reply is the answer's value."""
    numbers = _NUMBER.findall(text)
    correct = float(bool(numbers) and _same(numbers[-1], answer))
    return correct, {"correct": correct, "has_number": float(bool(numbers))}


def math_answer(text: str, answer: str) -> tuple[float, dict[str, float]]:
    """1 when math-verify reads the reply's final answer (the last \\boxed{}, else the last LaTeX or plain
    expression) as equal to the reference (0.5 = \\frac{1}{2}, x=3 = 3, sets, intervals); `format` says
    whether it found an answer at all. A reply it cannot compare within math_reward.TIMEOUT_S scores 0,
    with the check `timed_out`."""
    global _verifier
    if _verifier is None:
        from meshrl.tasks.math_reward import MathVerifier

        _verifier = MathVerifier()
    result = _verifier(text, answer)
    if result is None:
        return 0.0, {"correct": 0.0, "format": 0.0, "timed_out": 1.0}
    correct = float(result["correct"])
    return correct, {"correct": correct, "format": float(result["found"])}


_verifier = None  # this process's math-verify child, started on first use


REWARDS = {"exact": exact, "numeric": numeric, "math": math_answer}


def reward_function(name: str):
    """A built-in reward, or `module:function` returning a float or (float, {check: value}); a float
    alone becomes the check `correct` too."""
    if name == "math" and importlib.util.find_spec("math_verify") is None:
        raise ValueError("dataset.reward math needs the math-verify package: pip install 'meshrl[envs]'")
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise ValueError(f"unknown dataset.reward {name!r}; built in: {', '.join(REWARDS)}, or module:function")

    user = load_object(name, "dataset.reward")

    def scored(text: str, answer: str) -> tuple[float, dict[str, float]]:
        result = user(text, answer)
        reward, checks = result if isinstance(result, tuple) else (result, {"correct": float(result)})
        return float(reward), {k: float(v) for k, v in checks.items()}

    return scored


def read_rows(path: str, prompt_field: str, answer_field: str) -> list[Sample]:
    """Every row of a JSONL or Parquet file as a Sample; ValueError naming the file and row if one is bad."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"dataset file {path!r} not found")
    kind = "parquet" if file.suffix == ".parquet" else "json"
    if kind == "json":  # datasets' own errors would name no row
        for n, row in _json_lines(file):
            _check_row(path, n, row, prompt_field, answer_field)
    from datasets import Dataset

    try:
        rows = (Dataset.from_parquet if kind == "parquet" else Dataset.from_json)(str(file), keep_in_memory=True)
    except Exception as e:  # datasets' own message: the file as a whole could not be read
        raise ValueError(f"{path}: cannot be read as {kind}: {str(e).splitlines()[0]}") from None
    if len(rows) == 0:
        raise ValueError(f"{path}: no rows")
    samples = []
    for n, row in enumerate(rows, 1):
        _check_row(path, n, row, prompt_field, answer_field)
        samples.append(Sample(*(v if isinstance(v, str) else json.dumps(v) for v in (row[prompt_field],
                                                                                      row[answer_field]))))
    return samples


def _check_row(path: str, n: int, row: dict, *fields: str) -> None:
    for name in fields:
        value = row.get(name)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ValueError(f"{path} row {n}: no {name!r} (fields: {', '.join(row)})")


def _json_lines(file: Path) -> list[tuple[int, dict]]:
    """(line number, object) of each non-blank line; ValueError naming the first that is not an object."""
    rows = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise ValueError(f"{file} row {n}: not a JSON object: {line[:80]!r}")
        rows.append((n, row))
    if not rows:
        raise ValueError(f"{file}: no rows")
    return rows


class DatasetTask:
    accuracy = "correct"

    def __init__(self, config: DatasetConfig):
        if not config.path:
            raise ValueError("task dataset needs --dataset.path (a JSONL or Parquet file)")
        if config.eval_size < 1 or config.test_size < 0:
            raise ValueError("dataset.eval_size must be at least 1 and dataset.test_size at least 0")
        fields = config.prompt_field, config.answer_field
        rows = list(enumerate(read_rows(config.path, *fields), 1))  # (row number in its file, sample)
        self.rows, self.files, end = {}, {"train": config.path}, len(rows)
        for split, file, size in (("validation", config.eval_path, config.eval_size),
                                  ("test", config.test_path, config.test_size)):
            if file:
                self.rows[split], self.files[split] = list(enumerate(read_rows(file, *fields), 1))[:size], file
            else:
                self.rows[split], self.files[split], end = rows[max(end - size, 0):end], config.path, end - size
        if end < 1:
            raise ValueError(f"{config.path} has {len(rows)} rows: too few to hold out dataset.eval_size "
                             f"({config.eval_size}) for validation and dataset.test_size ({config.test_size}) for "
                             "test and train on the rest; give a dataset.eval_path and dataset.test_path")
        validation = {s.prompt for _, s in self.rows["validation"]}
        self.rows["test"] = self._without(self.rows["test"], validation, "test")
        self.rows["train"] = self._without(rows[:end], validation | {s.prompt for _, s in self.rows["test"]}, "train")
        self.path = config.path
        self.score = reward_function(config.reward)
        self.seed = config.seed
        self.orders: dict[int, list[int]] = {}

    def _without(self, rows: list[tuple[int, Sample]], held_out: set[str], split: str) -> list[tuple[int, Sample]]:
        """`rows` less those whose prompt is in `held_out` (a later split's), which the log counts once."""
        kept = [(n, s) for n, s in rows if s.prompt not in held_out]
        if len(kept) < len(rows):
            logger.warning("%s: %d of its %d %s rows dropped: their prompts are also held-out rows'",
                           self.files[split], len(rows) - len(kept), len(rows), split)
        if rows and not kept:
            raise ValueError(f"{self.files[split]}: every {split} row's prompt is a held-out row's too")
        return kept

    def keep_only(self, fits: Callable[[str], bool], why: str) -> None:
        """Skip the rows whose prompt does not `fits` (`why` says how), saying how many and which, once,
        so that no group is sent that the generator must refuse. Called before the first sample."""
        for split in ("train", "validation", "test"):
            rows = self.rows[split]
            kept = [(n, s) for n, s in rows if fits(s.prompt)]
            if len(kept) < len(rows):
                skipped = [n for n, s in rows if not fits(s.prompt)]
                logger.warning("%s: %d of its %d %s rows skipped, their prompts %s: rows %s", self.files[split],
                               len(skipped), len(rows), split, why,
                               ", ".join(map(str, skipped[:10])) + (", ..." if len(skipped) > 10 else ""))
            if rows and not kept:
                raise ValueError(f"{self.files[split]}: no {split} row has a prompt that fits: all are {why}")
            self.rows[split] = kept

    def train_sample(self, index: int) -> Sample:
        train = self.rows["train"]
        epoch, position = divmod(index, len(train))
        if epoch not in self.orders:
            order = list(range(len(train)))
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
            self.orders[epoch] = order
        return train[self.orders[epoch][position]][1]

    def eval_samples(self, split: str = "validation") -> list[Sample]:
        if not self.rows[check_split(split)]:
            raise ValueError(f"the dataset task has no {split} rows: give dataset.{split.replace('validation', 'eval')}"
                             f"_path or dataset.{split.replace('validation', 'eval')}_size")
        return [s for _, s in self.rows[split]]

    def reward(self, text: str, answer: str) -> tuple[float, dict[str, float]]:
        return self.score(text, answer)
