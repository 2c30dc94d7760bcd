"""Arithmetic sums with a checkable answer in a required format: the smallest task on which a 135M
model learns something through RL alone.

Every prompt asks for the answer after "Answer:". Untrained SmolLM2-135M-Instruct adds two digits
well but almost never uses that format (greedy: never; sampled: 1 to 5% of the time, depending on
the wording), so the reward pays for the format: `correct` only counts the tagged answer, and a
tagged answer of any value earns `format_weight`. A bare right number earns nothing. The questions
come in several wordings so that the format is not learnt for one of them only.
"""

import random
import re
from dataclasses import dataclass

from meshrl.tasks import Sample

_NUMBER = re.compile(r"-?\d+")
_ANSWER = re.compile(r"Answer:\**\s*(-?\d+)")  # "Answer: 7", also in markdown bold: "**Answer:** 7"

# {sum} is "3 + 4", {terms} is "3 and 4" (or "3, 4 and 5"). Each asks for the tagged answer; the
# untrained model follows none of them when decoding greedily (measured; see the README, "What the demo teaches").
PHRASINGS = (
    "What is {sum}? Put the final answer after 'Answer:'.",
    "Add {terms}. Give the result as 'Answer: <number>'.",
    "{sum} = ? Write the final answer as Answer: N.",
    "Calculate {sum}. Reply with one line: Answer: <the sum>",
    'What is the sum of {terms}? Finish with "Answer: " and the number.',
)


@dataclass
class SumDigitsConfig:
    """Sums of random numbers, answered after "Answer:"."""

    num_terms: int = 2  # numbers to add
    digits: int = 1  # each term has 1..digits digits
    format_weight: float = 0.2  # reward for a tagged answer of any value; a right tagged answer adds 1
    eval_size: int = 128  # held-out eval prompts
    seed: int = 0  # which prompts


class SumDigits:
    accuracy = "correct"

    def __init__(self, config: SumDigitsConfig):
        if config.num_terms < 2 or config.digits < 1:
            raise ValueError("sum_digits needs num_terms >= 2 and digits >= 1")
        self.config = config

    def _sample(self, rng: random.Random) -> Sample:
        terms = [str(rng.randint(0, 10**self.config.digits - 1)) for _ in range(self.config.num_terms)]
        listed = ", ".join(terms[:-1]) + " and " + terms[-1]
        prompt = rng.choice(PHRASINGS).format(sum=" + ".join(terms), terms=listed)
        return Sample(prompt, str(sum(map(int, terms))))

    def train_sample(self, index: int) -> Sample:
        return self._sample(random.Random(f"train-{self.config.seed}-{index}"))

    def eval_samples(self) -> list[Sample]:
        return [self._sample(random.Random(f"eval-{self.config.seed}-{i}")) for i in range(self.config.eval_size)]

    def reward(self, text: str, answer: str) -> tuple[float, dict[str, float]]:
        """The reward, and the checks it is made of (each 0 or 1):
        `correct`: the number after the last "Answer:" is the answer; `format`: there is one;
        `last_number`: the last number in the text is the answer, tagged or not (not rewarded)."""
        tagged = _ANSWER.findall(text)
        numbers = _NUMBER.findall(text)
        checks = {"correct": float(bool(tagged) and tagged[-1] == answer), "format": float(bool(tagged)),
                  "last_number": float(bool(numbers) and numbers[-1] == answer)}
        return checks["correct"] + self.config.format_weight * checks["format"], checks

    def prompt_checks(self, sample: Sample, text: str) -> dict[str, float]:
        """Not rewarded: `copied`: the tagged answer is wrong and is one of the question's own numbers
        ("Add 9 and 9." -> "Answer: 9"), the way a run that has learnt the format but not the sum fails."""
        tagged = _ANSWER.findall(text)
        return {"copied": float(bool(tagged) and tagged[-1] != sample.answer
                                and tagged[-1] in _NUMBER.findall(sample.prompt))}
