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
    assert first.tokens.tolist() == [1, 2, 3, 4]
    assert first.loss_mask.tolist() == [False, False, True, True]
    assert first.behaviour_logprobs.tolist() == [0.0, 0.0, -0.5, -0.25]
    assert (first.advantage, second.advantage) == (1.0, -1.0)
    assert first.policy_version == 3 and first.group_id == 7
    assert second.tokens.tolist() == [1, 2, 5] and second.num_response_tokens == 1


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


def test_a_completions_tokens_travel_as_bytes_and_collate_to_what_the_lists_would():
    """Made from lists, a Completion holds arrays: pickled, its 1,000 tokens and logprobs are 4 bytes each plus a
    few hundred for the rest (a list's are 3 and 9 bytes, each its own object); collated, the arrays give the
    tensors torch makes of the lists (int64 ids; each float64 logprob rounded once to float32)."""
    import pickle
    import random

    rng = random.Random(0)
    ids, logprobs = [rng.randrange(2**31) for _ in range(1000)], [-rng.expovariate(1.0) for _ in range(1000)]
    c = Completion(0, [5, 6], ids, logprobs, "text", 0, "length")
    sent = pickle.dumps(c, protocol=5)
    assert len(sent) <= 8 * 1000 + 400
    back = pickle.loads(sent)
    assert (back.token_ids.typecode, back.logprobs.typecode) == ("i", "f") and back == c
    assert back.token_ids.tolist() == ids

    short = Completion(1, [5, 6], ids[:3], logprobs[:3], "text", 0, "stop")
    episodes = build_episodes([scored(1.0), scored(0.0)], 0, ControllerConfig(), 1.0, sequences=[[c], [short]])
    batch = TrainBatch.collate(episodes, loss_tokens=1003, loss_sequences=2, pad_id=7)
    assert torch.equal(batch.input_ids, torch.tensor([[5, 6, *ids[:-1]], [5, 6, *ids[:2], *[7] * 997]]))
    assert torch.equal(batch.target_ids, torch.tensor([[6, *ids], [6, *ids[:3], *[7] * 997]]))
    assert torch.equal(batch.behaviour_logprobs, torch.tensor([[0.0, *logprobs], [0.0, *logprobs[:3], *[0.0] * 997]],
                                                              dtype=torch.float32))
    assert batch.loss_mask.sum(1).tolist() == [1000, 3] and episodes[1].num_response_tokens == 3


def test_a_takes_completions_pickle_as_a_few_columns_whatever_their_number_and_come_back_whole():
    """`Completions` (a generator's answer to the replay buffer's take): Monarch's pickler (cloudpickle's) calls
    back into Python once per object it reduces; for Completions that is the same handful for 10 or 1,000
    completions (a plain list: several more for each). Unpickled: the same Completions, versions and sums included."""
    import io
    import pickle

    import cloudpickle

    from meshrl.types import Completions

    made = [Completion(i, [1, 2, i], list(range(i % 7 + 1)), [-0.5] * (i % 7 + 1), f"reply {i}", i % 3,
                       "stop" if i % 2 else "length", [[0, 1], [2, 2]] if i % 5 == 0 else [], None if i % 4 else -1.5)
                  for i in range(1000)]

    def reductions(obj) -> int:
        calls = []

        class Counting(cloudpickle.Pickler):
            def reducer_override(self, o):
                calls.append(type(o))
                return super().reducer_override(o)

        Counting(io.BytesIO()).dump(obj)
        return len(calls)

    assert reductions(Completions(made[:10])) == reductions(Completions(made)) < 20
    assert reductions(made) >= 4 * len(made)  # a plain list: each Completion and its three arrays
    back = pickle.loads(cloudpickle.dumps(Completions(made)))
    assert type(back) is list and back == made
    assert back[5].versions == [[0, 1], [2, 2]] and back[5].logprob_sum is None and back[0].logprob_sum == -1.5


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
