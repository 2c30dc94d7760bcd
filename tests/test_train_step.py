"""How a step's episodes become updates and micro-batches (pure logic; the real trainer runs them in
test_decoupled_ratio.py), and token-budget micro-batches checked against fixed counts on the real
model and loss, in process."""

import asyncio

import pytest
import torch
from rounding import assert_within, rounding_bound

from meshrl.actors.distributed import each_micro_batch
from meshrl.actors.timeouts import Timeout
from meshrl.actors.weight_updates import absorb, no_figures
from meshrl.train_step import dealt, micro_batches, micro_groups, padding_fraction, per_micro_batch, publish_figures, split
from meshrl.types import BatchRef, Episode, TrainBatch


def collated(episodes, size, max_tokens=0):
    """The micro-batches the replay buffer hands a rank (meshrl/actors/replay_buffer.py's sample, then its fetch)."""
    return [TrainBatch.collate(*micro, 0) for micro in micro_batches(episodes, size, max_tokens)]


def test_split_gives_nearly_equal_consecutive_mini_batches():
    assert split(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert split(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]
    assert split(list(range(7)), 1) == [list(range(7))]
    assert split([0, 1], 4) == [[0], [1]]  # never an empty update while there are episodes
    assert split([], 3) == [[]]  # nothing to train: one (empty) update, so the step still happens


def test_micro_batches_normalise_by_their_whole_mini_batch():
    episodes = [Episode([1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], 1.0, 0, 0),
                Episode([1, 2], [False, True], [0.0, -1.0], -1.0, 0, 0),
                Episode([4, 5, 6, 7], [False, False, True, True], [0.0, 0.0, -1.0, -1.0], 0.5, 0, 1)]
    batches = collated(episodes, size=2)
    assert [b.input_ids.shape[0] for b in batches] == [2, 1]
    assert all(b.loss_tokens == 5 and b.loss_sequences == 3 for b in batches)
    assert sum(int(b.loss_mask.sum()) for b in batches) == 5
    assert all(b.old_logprobs is None for b in batches)  # the first update's pi_old is its own forward


def episodes_of_lengths(lengths: list[int]) -> list[Episode]:
    """One episode per length: a 2-token prompt and the rest response, advantages alternating in sign."""
    return [Episode(tokens=[100 + 13 * i + t for t in range(n)], loss_mask=[False, False] + [True] * (n - 2),
                    behaviour_logprobs=[0.0, 0.0] + [-10.5 - 0.1 * t for t in range(n - 2)],
                    advantage=(-1.0) ** i * (0.5 + 0.1 * i), policy_version=0, group_id=i)
            for i, n in enumerate(lengths)]


def test_token_budget_micro_batches_group_neighbours_in_length_and_pad_less():
    episodes = episodes_of_lengths([40, 6, 38, 7, 5, 39, 8, 41])
    budget = collated(episodes, size=2, max_tokens=80)
    # longest first; a micro-batch takes sequences while count x its longest (positions) fits in 80
    assert [tuple(b.input_ids.shape) for b in budget] == [(2, 40), (2, 38), (4, 7)]
    assert all(b.input_ids.numel() <= 80 for b in budget)
    assert padding_fraction(episodes, micro_groups(episodes, 2, 80)) < 0.1 < padding_fraction(episodes,
                                                                                   micro_groups(episodes, 2))
    # every sequence and loss token once, with the whole mini-batch's normalisers
    assert sum(b.input_ids.shape[0] for b in budget) == 8
    assert sum(int(b.loss_mask.sum()) for b in budget) == sum(e.num_response_tokens for e in episodes)
    assert all(b.loss_tokens == budget[0].loss_tokens and b.loss_sequences == 8 for b in budget)
    # a sequence longer than the budget is a micro-batch of its own
    assert [b.input_ids.shape[0] for b in collated(episodes, 2, max_tokens=20)][:4] == [1, 1, 1, 1]


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_token_budget_micro_batches_give_the_same_loss_and_gradient_as_fixed_counts(aggregation):
    """The real model and loss (as the trainer's forward_backward computes them), in process."""
    from meshrl.losses import LossConfig, on_positions, policy_loss, response_logits, token_entropy, token_logprobs
    from meshrl.models.model import load_policy, resolve_checkpoint

    model, _ = load_policy(resolve_checkpoint("tiny"))
    config = LossConfig(aggregation=aggregation)
    episodes = episodes_of_lengths([12, 5, 11, 6, 4, 12, 7, 9])

    def loss_and_grads(batches):
        model.zero_grad()
        total = 0.0
        for batch in batches:
            logits = response_logits(model, batch)
            mask = batch.loss_mask
            entropy = on_positions(token_entropy(logits), mask)
            loss, _ = policy_loss(on_positions(token_logprobs(logits, batch.target_ids[mask]), mask), batch,
                                  config, entropy)
            loss.backward()
            total += loss.detach().item()
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}

    fixed = loss_and_grads(collated(episodes, size=3))
    budget = loss_and_grads(collated(episodes, size=3, max_tokens=24))
    model.double()  # the reference: the fixed counts in float64; each fp32 pass within fp32's rounding of it
    reference = loss_and_grads(collated(episodes, size=3))
    for result in (fixed, budget):
        assert_within(result, reference, rounding_bound("tiny"))
    assert any(g.abs().sum() > 0 for g in fixed[1].values())


def test_each_rank_gets_its_share_of_an_update_in_rounds_filled_with_idle_copies():
    refs = [BatchRef(0, 0, i) for i in range(5)]
    shares = dealt(refs, 2)
    assert [[r.micro for r in share] for share in shares] == [[0, 2, 4], [1, 3, 4]]
    assert [[r.idle for r in share] for share in shares] == [[False] * 3, [False, False, True]]
    assert dealt(refs[:1], 1) == [refs[:1]]
    assert per_micro_batch(Timeout(10.0, "trainer.timeout_s"), 3) == Timeout(30.0, "trainer.timeout_s")
    assert per_micro_batch(Timeout(0.0, "trainer.timeout_s"), 3).seconds == 0  # no limit stays none


def test_a_ranks_micro_batches_are_fetched_one_ahead_of_the_work_in_order():
    """each_micro_batch asks the buffer for the next micro-batch before working on this one, and answers in order."""
    events = []

    class FakeBuffer:  # the replay buffer's micro_batch endpoint, answering after one turn of the loop
        class micro_batch:
            @staticmethod
            async def call_one(ref):
                events.append(("fetch", ref.micro))
                await asyncio.sleep(0)
                return ref.micro * 10

    async def work(ref, batch):
        events.append(("work", ref.micro))
        await asyncio.sleep(0.01)
        events.append(("done", ref.micro))
        return batch + 1

    out = asyncio.run(each_micro_batch(FakeBuffer, [BatchRef(0, 0, i) for i in range(3)], work))
    assert out == [1, 11, 21]
    assert events == [("fetch", 0), ("work", 0), ("fetch", 1), ("done", 0), ("work", 1), ("fetch", 2), ("done", 1),
                      ("work", 2), ("done", 2)]


def test_a_versions_seconds_are_split_into_publish_transfer_and_load():
    """The trainer's side: a 2 s copy the next update waited 0.5 s for hid 3/4 of itself; one it waited for
    longer than it took (the update also waited on other work) hid nothing; an instant one hid all. The
    generators' side: the longest read of the rings and the longest load into the engine, each over the
    replicas' pulls (a pull in place reads nothing apart)."""
    assert publish_figures(2.0, 0.5) == {"weight_publish_s": 2.0, "weight_publish_hidden": 0.75}
    assert publish_figures(2.0, 3.0)["weight_publish_hidden"] == 0.0
    assert publish_figures(0.0, 0.0)["weight_publish_hidden"] == 1.0

    class Tracer:
        def add(self, *args):
            pass

    figures, counts = no_figures(), {}
    report = {"busy_s": 0.0, "pulls": [{"start": 10.0, "end": 13.0, "version": 1, "in_flight": False, "read_s": 2.5},
                                      {"start": 20.0, "end": 20.75, "version": 2, "in_flight": True, "read_s": 0.0}]}
    absorb(0, report, Tracer(), figures, counts)
    absorb(1, {"busy_s": 0.0, "pulls": [{"start": 5.0, "end": 6.0, "version": 1, "in_flight": False,
                                         "read_s": 0.25}]}, Tracer(), figures, counts)
    assert (figures["pull"], figures["transfer"], figures["load"]) == (3.0, 2.5, 0.75)
