"""Pure logic: Episode construction, a batch's order, and TrainBatch collation."""

import torch

from meshrl.configs import ControllerConfig
from meshrl.episodes import build_episodes
from meshrl.tasks import Sample
from meshrl.types import Completion, Generated, ScoredCompletion, TrainBatch


def completion(prompt=(1, 2), tokens=(3, 4), logprobs=(-0.5, -0.25), version=3) -> Completion:
    """A Completion as its generator keeps it."""
    return Completion(0, list(prompt), list(tokens), list(logprobs), "text", version, "stop")


def scored(reward, **whole):
    """A scored completion as the controller has it: the generator's Generated (no tokens)."""
    return ScoredCompletion(Generated.of(0, completion(**whole)), reward, {"correct": reward})


def two_scored() -> tuple[list[ScoredCompletion], list[list[Completion]]]:
    """A group of two scored completions, and their sequences as the replay buffer holds them."""
    whole = [completion(), completion(tokens=(5,), logprobs=(-2.0,))]
    group = [ScoredCompletion(Generated.of(k, c), r, {"correct": r}) for k, (c, r) in enumerate(zip(whole, (1.0, 0.0)))]
    return group, [[c] for c in whole]


def test_build_episodes_masks_prompt_and_aligns_logprobs():
    group, sequences = two_scored()
    episodes = build_episodes(group, 7, ControllerConfig(advantage_eps=0.0), 1.0, sequences=sequences)
    first, second = episodes
    assert first.tokens == [1, 2, 3, 4]
    assert first.loss_mask == [False, False, True, True]
    assert first.behaviour_logprobs == [0.0, 0.0, -0.5, -0.25]
    assert (first.advantage, second.advantage) == (1.0, -1.0)
    assert first.policy_version == 3 and first.group_id == 7
    assert second.tokens == [1, 2, 5] and second.num_response_tokens == 1


def test_a_batch_trains_its_groups_in_prompt_order_whatever_order_they_finished_in():
    """Groups finish in an order timing decides; the trainer sums their gradients in the batch's order, so
    a rerun or a resume computes the same weights only if that order is the prompts'."""
    from meshrl.episodes import batch_builder, keep_group
    from meshrl.work_buffer import Filling, Group

    class Task:
        accuracy = "correct"

        def train_sample(self, index):
            return Sample(f"prompt {index}", "")

    # each group's episodes carry its prompt index as their version: the batch's versions show its order
    groups = {p: [scored(float(i), tokens=(p, i), version=p) for i in range(2)] for p in (4, 5, 9)}
    build = batch_builder(ControllerConfig(), lambda: 0.0)

    def filled(order):
        f = Filling(0)
        for p in order:
            f.kept[p] = keep_group(groups[p], p, ControllerConfig(), Task(), 1.0)[1]
            f.groups.append(Group(p, groups[p], 2, 4, 3))
        return build(f)

    first, second = filled([9, 5, 4]), filled([4, 9, 5])
    assert first.groups == [4, 5, 9] and first.versions == [4, 4, 5, 5, 9, 9]
    assert (first.groups, first.versions, first.stats) == (second.groups, second.versions, second.stats)


def test_collate_shifts_targets_and_pads():
    group, sequences = two_scored()
    episodes = build_episodes(group, 0, ControllerConfig(advantage_eps=0.0), 1.0, sequences=sequences)
    batch = TrainBatch.collate(episodes, loss_tokens=3, loss_sequences=2, pad_id=9)
    assert batch.input_ids.tolist() == [[1, 2, 3], [1, 2, 9]]
    assert batch.target_ids.tolist() == [[2, 3, 4], [2, 5, 9]]
    # the logits at position t predict token t+1: the loss covers the positions predicting responses
    assert batch.loss_mask.tolist() == [[False, True, True], [False, True, False]]
    assert torch.equal(batch.behaviour_logprobs, torch.tensor([[0.0, -0.5, -0.25], [0.0, -2.0, 0.0]]))
    assert batch.advantages.tolist() == [1.0, -1.0] and (batch.loss_tokens, batch.loss_sequences) == (3, 2)


def test_check_rates_average_each_check_and_count_unscored_completions_as_zero():
    from meshrl.episodes import check_rates

    a = ScoredCompletion(scored(1.5).completion, 1.5, {"correct": 1.0, "format": 1.0})
    b = ScoredCompletion(scored(0.0).completion, 0.0, {"correct": 0.0, "format": 1.0})
    a, b = a.reward_components, b.reward_components
    assert check_rates([a, b], 2, prefix="eval_") == {"eval_accuracy": 0.5, "eval_format": 1.0}
    assert check_rates([a, b], 4, prefix="") == {"accuracy": 0.25, "format": 0.5}  # two whose reward raised
    rates = check_rates([], 0, prefix="")
    assert list(rates) == ["accuracy"] and rates["accuracy"] != rates["accuracy"]  # NaN: nothing scored


def test_check_rates_of_a_part_of_the_task_average_over_the_completions_of_that_part():
    from meshrl.episodes import check_rates

    parts = [("sums", 1.0), ("sums", 0.0), ("sums", 1.0), ("countdown", 0.0)]  # a mix of two datasets
    done = [ScoredCompletion(scored(r).completion, r, {"correct": r, f"correct/{name}": r}) for name, r in parts]
    rates = check_rates([s.reward_components for s in done], 5, prefix="eval_")  # one more completion whose reward raised
    assert rates == {"eval_accuracy": 0.4, "eval_accuracy/sums": 2 / 3, "eval_accuracy/countdown": 0.0}


def test_the_eval_accuracys_interval_is_the_bootstrap_over_prompts():
    """By hand: items all alike have no spread; two items, one right, resample to means 0, 1/2 and 1 with
    chances 1/4, 1/2, 1/4, so the 2.5% and 97.5% quantiles are 0 and 1; 100 items half right give the
    binomial interval 0.5 +- 1.96 x 0.05 (normal approximation; the bootstrap's quantiles differ from it by
    about 1/sqrt(n) of its width, and by the resampling noise of 2000 draws: under 0.02 together). Seeded:
    the same values, the same interval."""
    import math

    from meshrl.episodes import bootstrap_interval

    assert bootstrap_interval([1.0] * 4) == (1.0, 1.0) and bootstrap_interval([0.0] * 7) == (0.0, 0.0)
    assert bootstrap_interval([0.0, 1.0]) == (0.0, 1.0)
    half = [1.0, 0.0] * 50
    low, high = bootstrap_interval(half)
    assert abs(low - (0.5 - 1.96 * 0.05)) < 0.02 and abs(high - (0.5 + 1.96 * 0.05)) < 0.02, (low, high)
    assert bootstrap_interval(half) == (low, high)
    assert all(math.isnan(x) for x in bootstrap_interval([]))
