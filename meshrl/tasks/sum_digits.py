"""Arithmetic sums with a checkable answer: the smallest task on which a 135M model can learn."""

import random
import re
from dataclasses import dataclass

from meshrl.tasks import Sample

_NUMBER = re.compile(r"-?\d+")
_ANSWER = re.compile(r"Answer:\s*(-?\d+)")


@dataclass
class SumDigitsConfig:
    num_terms: int = 2
    digits: int = 1  # each term has 1..digits digits
    format_bonus: float = 0.1  # reward for putting the answer after "Answer:"
    eval_size: int = 64
    seed: int = 0


class SumDigits:
    def __init__(self, config: SumDigitsConfig):
        if config.num_terms < 2 or config.digits < 1:
            raise ValueError("sum_digits needs num_terms >= 2 and digits >= 1")
        self.config = config

    def _sample(self, rng: random.Random) -> Sample:
        terms = [rng.randint(0, 10**self.config.digits - 1) for _ in range(self.config.num_terms)]
        question = " + ".join(map(str, terms))
        return Sample(f"What is {question}? Put the final answer after 'Answer:'.", str(sum(terms)))

    def train_sample(self, index: int) -> Sample:
        return self._sample(random.Random(f"train-{self.config.seed}-{index}"))

    def eval_samples(self) -> list[Sample]:
        return [self._sample(random.Random(f"eval-{self.config.seed}-{i}")) for i in range(self.config.eval_size)]

    def reward(self, text: str, answer: str) -> dict[str, float]:
        """`correct` judges the number after the last "Answer:" or, failing that, the last number."""
        tagged = _ANSWER.findall(text)
        numbers = tagged or _NUMBER.findall(text)
        correct = bool(numbers) and numbers[-1] == answer
        return {"correct": float(correct), "format": self.config.format_bonus if tagged else 0.0}
