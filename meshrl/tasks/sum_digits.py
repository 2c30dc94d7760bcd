"""Arithmetic sums with a checkable answer in a required format: the smallest task on which a 135M
model learns something through RL alone.

Every prompt asks for the answer after "Answer:". Untrained SmolLM2-135M-Instruct adds two digits
well but almost never uses that format (greedy: never; sampled: 1 to 5% of the time, depending on
the wording), so the reward pays for the format: `correct` only counts the tagged answer, and a
tagged answer of any value earns `format_weight`. A bare right number earns nothing. The questions
come in several wordings so that the format is not learnt for one of them only.

Splits (meshrl/tasks/splits.py): the numbers of a sum, in any order, are one item, in one split; so
"3 + 4" in test means neither "3 + 4" nor "4 + 3" is ever trained on. Training and validation use the
first four wordings; test uses all five, the last (`TEST_PHRASING`) one that training never sees. Two
rules (`split`):
- `hash` (the default, and every named recipe so far): each item by its hash alone, about 60/20/20; with
  two one-digit terms 55, 18 and 27 of the 100 ordered pairs, so few items that a split's make-up is
  chance's (the test split of the demo added a 0 in 38% of its prompts, training in 7%). An eval split
  holds up to `eval_size` distinct prompts (72 for validation and 128 of 135 for test with two one-digit
  terms), an item in several of them.
- `stratified`: the items grouped by what changes a sum's difficulty (a zero term, the answer's number of
  digits), each group dealt 20% to test, 20% to validation and the rest to training in the order of the
  items' hashes, so each split holds each kind of sum in training's proportions. An eval split is each of
  its items once (up to `eval_size`), the wordings dealt in turn, so they are balanced too. `max_term`
  widens the terms' range past one digit's: with two terms up to 19, 42 items in each held-out split,
  none more than 2.4% of it.
"""

import functools
import itertools
import random
import re
from dataclasses import dataclass

from meshrl.checks import one_of
from meshrl.tasks import Sample
from meshrl.tasks.splits import check_split, distinct, split_of, stratified_splits

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
TEST_PHRASING = PHRASINGS[-1]  # in the test split only


@dataclass
class SumDigitsConfig:
    """Sums of random numbers, answered after "Answer:"."""

    num_terms: int = 2  # numbers to add
    digits: int = 1  # each term has 1..digits digits
    max_term: int = 0  # the largest term (0: 10**digits - 1)
    split: str = "hash"  # hash | stratified: how items are held out (the module's docstring)
    format_weight: float = 0.2  # reward for a tagged answer of any value; a right tagged answer adds 1
    eval_size: int = 128  # distinct prompts at most in each held-out split (validation, test)
    seed: int = 0  # which training prompts, in which order, and which eval prompts when a split has more


def difficulty(item: tuple[int, ...]) -> tuple[bool, int]:
    """What changes how hard a sum is for a small model: a zero term, and the answer's number of digits."""
    return 0 in item, len(str(sum(item)))


def phrasings_of(split: str) -> tuple[str, ...]:
    """A split's wordings: all five in test, the four others elsewhere (`TEST_PHRASING` is never trained on)."""
    return PHRASINGS if split == "test" else PHRASINGS[:-1]


@functools.lru_cache(maxsize=8)
def stratified_items(num_terms: int, max_term: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Every item (the sorted terms) of the task, by split, each split in its items' hash order."""
    items = itertools.combinations_with_replacement(range(max_term + 1), num_terms)
    return {split: tuple(held) for split, held in stratified_splits(items, difficulty).items()}


class SumDigits:
    accuracy = "correct"

    def __init__(self, config: SumDigitsConfig):
        if config.num_terms < 2 or config.digits < 1 or config.max_term < 0:
            raise ValueError("sum_digits needs num_terms >= 2, digits >= 1 and max_term >= 0")
        one_of(config, "sum_digits", split=("hash", "stratified"))
        self.config = config
        self.max_term = config.max_term or 10**config.digits - 1
        if config.split == "stratified":
            self.items = stratified_items(config.num_terms, self.max_term)

    def _prompt(self, terms: list[int], phrasing: str) -> Sample:
        listed = ", ".join(map(str, terms[:-1])) + f" and {terms[-1]}"
        return Sample(phrasing.format(sum=" + ".join(map(str, terms)), terms=listed), str(sum(terms)))

    def _sample(self, rng: random.Random, split: str) -> Sample:
        """A sum whose numbers belong to `split`, in one of the split's wordings."""
        phrasings = phrasings_of(split)
        if self.config.split == "stratified":
            terms = list(rng.choice(self.items[split]))
            rng.shuffle(terms)
            return self._prompt(terms, rng.choice(phrasings))
        while True:
            terms = [rng.randint(0, self.max_term) for _ in range(self.config.num_terms)]
            if split_of(tuple(sorted(terms))) == split:
                break
        return self._prompt(terms, rng.choice(phrasings))

    def train_sample(self, index: int) -> Sample:
        return self._sample(random.Random(f"train-{self.config.seed}-{index}"), "train")

    def eval_samples(self, split: str = "validation") -> list[Sample]:
        check_split(split)
        if self.config.split == "stratified":  # each item once, in a shuffled order, the wordings dealt in turn
            phrasings = phrasings_of(split)
            rng = random.Random(f"{split}-{self.config.seed}")
            items = self.items[split][:self.config.eval_size]
            return [self._prompt(rng.sample(item, len(item)), phrasings[i % len(phrasings)])
                    for i, item in enumerate(items)]
        return distinct(lambda i: self._sample(random.Random(f"{split}-{self.config.seed}-{i}"), split),
                        lambda s: s.prompt, self.config.eval_size)

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
