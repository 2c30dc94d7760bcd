"""reasoning-gym tasks: datasets by name and weight, seeded samples with an eval split of its own, the
dataset's own scorer behind the answer tags, clear errors for names and settings. The smoke run on a
mix of two datasets is tests/test_judge.py's (one real run for both)."""

import collections
import json

import pytest

from meshrl.tasks.reasoning_gym import ReasoningGym, ReasoningGymConfig


def task(**settings) -> ReasoningGym:
    return ReasoningGym(ReasoningGymConfig(**settings))


def test_a_weighted_mix_samples_each_dataset_by_weight_the_same_way_every_time():
    mix = task(datasets="chain_sum:3, leg_counting:1", eval_size=40)
    names = collections.Counter(mix.train_sample(i).info["dataset"] for i in range(400))
    assert set(names) == {"chain_sum", "leg_counting"} and 250 < names["chain_sum"] < 350
    again = task(datasets="chain_sum:3, leg_counting:1", eval_size=40)
    assert [again.train_sample(i) for i in range(20)] == [mix.train_sample(i) for i in range(20)]
    assert task(datasets="chain_sum:3,leg_counting:1", seed=1).train_sample(0) != mix.train_sample(0)
    held_out = {s.prompt for s in mix.eval_samples()}
    assert len(held_out) == 40 and not held_out & {mix.train_sample(i).prompt for i in range(400)}
    assert all(s.prompt.endswith("\n\nGive your final answer between <answer> and </answer> tags.")
               for s in mix.eval_samples())


def test_the_datasets_own_scorer_rewards_the_answer_in_the_last_tags():
    sums = task(datasets="chain_sum", format_weight=0.1)
    sample = sums.train_sample(3)
    right = json.loads(sample.answer)["answer"]
    assert sums.reward(f"Let me think. <answer>{right}</answer>", sample.answer) == (
        1.1, {"score": 1.0, "correct": 1.0, "format": 1.0, "correct/chain_sum": 1.0})
    assert sums.reward(f"<answer>{right}</answer> no: <answer>{int(right) + 1}</answer>", sample.answer)[1] == {
        "score": 0.0, "correct": 0.0, "format": 1.0, "correct/chain_sum": 0.0}
    assert sums.reward(f"The answer is {right}.", sample.answer) == (
        0.0, {"score": 0.0, "correct": 0.0, "format": 0.0, "correct/chain_sum": 0.0})
    for echo in ("I give it between <answer> and </answer> tags", "<answer> </answer>"):  # no answer in them
        assert sums.reward(echo, sample.answer)[1]["format"] == 0.0


def test_the_answer_line_format_takes_the_rest_of_the_last_answer_line():
    sums = task(datasets="chain_sum", answer_format="line", format_weight=0.1)
    sample = sums.train_sample(3)
    right = json.loads(sample.answer)["answer"]
    assert sample.prompt.endswith("\n\nPut your final answer after 'Answer:'.")
    assert sums.reward(f"Answer: 0\nSo **Answer:** {right}.", sample.answer)[1]["correct"] == 1.0
    assert sums.reward(f"{right}", sample.answer)[1] == {
        "score": 0.0, "correct": 0.0, "format": 0.0, "correct/chain_sum": 0.0}
    assert sums.reward("I put it after 'Answer:'.", sample.answer)[1]["format"] == 0.0  # the instruction echoed
    with pytest.raises(ValueError, match="answer_format must be one of tags, line, not 'xml'"):
        task(answer_format="xml")


def test_each_datasets_settings_are_passed_to_it():
    two_terms = task(datasets="chain_sum", dataset_args='{"chain_sum": {"min_terms": 2, "max_terms": 2}}')
    for i in range(10):
        question = two_terms.train_sample(i).prompt.split("\n")[0]
        assert question.count("+") + question.count(" - ") == 1, question


@pytest.mark.parametrize("settings, message", [
    ({"datasets": "countdwn:1"}, "unknown reasoning_gym dataset 'countdwn'; did you mean countdown"),
    ({"datasets": "chain_sum:x"}, "weight of chain_sum is not a number: 'x'"),
    ({"datasets": "chain_sum:0"}, "weight of chain_sum must be > 0"),
    ({"datasets": " , "}, "names no dataset"),
    ({"dataset_args": "{nope"}, "dataset_args is not JSON"),
    ({"dataset_args": '{"countdown": {}}'}, r"names datasets not in the mix: \['countdown'\]"),
    ({"datasets": "chain_sum", "dataset_args": '{"chain_sum": {"max_trems": 2}}'},
     "reasoning_gym dataset chain_sum: bad settings"),
])
def test_bad_names_and_settings_are_one_clear_error(settings, message):
    with pytest.raises(ValueError, match=message):
        task(**settings)


def test_an_unknown_dataset_is_one_line_naming_the_closest(tmp_path, cli):
    # a mix of two datasets trains, reporting each one's accuracy, in tests/test_judge.py's smoke run
    code, _, err = cli("train", "--config", "smoke", "--run-dir", tmp_path / "bad", "--task", "reasoning_gym",
                       "--reasoning_gym.datasets", "chain_sum,leg_countin")
    assert code == 2 and not (tmp_path / "bad").exists()
    assert err.strip().splitlines() == [
        "meshrl: error: unknown reasoning_gym dataset 'leg_countin'; did you mean leg_counting, letter_counting, "
        "rectangle_count, countdown? (all 106: "
        "python -c 'import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))')"]


def test_the_demo_config_builds_its_task_with_the_answer_line():
    from meshrl.configs.named import load_config
    from meshrl.tasks import make_task, task_config

    config = load_config("reasoning_gym_smollm2", [])
    demo = make_task(config.task, task_config(config))
    first = demo.eval_samples()[0]
    assert first.info["dataset"] == "chain_sum" and first.prompt.endswith("Put your final answer after 'Answer:'.")
