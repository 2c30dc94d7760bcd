"""A task as a user would write it in their own package (not in meshrl): `--task user_task:Parity`.
Imported by the controller and by the grader processes (conftest puts tests/ on their PYTHONPATH)."""

from dataclasses import dataclass

from monarch.actor import Actor, endpoint

from meshrl.tasks import Sample
from meshrl.tasks.dataset import DatasetConfig, DatasetTask


class Parity:
    """Is a number even? Answered with "even" or "odd" anywhere in the reply."""

    accuracy = "right"  # its own name for the check meshrl reports as accuracy

    @dataclass
    class Config:
        eval_size: int = 4
        largest: int = 99

    def __init__(self, config: "Parity.Config"):
        self.config = config

    def _sample(self, n: int) -> Sample:
        n %= self.config.largest + 1
        return Sample(f"Is {n} even or odd? Answer with one word.", "even" if n % 2 == 0 else "odd")

    def train_sample(self, index: int) -> Sample:
        return self._sample(7 * index + 3)

    def eval_samples(self, split: str = "validation") -> list[Sample]:
        start = 1000 if split == "validation" else 2000
        return [self._sample(start + i) for i in range(self.config.eval_size)]

    def reward(self, text: str, answer: str) -> tuple[float, dict[str, float]]:
        words = text.lower().split()
        right = float(answer in words and ("odd" if answer == "even" else "even") not in words)
        return right, {"right": right, "one_word": float(len(words) == 1)}


def longer_is_better(text: str, answer: str) -> float:
    """A dataset reward as a user's module:function: a float alone."""
    return min(len(text) / 100, 1.0)


class LongerReplies:
    """A single-turn task the tiny random model learns something from: a longer reply scores more. Its
    replies differ in length, so groups carry advantages and every step changes the policy."""

    accuracy = "long"

    def train_sample(self, index: int) -> Sample:
        return Sample(f"Question {index}: say something.", "")

    def eval_samples(self, split: str = "validation") -> list[Sample]:
        start = 1000 if split == "validation" else 2000
        return [self.train_sample(start + i) for i in range(2)]

    def reward(self, text: str, answer: str) -> tuple[float, dict[str, float]]:
        return min(len(text) / 100, 1.0), {"long": float(len(text) > 50)}


class FakeTool:
    """A fake multi-turn environment for smoke runs of the tiny random model (which never calls a real
    tool): the tool answers every model turn with `result <turn>` until the model has had `turns` turns."""

    accuracy = "long"
    stop = ["."]

    @dataclass
    class Config:
        turns: int = 3

    def __init__(self, config: "FakeTool.Config"):
        self.config = config

    def train_sample(self, index: int) -> Sample:
        return Sample(f"Question {index}: say something.", "")

    def eval_samples(self, split: str = "validation") -> list[Sample]:
        start = 1000 if split == "validation" else 2000
        return [self.train_sample(start + i) for i in range(2)]

    def opening(self, sample: Sample) -> list[dict]:
        return [{"role": "user", "content": sample.prompt}]

    def step(self, sample: Sample, messages: list[dict]) -> list[dict] | None:
        turns = sum(m["role"] == "assistant" for m in messages)
        return [{"role": "tool", "content": f"result {turns}"}] if turns < self.config.turns else None

    def conversation_reward(self, sample: Sample, messages: list[dict]) -> tuple[float, dict[str, float]]:
        length = sum(len(m["content"]) for m in messages if m["role"] == "assistant")
        return min(length / 100, 1.0), {"long": float(length > 50)}


class ScoreOnlyGrader(Actor):
    """A user's grader written for single-turn tasks: no `step` endpoint (never spawned in the tests)."""

    @endpoint
    async def score(self, sample, replies):
        return [None] * len(replies)


class SlippingDataset(DatasetTask):
    """The dataset task with one training prompt (index 1) made too long after the load's check: it
    slips through to vLLM, which refuses it, and only its group fails."""

    Config = DatasetConfig

    def train_sample(self, index: int) -> Sample:
        sample = super().train_sample(index)
        return Sample(sample.prompt + " and so on" * 400, sample.answer) if index == 1 else sample
