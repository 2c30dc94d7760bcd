"""The model-judged grader: its verdict read from the judge's first-token log-probabilities and rubric
checks. A smoke run with it as the grader (the embedded SmolLM2 as the judge, real actors and vLLM) is
test_train_smoke.py's judge run."""

import math

import pytest

from meshrl.actors.judge import RUBRIC, check_rubric, p_yes


def test_the_verdict_is_p_yes_against_no_over_the_first_tokens_alternatives():
    lp = math.log
    assert p_yes({" Yes": lp(0.6), "yes": lp(0.1), "No": lp(0.1), "Maybe": lp(0.2)}) == pytest.approx(0.875)
    assert p_yes({"no": lp(0.5), "The": lp(0.5)}) == 0.0
    assert p_yes({"The": lp(0.9), "A": lp(0.1)}) is None  # neither: the judge did not answer


def test_a_rubric_must_show_the_reply_and_name_only_known_fields():
    check_rubric(RUBRIC)
    check_rubric("Is this right? {reply} Say yes or no.")
    with pytest.raises(ValueError, match=r"must show the judge the \{reply\}"):
        check_rubric("Is {reference} the answer to {question}?")
    with pytest.raises(ValueError, match=r"only \{question\}, \{reference\} and \{reply\}"):
        check_rubric("{reply} vs {gold}")
