"""Pure logic: Episode construction and TrainBatch collation."""

import torch

from meshrl.rollout import build_episodes
from meshrl.types import Completion, ScoredCompletion, TrainBatch


def scored(reward, prompt=(1, 2), tokens=(3, 4), logprobs=(-0.5, -0.25), version=3):
    c = Completion(0, list(prompt), list(tokens), list(logprobs), "text", version, "stop")
    return ScoredCompletion(c, reward, {"correct": reward})


def test_build_episodes_masks_prompt_and_aligns_logprobs():
    episodes = build_episodes([scored(1.0), scored(0.0, tokens=(5,), logprobs=(-2.0,))], group_id=7, eps=0.0)
    first, second = episodes
    assert first.tokens == [1, 2, 3, 4]
    assert first.loss_mask == [False, False, True, True]
    assert first.behaviour_logprobs == [0.0, 0.0, -0.5, -0.25]
    assert (first.advantage, second.advantage) == (1.0, -1.0)
    assert first.policy_version == 3 and first.group_id == 7
    assert second.tokens == [1, 2, 5] and second.num_response_tokens == 1


def test_collate_shifts_targets_and_pads():
    episodes = build_episodes([scored(1.0), scored(0.0, tokens=(5,), logprobs=(-2.0,))], group_id=0, eps=0.0)
    batch = TrainBatch.collate(episodes, loss_tokens=3, loss_sequences=2, pad_id=9)
    assert batch.input_ids.tolist() == [[1, 2, 3], [1, 2, 9]]
    assert batch.target_ids.tolist() == [[2, 3, 4], [2, 5, 9]]
    # the logits at position t predict token t+1: the loss covers the positions predicting responses
    assert batch.loss_mask.tolist() == [[False, True, True], [False, True, False]]
    assert torch.equal(batch.behaviour_logprobs, torch.tensor([[0.0, -0.5, -0.25], [0.0, -2.0, 0.0]]))
    assert batch.advantages.tolist() == [1.0, -1.0] and (batch.loss_tokens, batch.loss_sequences) == (3, 2)


def test_check_rates_average_each_check_and_count_unscored_completions_as_zero():
    from meshrl.rollout import check_rates

    a = ScoredCompletion(scored(1.5).completion, 1.5, {"correct": 1.0, "format": 1.0})
    b = ScoredCompletion(scored(0.0).completion, 0.0, {"correct": 0.0, "format": 1.0})
    assert check_rates([a, b], 2, prefix="eval_") == {"eval_accuracy": 0.5, "eval_format": 1.0}
    assert check_rates([a, b], 4, prefix="") == {"accuracy": 0.25, "format": 0.5}  # two whose reward raised
    rates = check_rates([], 0, prefix="")
    assert list(rates) == ["accuracy"] and rates["accuracy"] != rates["accuracy"]  # NaN: nothing scored


def test_a_batch_fills_in_the_order_groups_finish_and_never_overfills():
    from meshrl.rollout import Filling, Group

    def group(index, *rewards):
        return Group(index, [scored(r) for r in rewards], completions=2, tokens=8, policy_version=0,
                     launched=0.0, gen_start=0.0, gen_end=1.0, pull_time_s=0.0)

    batch = Filling()
    # dynamic sampling: groups with signal are kept, equal-reward and failed (empty) groups are not
    finished = [group(3, 1.0, 0.0), group(1, 0.0, 0.0), group(2), group(0, 0.5, 0.0)]
    assert [batch.add(g, size=3, tries=12, drop_equal=True) for g in finished] == [False] * 4
    assert list(batch.kept) == [3, 0] and batch.equal == 1 and len(batch.groups) == 4
    assert batch.add(group(5, 0.0, 1.0), size=3, tries=12, drop_equal=True)  # full: three kept
    assert list(batch.kept) == [3, 0, 5]

    # without it the first `size` groups to finish are the batch, an equal-reward one included
    plain = Filling()
    assert [plain.add(g, size=3, tries=3, drop_equal=False) for g in finished[:3]] == [False, False, True]
    assert list(plain.kept) == [3, 1] and plain.equal == 1  # the failed group is tried, not trained

    # a batch short of signal after `tries` groups trains on what it has
    short = Filling()
    assert [short.add(group(i, 1.0, 1.0), size=2, tries=3, drop_equal=True) for i in range(3)] == [False, False, True]
    assert short.kept == {} and short.equal == 3
