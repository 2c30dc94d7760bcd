import pytest

from meshrl.tasks import make_task
from meshrl.tasks.sum_digits import SumDigitsConfig


@pytest.fixture
def task():
    return make_task("sum_digits", SumDigitsConfig(num_terms=2, digits=1, format_bonus=0.1, eval_size=16))


def test_reward_judges_tagged_answer_and_format(task):
    assert task.reward("3 + 4 = 7. Answer: 7", "7") == {"correct": 1.0, "format": 0.1}
    assert task.reward("Answer: 8", "7") == {"correct": 0.0, "format": 0.1}
    # untagged: the last number is the answer, with no format bonus
    assert task.reward("3 + 4 is 7", "7") == {"correct": 1.0, "format": 0.0}
    assert task.reward("7 is not 3 + 4", "7") == {"correct": 0.0, "format": 0.0}
    assert task.reward("no idea", "7") == {"correct": 0.0, "format": 0.0}
    # the last "Answer:" wins over earlier ones and over later untagged numbers
    assert task.reward("Answer: 5. Answer: 7, not 9", "7")["correct"] == 1.0


def test_samples_are_deterministic_and_answers_are_sums(task):
    assert task.train_sample(3) == task.train_sample(3)
    assert [task.train_sample(i) for i in range(20)] != [task.train_sample(i) for i in range(1, 21)]
    assert task.eval_samples() == task.eval_samples() and len(task.eval_samples()) == 16
    for sample in task.eval_samples() + [task.train_sample(i) for i in range(50)]:
        terms = sample.prompt.removeprefix("What is ").split("?")[0].split(" + ")
        assert len(terms) == 2 and all(0 <= int(t) <= 9 for t in terms)
        assert sum(map(int, terms)) == int(sample.answer)


def test_difficulty_is_configurable():
    task = make_task("sum_digits", SumDigitsConfig(num_terms=4, digits=2))
    terms = task.train_sample(0).prompt.removeprefix("What is ").split("?")[0].split(" + ")
    assert len(terms) == 4 and all(0 <= int(t) <= 99 for t in terms)


def test_unknown_task_and_bad_difficulty_are_errors():
    with pytest.raises(ValueError, match="unknown task"):
        make_task("nope", None)
    with pytest.raises(ValueError, match="num_terms"):
        make_task("sum_digits", SumDigitsConfig(num_terms=1))
