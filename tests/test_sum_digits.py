import re

import pytest

from meshrl.tasks import Sample, make_task
from meshrl.tasks.sum_digits import PHRASINGS, SumDigitsConfig


@pytest.fixture
def task():
    return make_task("sum_digits", SumDigitsConfig(num_terms=2, digits=1, format_weight=0.5, eval_size=16))


def test_reward_pays_for_the_tagged_answer_not_a_bare_number(task):
    assert task.reward("3 + 4 = 7. Answer: 7", "7") == (1.5, {"correct": 1.0, "format": 1.0, "last_number": 1.0})
    assert task.reward("**Answer:** 7", "7") == (1.5, {"correct": 1.0, "format": 1.0, "last_number": 1.0})
    # the format alone earns format_weight; a wrong tagged number is not correct
    assert task.reward("Answer: 8", "7") == (0.5, {"correct": 0.0, "format": 1.0, "last_number": 0.0})
    # untagged: a right last number is checked, but earns nothing
    assert task.reward("3 + 4 is 7", "7") == (0.0, {"correct": 0.0, "format": 0.0, "last_number": 1.0})
    assert task.reward("7 is not 3 + 4", "7") == (0.0, {"correct": 0.0, "format": 0.0, "last_number": 0.0})
    assert task.reward("no idea", "7") == (0.0, {"correct": 0.0, "format": 0.0, "last_number": 0.0})
    # the last "Answer:" wins over earlier ones; the last number need not be the tagged one
    assert task.reward("Answer: 5. Answer: 7, not 9", "7") == (1.5, {"correct": 1.0, "format": 1.0,
                                                                     "last_number": 0.0})


def test_copied_is_a_wrong_tagged_answer_taken_from_the_question(task):
    def copied(prompt, answer, text):
        return task.prompt_checks(Sample(prompt, answer), text)["copied"]

    assert copied("Add 9 and 9.", "18", "Answer: 9") == 1.0  # the failure a stalled demo shows
    assert copied("Add 9 and 9.", "18", "Answer: 18") == 0.0  # right
    assert copied("Add 9 and 9.", "18", "Answer: 7") == 0.0  # wrong, but not from the question
    assert copied("What is 0 + 7?", "7", "Answer: 7") == 0.0  # a term that is also the sum is right
    assert copied("Add 9 and 9.", "18", "9") == 0.0  # untagged
    assert copied("What is 3 + 4?", "7", "Answer: 3. Answer: 7") == 0.0  # the last tagged answer counts
    assert copied("Add 12 and 5.", "17", "Answer: 1") == 0.0  # whole numbers, not digits


def terms_of(prompt: str) -> list[int]:
    return [int(t) for t in re.findall(r"\d+", prompt)]


def test_samples_are_deterministic_phrased_several_ways_and_answers_are_sums(task):
    assert task.train_sample(3) == task.train_sample(3)
    assert [task.train_sample(i) for i in range(20)] != [task.train_sample(i) for i in range(1, 21)]
    assert task.eval_samples() == task.eval_samples() and len(task.eval_samples()) == 16
    samples = task.eval_samples() + task.eval_samples("test") + [task.train_sample(i) for i in range(100)]
    wordings = [re.compile(re.escape(p).replace(r"\{sum\}", ".+").replace(r"\{terms\}", ".+")) for p in PHRASINGS]
    used = [next(i for i, w in enumerate(wordings) if w.fullmatch(s.prompt)) for s in samples]
    assert set(used) == set(range(len(PHRASINGS)))  # every wording appears (the last in test alone: test_splits.py)
    for sample in samples:
        assert "Answer:" in sample.prompt
        terms = terms_of(sample.prompt)
        assert len(terms) == 2 and all(0 <= t <= 9 for t in terms)
        assert sum(terms) == int(sample.answer)


def test_difficulty_is_configurable():
    task = make_task("sum_digits", SumDigitsConfig(num_terms=4, digits=2))
    terms = [terms_of(task.train_sample(i).prompt) for i in range(10)]
    assert all(len(t) == 4 and all(0 <= x <= 99 for x in t) for t in terms)
    assert any(x >= 10 for t in terms for x in t)  # two digits asked for: one digit would be <= 9


def test_unknown_task_and_bad_difficulty_are_errors():
    with pytest.raises(ValueError, match="unknown task"):
        make_task("nope", None)
    with pytest.raises(ValueError, match="num_terms"):
        make_task("sum_digits", SumDigitsConfig(num_terms=1))
