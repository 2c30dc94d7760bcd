"""Zorplex: a tool-lookup environment. Each sample makes up a few words and gives each a random value;
the model cannot know a value without calling the tool (`LOOKUP[word]`, answered by a tool message)
and must end with the answer after "Answer:". Level 1 asks for one word's value, level 2 for the sum
of two.

SmolLM2-135M-Instruct does not call the tool from instructions alone (measured: 0 of 32 greedy replies,
no call of the word asked about in 256 sampled ones), so by default the conversation opens with one worked example of
the same level; with it the model calls the tool often enough, at level 1, for RL to have a signal.
"""

import random
import re
from dataclasses import dataclass

from meshrl.tasks import Sample

_CALL = re.compile(r"LOOKUP\[([^\]\n]*)\]")
_ANSWER = re.compile(r"Answer:\**\s*(-?\d+)")
_SYLLABLES = ("zor", "plex", "quib", "flar", "mun", "tesh", "vok", "bli", "dra", "nix", "gel", "pom", "sna", "rif",
              "tup", "kel", "wob", "yar")

SYSTEM = ("You can look up the value of a made-up word with the tool: write LOOKUP[word] and the tool replies "
          "with its value. You do not know any value without looking it up. When you know the answer, reply "
          "with 'Answer: N'.")
QUESTIONS = {1: ("What is the value of {0}?", "Look up {0} and tell me its value.", "Find the value of {0}."),
             2: ("What is the sum of the values of {0} and {1}?", "Add the values of {0} and {1}.",
                 "What do the values of {0} and {1} add up to?")}
EXAMPLES = {1: ({"blick": 42}, "What is the value of blick?"),
            2: ({"blick": 42, "snarf": 17}, "What is the sum of the values of blick and snarf?")}


@dataclass
class ZorplexConfig:
    """Values of made-up words, looked up with a tool, answered after "Answer:"."""

    level: int = 1  # 1: one word's value | 2: the sum of two words' values
    example: bool = True  # open with one worked example of the tool at the same level
    tool_role: str = "tool"  # the chat role of the tool's replies
    tool_weight: float = 0.1  # reward for looking up every word the question names; a right tagged answer adds 1
    eval_size: int = 64  # held-out eval samples
    seed: int = 0  # which words and values


class Zorplex:
    accuracy = "correct"
    stop = ["]"]  # a tool call ends the model's turn: the tool answers it

    def __init__(self, config: ZorplexConfig):
        if config.level not in QUESTIONS:
            raise ValueError(f"zorplex level must be one of {sorted(QUESTIONS)}, not {config.level}")
        self.config = config

    def _sample(self, rng: random.Random) -> Sample:
        words = []
        while len(words) < self.config.level:
            word = "".join(rng.sample(_SYLLABLES, 2))
            words += [word] if word not in words else []
        values = {w: rng.randint(10, 99) for w in words}
        question = rng.choice(QUESTIONS[self.config.level]).format(*words)
        return Sample(question, str(sum(values.values())), {"values": values})

    def train_sample(self, index: int) -> Sample:
        return self._sample(random.Random(f"train-{self.config.seed}-{index}"))

    def eval_samples(self) -> list[Sample]:
        return [self._sample(random.Random(f"eval-{self.config.seed}-{i}")) for i in range(self.config.eval_size)]

    def opening(self, sample: Sample) -> list[dict]:
        messages = [{"role": "system", "content": SYSTEM}]
        if self.config.example:
            values, question = EXAMPLES[self.config.level]
            messages.append({"role": "user", "content": question})
            for word, value in values.items():
                messages += [{"role": "assistant", "content": f"LOOKUP[{word}]"},
                             {"role": self.config.tool_role, "content": str(value)}]
            messages.append({"role": "assistant", "content": f"Answer: {sum(values.values())}"})
        return messages + [{"role": "user", "content": sample.prompt}]

    def step(self, sample: Sample, messages: list[dict]) -> list[dict] | None:
        """A tool call gets the word's value (or "unknown word"); an answer, or a turn with neither, ends it."""
        reply = messages[-1]["content"]
        calls = _CALL.findall(reply)
        if _ANSWER.search(reply) or not calls:
            return None
        value = sample.info["values"].get(calls[-1].strip())
        return [{"role": self.config.tool_role, "content": str(value) if value is not None else "unknown word"}]

    def reward(self, sample: Sample, messages: list[dict]) -> tuple[float, dict[str, float]]:
        """The reward, and its checks (each 0 or 1): `correct`: the last tagged answer is the answer;
        `tagged`: there is a tagged answer; `tool_call`: every word of the question was looked up."""
        replies = [m["content"] for m in messages[len(self.opening(sample)):] if m["role"] == "assistant"]
        tagged = [a for r in replies for a in _ANSWER.findall(r)]
        called = {c.strip() for r in replies for c in _CALL.findall(r)}
        checks = {"correct": float(bool(tagged) and tagged[-1] == sample.answer), "tagged": float(bool(tagged)),
                  "tool_call": float(set(sample.info["values"]) <= called)}
        return checks["correct"] + self.config.tool_weight * checks["tool_call"], checks
