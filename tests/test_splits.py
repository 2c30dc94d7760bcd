"""Held out means held out: every built-in task's train, validation and test splits share no prompt
text and no underlying item (the numbers of a sum, a made-up word or value, a reasoning-gym question, a
file's prompt), shown over each task's whole space (a long prefix of reasoning-gym's training indices).
meshrl/tasks/splits.py says how the splits are made."""

import itertools
import json
import re

import pytest

from meshrl.tasks.dataset import DatasetConfig, DatasetTask
from meshrl.tasks.reasoning_gym import ReasoningGym, ReasoningGymConfig
from meshrl.tasks.splits import split_of, stratified_splits
from meshrl.tasks.sum_digits import PHRASINGS, TEST_PHRASING, SumDigits, SumDigitsConfig, difficulty
from meshrl.tasks.zorplex import _SYLLABLES, VALUES, Zorplex, ZorplexConfig

HELD_OUT = ("validation", "test")


def assert_disjoint(prompts: dict[str, set]) -> None:
    for a, b in itertools.combinations(prompts, 2):
        assert not prompts[a] & prompts[b], f"{a} and {b} share {sorted(prompts[a] & prompts[b])[:3]}"


def sum_terms(prompt: str) -> tuple[int, ...]:
    return tuple(sorted(int(n) for n in re.findall(r"\d+", prompt.split("Answer")[0])))


@pytest.mark.parametrize("num_terms, digits", [(2, 1), (3, 1), (2, 2)])
def test_sum_digits_splits_share_no_sum_and_test_has_a_wording_training_never_sees(num_terms, digits):
    task = SumDigits(SumDigitsConfig(num_terms=num_terms, digits=digits, eval_size=200))
    space = {split: set() for split in ("train", *HELD_OUT)}  # every prompt of the task, by split
    for terms in itertools.product(range(10**digits), repeat=num_terms):
        split = split_of(tuple(sorted(terms)))
        listed = ", ".join(map(str, terms[:-1])) + f" and {terms[-1]}"
        for phrasing in PHRASINGS if split == "test" else PHRASINGS[:-1]:
            space[split].add(phrasing.format(sum=" + ".join(map(str, terms)), terms=listed))
    assert_disjoint(space)
    assert_disjoint({split: {sum_terms(p) for p in prompts} for split, prompts in space.items()})
    sizes = {split: len(prompts) for split, prompts in space.items()}
    assert min(sizes.values()) > 0 and sizes["train"] > sizes["validation"]
    trained = {task.train_sample(i).prompt for i in range(2000)}
    assert trained <= space["train"]
    for split in HELD_OUT:
        held = [s.prompt for s in task.eval_samples(split)]
        assert len(held) == len(set(held)) and set(held) <= space[split]
    first_words = TEST_PHRASING.split("{")[0]
    assert not any(p.startswith(first_words) for p in trained | space["validation"])
    assert any(p.startswith(first_words) for p in space["test"])


def test_stratified_splits_deal_each_kind_out_in_the_same_proportions():
    """By hand: ten items of two kinds (even, odd), five each: a fifth of each kind to test, a fifth to
    validation, the rest to train; every item once; the same split on every call."""
    splits = stratified_splits(range(10), lambda i: i % 2)
    assert sorted(itertools.chain(*splits.values())) == list(range(10))
    assert {split: sorted(i % 2 for i in held) for split, held in splits.items()} == {
        "train": [0, 0, 0, 1, 1, 1], "validation": [0, 1], "test": [0, 1]}
    assert stratified_splits(range(10), lambda i: i % 2) == splits


def make_up(items) -> dict[str, float]:
    """The shares of what changes a sum's difficulty among `items` (sorted terms)."""
    return {"zero": sum(0 in i for i in items) / len(items),
            "two_digit_answer": sum(sum(i) >= 10 for i in items) / len(items)}


@pytest.mark.parametrize("num_terms, max_term", [(2, 19), (2, 9), (3, 9)])
def test_stratified_sum_digits_splits_follow_trainings_make_up_and_no_item_weighs_much(num_terms, max_term):
    """`split stratified`: train, validation and test share no sum and hold every sum of the task; each holds
    sums with a zero term and two-digit answers in training's proportions (dealt per kind: within one item
    of each kind); an eval split is each of its items once, the wordings balanced (test with the one
    training never sees); training draws its items alike. With two terms up to 19 (the widened range),
    no item is more than 5% of a held-out split."""
    task = SumDigits(SumDigitsConfig(num_terms=num_terms, max_term=max_term, split="stratified", eval_size=500))
    items = task.items
    assert_disjoint({split: set(held) for split, held in items.items()})
    every = set(itertools.combinations_with_replacement(range(max_term + 1), num_terms))
    assert set(itertools.chain(*items.values())) == every
    kinds = {difficulty(i) for i in every}
    for kind in kinds:  # each kind dealt out: a fifth (rounded) of its sums in each held-out split
        n = sum(difficulty(i) == kind for i in every)
        assert [sum(difficulty(i) == kind for i in items[split]) for split in HELD_OUT] == [round(n / 5)] * 2, kind
    for split in HELD_OUT:  # so each split's make-up is training's, to one item per kind
        for share, value in make_up(items[split]).items():
            assert abs(value - make_up(items["train"])[share]) <= len(kinds) / len(items[split]), (split, share)
        held = task.eval_samples(split)
        assert sorted(sum_terms(s.prompt) for s in held) == sorted(items[split])  # each item once
        wordings = PHRASINGS if split == "test" else PHRASINGS[:-1]
        counts = [sum(s.prompt.endswith(w.split("}")[-1]) for s in held) for w in wordings]
        assert max(counts) - min(counts) <= 1, (split, counts)
        if (num_terms, max_term) == (2, 19):
            assert len(held) == 42 and 1 / len(set(sum_terms(s.prompt) for s in held)) <= 0.05
    trained = [sum_terms(task.train_sample(i).prompt) for i in range(3000)]
    assert set(trained) <= set(items["train"])
    for share, value in make_up(trained).items():  # 3000 draws: 4 standard deviations of a share at most 0.04
        assert abs(value - make_up(items["train"])[share]) < 0.04, share


def test_sum_digits_demo_sizes_are_the_documented_ones():
    task = SumDigits(SumDigitsConfig())  # two one-digit terms, eval_size 128
    assert len(task.eval_samples("validation")) == 72 and len(task.eval_samples("test")) == 128
    with pytest.raises(ValueError, match="one of validation, test"):
        task.eval_samples("train")


@pytest.mark.parametrize("level", [1, 2])
def test_zorplex_splits_share_no_word_and_no_value(level):
    env = Zorplex(ZorplexConfig(level=level, eval_size=400))
    words = {w: split_of(("word", w)) for w in map("".join, itertools.permutations(_SYLLABLES, 2))}
    assert_disjoint({split: set(VALUES[split]) for split in VALUES})
    assert set(itertools.chain(*VALUES.values())) == set(range(10, 100))
    samples = {"train": [env.train_sample(i) for i in range(2000)],
               **{split: env.eval_samples(split) for split in HELD_OUT}}
    for split, drawn in samples.items():
        for s in drawn:
            assert all(words[w] == split for w in s.info["values"]) and set(s.info["values"].values()) <= set(VALUES[split])
    assert_disjoint({split: {s.prompt for s in drawn} for split, drawn in samples.items()})
    assert_disjoint({split: {w for s in drawn for w in s.info["values"]} for split, drawn in samples.items()})
    held = {split: {s.prompt for s in samples[split]} for split in HELD_OUT}
    if level == 1:  # every question of the split: its words x 3 wordings
        assert len(held["validation"]) == 3 * sum(split == "validation" for split in words.values())


def test_reasoning_gym_splits_share_no_seed_and_no_question_over_a_long_training_prefix():
    small = ReasoningGym(ReasoningGymConfig(datasets="chain_sum:2,leg_counting:1",
                                            dataset_args='{"chain_sum": {"min_terms": 2, "max_terms": 2, '
                                                         '"max_digits": 1}}', eval_size=64))
    trained = [small.train_sample(i) for i in range(5000)]
    prompts = {"train": {s.prompt for s in trained},
               **{split: {s.prompt for s in small.eval_samples(split)} for split in HELD_OUT}}
    assert_disjoint(prompts)
    assert len(prompts["validation"]) == len(prompts["test"]) == 64
    refs = {split: {json.loads(s.answer)["split"] for s in small.eval_samples(split)} for split in HELD_OUT}
    assert refs == {"validation": {"validation"}, "test": {"test"}}
    assert {json.loads(s.answer)["split"] for s in trained} == {"train"}
    # the small space repeats questions across seeds: some training indices moved past held-out ones
    assert any(json.loads(s.answer)["index"] != i for i, s in enumerate(trained))


def test_reasoning_gym_refuses_a_space_too_small_to_hold_out():
    tiny = ReasoningGym(ReasoningGymConfig(datasets="chain_sum", eval_size=200, dataset_args='{"chain_sum": '
                                           '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}'))
    with pytest.raises(ValueError, match="too small to hold out"):
        for i in range(2000):
            tiny.train_sample(i)


def write_jsonl(path, prompts) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return str(path)


def test_dataset_splits_hold_out_rows_by_position_and_drop_repeated_prompts(tmp_path):
    prompts = [f"q{i % 25}" for i in range(30)]  # q0..q4 twice: rows 26-30 repeat rows 1-5
    task = DatasetTask(DatasetConfig(path=write_jsonl(tmp_path / "d.jsonl", prompts), eval_size=4, test_size=3))
    assert [s.prompt for s in task.eval_samples("validation")] == ["q1", "q2", "q3", "q4"]  # the last 4 rows
    assert [s.prompt for s in task.eval_samples("test")] == ["q23", "q24", "q0"]  # the 3 before them
    trained = {task.train_sample(i).prompt for i in range(100)}
    assert_disjoint({"train": trained, **{split: {s.prompt for s in task.eval_samples(split)} for split in HELD_OUT}})
    assert trained == {f"q{i}" for i in range(5, 23)}


def test_dataset_files_of_their_own_for_validation_and_test(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [f"q{i}" for i in range(10)])
    task = DatasetTask(DatasetConfig(path=path, eval_path=write_jsonl(tmp_path / "val.jsonl", ["q0", "v1"]),
                                     test_path=write_jsonl(tmp_path / "test.jsonl", ["v1", "q1", "t2"])))
    assert [s.prompt for s in task.eval_samples("validation")] == ["q0", "v1"]
    assert [s.prompt for s in task.eval_samples("test")] == ["q1", "t2"]  # v1 is validation's
    assert {task.train_sample(i).prompt for i in range(40)} == {f"q{i}" for i in range(2, 10)}
