"""Zorplex: a tool-lookup environment. Each sample makes up a few words and gives each a random value;
the model cannot know a value without calling the tool (`LOOKUP[word]`, answered by a tool message)
and must end with the answer after "Answer:". Level 1 asks for one word's value, level 2 for the sum
of two.

SmolLM2-135M-Instruct does not call the tool from instructions alone (measured: 0 of 32 greedy replies,
no call of the word asked about in 256 sampled ones), so by default the conversation opens with one worked example of
the same level; with it the model calls the tool often enough, at level 1, for RL to have a signal.

`calculator` adds a second tool: `CALC[expression]` answers the value of a sum, difference or
product of whole numbers (or "bad expression"). SmolLM2-135M adds two two-digit numbers right in 1%
of level-2 conversations at best, after 30 steps (docs/studies.md: curriculum), so level 2 was
learnt as far as the lookups and never the sum; with the calculator the sum is a tool's answer to
copy, and the worked example of level 2 shows both lookups, the calculator and the answer.

`curriculum` "START-END" trains on level 1 first and mixes in `level`'s questions as training goes
on: train prompts before index START are at level 1, from END on all at `level`, and between the
share at `level` rises linearly (a step takes `controller.prompts_per_step` prompts). A schedule
over prompt indices, not a feedback loop: each prompt's level follows from its index alone, so a
resumed run samples the same prompts. The eval splits are always at `level`.

Splits (meshrl/tasks/splits.py): each made-up word (306 of two syllables) and each value (10 to 99)
belongs to one split by its hash, and a sample of a split takes its words and values from that split
only, so no word a validation or test question names and no value it hides is ever trained on.
"""

import ast
import operator
import random
import re
from dataclasses import dataclass

from meshrl.tasks import Sample
from meshrl.tasks.splits import SPLITS, check_split, distinct, split_of

_CALL = re.compile(r"LOOKUP\[([^\]\n]*)\]")
_CALC = re.compile(r"CALC\[([^\]\n]*)\]")
_TOOL = re.compile(r"(LOOKUP|CALC)\[([^\]\n]*)\]")
ANSWER = re.compile(r"Answer:\**\s*(-?\d+)")
_SYLLABLES = ("zor", "plex", "quib", "flar", "mun", "tesh", "vok", "bli", "dra", "nix", "gel", "pom", "sna", "rif",
              "tup", "kel", "wob", "yar")

SYSTEM = ("You can look up the value of a made-up word with the tool: write LOOKUP[word] and the tool replies "
          "with its value. You do not know any value without looking it up. When you know the answer, reply "
          "with 'Answer: N'.")
CALCULATOR = (" To add, subtract or multiply numbers, write CALC[expression], e.g. CALC[3+4], and the tool "
              "replies with the result.")
QUESTIONS = {1: ("What is the value of {0}?", "Look up {0} and tell me its value.", "Find the value of {0}."),
             2: ("What is the sum of the values of {0} and {1}?", "Add the values of {0} and {1}.",
                 "What do the values of {0} and {1} add up to?")}
VALUES = {split: [v for v in range(10, 100) if split_of(("value", v)) == split] for split in SPLITS}
EXAMPLES = {1: ({"blick": 42}, "What is the value of blick?"),
            2: ({"blick": 42, "snarf": 17}, "What is the sum of the values of blick and snarf?")}


@dataclass
class ZorplexConfig:
    """Values of made-up words, looked up with a tool, answered after "Answer:"."""

    level: int = 1  # 1: one word's value | 2: the sum of two words' values
    example: bool = True  # open with one worked example of the tool at the same level
    tool_role: str = "tool"  # the chat role of the tool's replies
    tool_weight: float = 0.1  # reward for looking up every word the question names; a right tagged answer adds 1
    calculator: bool = False  # a second tool, CALC[expression] (+, -, *), in the instructions and the worked example
    eval_size: int = 64  # distinct prompts at most in each held-out split (validation, test)
    seed: int = 0  # which words and values
    curriculum: str = ""  # "START-END": train prompts below index START at level 1, from END all at `level`, the share at `level` rising linearly between; "": all at `level`


class Zorplex:
    accuracy = "correct"
    stop = ["]"]  # a tool call ends the model's turn: the tool answers it

    def __init__(self, config: ZorplexConfig):
        if config.level not in QUESTIONS:
            raise ValueError(f"zorplex level must be one of {sorted(QUESTIONS)}, not {config.level}")
        self.config = config
        self.schedule = _schedule(config.curriculum)

    def _sample(self, rng: random.Random, level: int, split: str) -> Sample:
        """`level` distinct words of `split`, each with a value of `split`."""
        words = []
        while len(words) < level:
            word = "".join(rng.sample(_SYLLABLES, 2))
            words += [word] if word not in words and split_of(("word", word)) == split else []
        values = {w: rng.choice(VALUES[split]) for w in words}
        question = rng.choice(QUESTIONS[level]).format(*words)
        return Sample(question, str(sum(values.values())), {"values": values})

    def train_sample(self, index: int) -> Sample:
        return self._sample(random.Random(f"train-{self.config.seed}-{index}"), self.train_level(index), "train")

    def train_level(self, index: int) -> int:
        """The level of train prompt `index`: `level`, or under a curriculum 1 or `level` by its schedule."""
        if self.schedule is None:
            return self.config.level
        start, end = self.schedule
        share = min(1.0, max(0.0, (index - start + 1) / (end - start + 1)))
        return self.config.level if random.Random(f"level-{self.config.seed}-{index}").random() < share else 1

    def eval_samples(self, split: str = "validation") -> list[Sample]:
        check_split(split)
        return distinct(lambda i: self._sample(random.Random(f"{split}-{self.config.seed}-{i}"), self.config.level,
                                               split), lambda s: s.prompt, self.config.eval_size)

    def opening(self, sample: Sample) -> list[dict]:
        messages = [{"role": "system", "content": SYSTEM + (CALCULATOR if self.config.calculator else "")}]
        if self.config.example:
            values, question = EXAMPLES[len(sample.info["values"])]  # the sample's own level
            messages.append({"role": "user", "content": question})
            for word, value in values.items():
                messages += [{"role": "assistant", "content": f"LOOKUP[{word}]"},
                             {"role": self.config.tool_role, "content": str(value)}]
            if self.config.calculator and len(values) > 1:
                messages += [{"role": "assistant", "content": f"CALC[{'+'.join(map(str, values.values()))}]"},
                             {"role": self.config.tool_role, "content": str(sum(values.values()))}]
            messages.append({"role": "assistant", "content": f"Answer: {sum(values.values())}"})
        return messages + [{"role": "user", "content": sample.prompt}]

    def step(self, sample: Sample, messages: list[dict]) -> list[dict] | None:
        """A tool call gets the word's value (or "unknown word"), or with the calculator an expression's
        value (or "bad expression"); the turn's last call is answered. An answer, or a turn with no call, ends it."""
        reply = messages[-1]["content"]
        calls = [c for c in _TOOL.findall(reply) if c[0] == "LOOKUP" or self.config.calculator]
        if ANSWER.search(reply) or not calls:
            return None
        tool, argument = calls[-1]
        if tool == "CALC":
            result = calculate(argument)
            return [{"role": self.config.tool_role, "content": str(result) if result is not None else "bad expression"}]
        value = sample.info["values"].get(argument.strip())
        return [{"role": self.config.tool_role, "content": str(value) if value is not None else "unknown word"}]

    def conversation_reward(self, sample: Sample, messages: list[dict]) -> tuple[float, dict[str, float]]:
        """The reward, and its checks (each 0 or 1): `correct`: the last tagged answer is the answer;
        `tagged`: there is a tagged answer; `tool_call`: every word of the question was looked up; with the
        calculator, `calculated`: the calculator was asked for the answer (only reported, not rewarded)."""
        replies = [m["content"] for m in messages[len(self.opening(sample)):] if m["role"] == "assistant"]
        tagged = [a for r in replies for a in ANSWER.findall(r)]
        called = {c.strip() for r in replies for c in _CALL.findall(r)}
        checks = {"correct": float(bool(tagged) and tagged[-1] == sample.answer), "tagged": float(bool(tagged)),
                  "tool_call": float(set(sample.info["values"]) <= called)}
        if self.config.calculator:
            results = {calculate(c) for r in replies for c in _CALC.findall(r)}
            checks["calculated"] = float(int(sample.answer) in results)
        return checks["correct"] + self.config.tool_weight * checks["tool_call"], checks


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> int | None:
    """The value of whole numbers joined by +, - and * (with brackets), or None for anything else: the
    expression is parsed, never evaluated as code."""
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.left), value(node.right))
            if abs(result) > 10**12:
                raise ValueError("too large")
            return result
        raise ValueError("not arithmetic")

    try:
        return value(tree)
    except (ValueError, RecursionError):
        return None


def _schedule(curriculum: str) -> tuple[int, int] | None:
    if not curriculum:
        return None
    try:
        start, end = (int(n) for n in curriculum.split("-"))
    except ValueError:
        raise ValueError(f"zorplex.curriculum {curriculum!r} is not START-END (train prompt indices, e.g. 40-120)") \
            from None
    if not 0 <= start <= end:
        raise ValueError(f"zorplex.curriculum {curriculum!r}: START-END needs 0 <= START <= END")
    return start, end
