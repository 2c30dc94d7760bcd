"""Tasks from reasoning-gym: about a hundred procedurally generated reasoning datasets (arithmetic,
countdown, logic puzzles, graphs, ...) by name, or a weighted mix of several, each rewarded by the
dataset's own scorer. What many RL papers and frameworks train and report on, with no task code here.

Training samples come from each dataset generated with `seed`, the validation and test splits from
the same datasets generated with seeds that no training index reaches (reasoning-gym seeds entry i
with seed + i: training indices stay below `TRAIN_SIZE`, validation's seed is `seed + TRAIN_SIZE`,
test's `seed + 2 * TRAIN_SIZE`). A small problem space repeats questions across seeds, so the question
texts are held out too: test leaves out validation's questions, and a training index whose question is
held out takes the next index (by a fixed stride) whose question is not.

The prompt is the dataset's question followed by an answer instruction: by default reasoning-gym's
own, the final answer between <answer> and </answer>, the last such tag of the reply being the answer
(reasoning-gym's `extract_answer`); or (`answer_format line`, which small models follow more often)
after "Answer:", the rest of the last such line being the answer. It is scored by the dataset's
`score_answer` (1.0 right; some datasets give part marks); an empty answer, or the "and" of the tags
instruction repeated, is no answer.
A sample's `answer` is a small JSON reference (dataset, split, index, reference answer): the grader
regenerates the entry from it, as every scorer needs the entry's metadata.
"""

import difflib
import json
import random
import re
from dataclasses import dataclass

from meshrl.tasks import Sample
from meshrl.tasks.splits import SPLITS, check_split, distinct

TRAIN_SIZE = 10**9
STRIDE = 1_000_003  # a prime: the indices a held-out question's training index moves to
MOVES = 1000  # training indices tried before the problem space is called too small to hold out
INSTRUCTIONS = {"tags": "Give your final answer between <answer> and </answer> tags.",
                "line": "Put your final answer after 'Answer:'."}
_LINE = re.compile(r"Answer:\**\s*([^\n]*)")
# What a reply that repeats the instruction has where the answer goes: no answer. Measured: with the
# format paid for any tags, SmolLM2 learnt within 15 steps to echo "between <answer> and </answer>".
ECHOES = ("", "and")


def answer_in_line(text: str) -> str | None:
    """The text after the last "Answer:" (markdown bold, quotes and a final full stop taken off)."""
    found = _LINE.findall(text)
    return found[-1].strip().strip("*'\"`").rstrip(".").strip() if found else None


@dataclass
class ReasoningGymConfig:
    """reasoning-gym datasets by name, mixed by weight."""

    datasets: str = "basic_arithmetic:1"  # name:weight, comma separated ("basic_arithmetic:1,countdown:1")
    dataset_args: str = ""  # JSON: each dataset's own settings, {"basic_arithmetic": {"max_terms": 3}}
    answer_format: str = "tags"  # tags: between <answer> and </answer> (reasoning-gym's) | line: after "Answer:"
    format_weight: float = 0.1  # reward for an answer where the format says, right or wrong; the score adds to it
    eval_size: int = 64  # distinct questions at most in each held-out split (validation, test), from the datasets by weight
    seed: int = 0  # which samples


def _library():
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("task reasoning_gym needs the reasoning-gym package: pip install 'meshrl[envs]'") from None
    return reasoning_gym


def parse_mix(datasets: str, known: list[str]) -> dict[str, float]:
    """`name:weight,...` (a missing weight is 1) -> {name: weight}; an unknown name is an error naming
    the closest known ones."""
    mix = {}
    for item in filter(None, (part.strip() for part in datasets.split(","))):
        name, _, weight = item.partition(":")
        if name not in known:
            close = difflib.get_close_matches(name, known, n=4, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown reasoning_gym dataset {name!r}{hint} (all {len(known)}: "
                             "python -c 'import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))')")
        try:
            mix[name] = float(weight or 1)
        except ValueError:
            raise ValueError(f"reasoning_gym.datasets: weight of {name} is not a number: {weight!r}") from None
        if mix[name] <= 0:
            raise ValueError(f"reasoning_gym.datasets: weight of {name} must be > 0, not {mix[name]}")
    if not mix:
        raise ValueError("reasoning_gym.datasets names no dataset")
    return mix


class ReasoningGym:
    accuracy = "correct"

    def __init__(self, config: ReasoningGymConfig):
        library = _library()
        self.config = config
        self.mix = parse_mix(config.datasets, sorted(library.factory.DATASETS))
        try:
            args = json.loads(config.dataset_args) if config.dataset_args else {}
        except ValueError as e:
            raise ValueError(f"reasoning_gym.dataset_args is not JSON ({e})") from None
        if extra := set(args) - set(self.mix):
            raise ValueError(f"reasoning_gym.dataset_args names datasets not in the mix: {sorted(extra)}")
        self.splits = {split: {} for split in SPLITS}
        for name in self.mix:
            for n, split in enumerate(SPLITS):
                seed = config.seed + n * TRAIN_SIZE
                try:
                    self.splits[split][name] = library.create_dataset(name, **args.get(name, {}), seed=seed,
                                                                      size=TRAIN_SIZE)
                except (TypeError, AssertionError, ValueError) as e:
                    raise ValueError(f"reasoning_gym dataset {name}: bad settings {args.get(name, {})} ({e})") from None
        if config.answer_format not in INSTRUCTIONS:
            raise ValueError(f"reasoning_gym.answer_format must be one of {', '.join(INSTRUCTIONS)}, "
                             f"not {config.answer_format!r}")
        self.instruction = INSTRUCTIONS[config.answer_format]
        self.extract = library.utils.extract_answer if config.answer_format == "tags" else answer_in_line

    def _sample(self, split: str, index: int) -> Sample:
        rng = random.Random(f"{split}-{self.config.seed}-{index}")
        name = rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
        entry = self.splits[split][name][index]
        reference = json.dumps({"dataset": name, "split": split, "index": index, "answer": entry["answer"]})
        return Sample(f"{entry['question']}\n\n{self.instruction}", reference, {"dataset": name, "reference": entry["answer"]})

    def _held_out(self) -> list[list[Sample]]:
        """Validation's samples, then test's without validation's questions (made once)."""
        if not hasattr(self, "held_out"):
            size, question = self.config.eval_size, lambda sample: sample.prompt
            validation = distinct(lambda i: self._sample("validation", i), question, size)
            test = distinct(lambda i: self._sample("test", i), question, size, {s.prompt for s in validation})
            self.held_out = [validation, test]
            self.held_out_questions = {s.prompt for s in validation + test}
        return self.held_out

    def train_sample(self, index: int) -> Sample:
        self._held_out()
        for move in range(MOVES):
            sample = self._sample("train", (index + move * STRIDE) % TRAIN_SIZE)
            if sample.prompt not in self.held_out_questions:
                return sample
        raise ValueError(f"reasoning_gym {self.config.datasets}: {MOVES} training indices from {index} all hold a "
                         "question of the validation or test split: the problem space is too small to hold out "
                         "reasoning_gym.eval_size questions twice")

    def eval_samples(self, split: str = "validation") -> list[Sample]:
        return self._held_out()[1 if check_split(split) == "test" else 0]

    def reward(self, text: str, answer: str) -> tuple[float, dict[str, float]]:
        """The reward, and its checks: `score` (the dataset's scorer, 0 to 1), `correct` (score 1),
        `format` (an answer where the format says), and `correct/<dataset>` (averaged over that dataset's replies)."""
        ref = json.loads(answer)
        dataset = self.splits[ref["split"]][ref["dataset"]]
        reply = self.extract(text)
        if reply is not None and reply.strip() in ECHOES:
            reply = None  # the instruction repeated ("between <answer> and </answer>"), or nothing
        score = float(dataset.score_answer(reply, dataset[ref["index"]])) if reply is not None else 0.0
        correct = float(score >= 1.0)
        checks = {"score": score, "correct": correct, "format": float(reply is not None),
                  f"correct/{ref['dataset']}": correct}
        return score + self.config.format_weight * checks["format"], checks
