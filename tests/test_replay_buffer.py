"""The replay buffer's rules, on the real actor classes run in this process behind the fakes' Monarch
handles (tests/support/fake_monarch.py): what each batch trains (fifo, replay), the staleness bound, the log of
batches handed out since the last checkpoint, and its state across a checkpoint. Then on a real buffer actor:
it takes a group's completions from the generator holding them, and serves the ranks' fetches at once."""

import asyncio
import os
import signal

import monarch.actor
import pytest
import torch
from assertions import assert_staleness_bound, read_jsonl
from fake_holder import FakeHolder

from meshrl.actors import spawn
from meshrl.actors.replay_buffer import FifoBuffer, ReuseBuffer
from meshrl.actors.replay_buffer_config import ReplayBufferConfig
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.types import BatchRef, Completion, GroupEpisodes
from support.fake_monarch import FakeMesh
from support.simulation import Script, fake_config, run_fake

TRAINER = TrainerConfig(micro_batch_size=2)


def completions(group: int, version: int, count: int, length: int = 2) -> list[Completion]:
    """A group's completions: each one's prompt is the group's id, its first token its index in the group."""
    return [Completion(group, [group], [i] + [7] * (length - 1), [-1.0] * length, "", version, "stop")
            for i in range(count)]


def episodes(group: int, version: int, count: int) -> GroupEpisodes:
    """A staged group's episodes as the controller adds them: one per sequence, advantages 0, 1, 2..."""
    return GroupEpisodes(group, [(i, 0, 1) for i in range(count)], [float(i) for i in range(count)],
                         [version] * count, [float(i) for i in range(count)], 1.0)


async def add(buf, batch: int, group: int, version: int, rewards=(1.0, 0.0)) -> None:
    """Group `group` (one episode per reward, its first token the group's id) staged from a fake generator
    holding it and added for batch `batch`, as the controller has the buffer do."""
    holder = FakeMesh([FakeHolder(completions(group, version, len(rewards)))], Script())
    assert await buf.stage.call_one([(group, 0, [[(0, i)] for i in range(len(rewards))])], [holder]) == [True]
    added = episodes(group, version, len(rewards))
    added.rewards = list(rewards)
    await buf.add.call_one(batch, [added])


def buffer(cls=FifoBuffer, prompts: int = 2, age: int = 1, **config) -> FakeMesh:
    return FakeMesh([cls(ReplayBufferConfig(**config), TRAINER, prompts, age, 0)], Script())


def run(coroutine):
    return asyncio.run(coroutine)


async def trained_groups(buf, batch: int, fresh: list[int]) -> tuple[dict, list[int]]:
    """Batch `batch`'s plan and the group of each sequence it trains, in order, as the ranks take them."""
    plan = await buf.sample.call_one(batch, fresh)
    firsts = []
    for u, count in enumerate(plan["micro_batches"]):
        for m in range(count):
            firsts += (await buf.micro_batch.call_one(BatchRef(batch, u, m))).input_ids[:, 0].tolist()
    return plan, firsts


def test_fifo_trains_each_group_once_in_the_order_given_and_then_forgets_it():
    async def go():
        buf = buffer()
        for g in (3, 1):
            await add(buf, 0, g, 0, (1.0, 0.0))
        await add(buf, 1, 5, 0, (1.0, 0.0))
        plan, firsts = await trained_groups(buf, 0, [1, 3])
        assert firsts == [1, 1, 3, 3] and plan["micro_batches"] == [2]
        # four sequences, each a 1-token prompt and a 2-token response: the loss is over the responses
        assert (plan["episodes_trained"], plan["episodes_reused"], plan["tokens_trained"], plan["tokens_processed"]
                ) == (4, 0, 8, 12)
        await buf.trained.call_one(0, 1)
        assert set(buf.actors[0].groups) == {5}  # 1 and 3 trained: gone
        plan, firsts = await trained_groups(buf, 1, [5])
        assert firsts == [5, 5] and plan["staleness_max"] == 1 and plan["episodes_by_age"] == [0, 2]
    run(go())


def test_an_episode_outside_the_bound_is_never_handed_out():
    async def go():
        buf = buffer(age=1)
        await add(buf, 2, 0, 0, (1.0, 0.0))  # version 0 for batch 2: age 2 > 1
        with pytest.raises(Exception, match="outside the staleness bound"):
            await buf.sample.call_one(2, [0])
    run(go())


def test_a_round_short_of_micro_batches_gets_an_idle_copy_that_trains_nothing():
    async def go():
        buf = buffer()
        await add(buf, 0, 0, 0, (1.0, 0.0))
        await buf.sample.call_one(0, [0])
        busy = await buf.micro_batch.call_one(BatchRef(0, 0, 0))
        idle = await buf.micro_batch.call_one(BatchRef(0, 0, 0, idle=True))
        assert busy.loss_mask.any() and not idle.loss_mask.any() and torch.equal(busy.input_ids, idle.input_ids)
    run(go())


async def one_trained_one_waiting():
    """A replay buffer (2 prompts a batch, half fresh) whose batch 0 (group 0) is trained and group 1 added."""
    buf = buffer(ReuseBuffer, prompts=2, age=2, fresh_fraction=0.5)
    await add(buf, 0, 0, 0, (1.0, 0.0))
    await buf.sample.call_one(0, [0])
    await buf.trained.call_one(0, 1)
    await add(buf, 1, 1, 1, (1.0, 0.0))
    return buf


def test_a_logged_batch_is_handed_out_again_exactly_until_a_checkpoint_holds_its_step():
    async def go():
        buf = await one_trained_one_waiting()
        first = await buf.sample.call_one(1, [1])
        micro = [await buf.micro_batch.call_one(BatchRef(1, 0, m)) for m in range(first["micro_batches"][0])]
        await buf.attach.call_one(BatchRef(1, 0, 0, into="old_logprobs"), torch.zeros(2, 2))
        await buf.trained.call_one(1, 2)  # group 0's second use: more than max_reuse 1 would allow again
        assert await buf.logged.call_one() == [0, 1]
        again = await buf.sample.call_one(1, [1])  # as a restarted trainer would ask
        assert again == first and first["episodes_reused"] == 2
        for m, before in enumerate(micro):
            after = await buf.micro_batch.call_one(BatchRef(1, 0, m))
            for name in ("input_ids", "target_ids", "loss_mask", "behaviour_logprobs", "advantages"):
                assert torch.equal(getattr(before, name), getattr(after, name)), name
        uses = {g: stored.uses for g, stored in buf.actors[0].groups.items()}
        await buf.trained.call_one(1, 2)  # trained again by a restarted trainer: no new use is counted
        assert {g: stored.uses for g, stored in buf.actors[0].groups.items()} == uses
        await buf.checkpointed.call_one(2)  # steps 1 and 2 (batches 0 and 1) are in a checkpoint
        assert await buf.logged.call_one() == []
    run(go())


def test_replay_fills_a_batch_with_old_groups_by_reward_spread_within_the_bound_and_max_reuse():
    async def go():
        buf = buffer(ReuseBuffer, prompts=3, age=2, max_reuse=1, fresh_fraction=0.34)
        await add(buf, 0, 0, 0, (1.0, 0.0))  # spread 0.5
        await add(buf, 0, 1, 0, (1.0, 1.0))  # no signal
        await add(buf, 0, 2, 0, (0.6, 0.0))  # spread 0.3
        plan, firsts = await trained_groups(buf, 0, [0, 1, 2])
        assert plan["episodes_reused"] == 0
        await buf.trained.call_one(0, 1)
        await add(buf, 1, 3, 1, (1.0, 0.0))
        plan, firsts = await trained_groups(buf, 1, [3])  # two old groups: the widest spreads, 0 and 2
        assert firsts == [3, 3, 0, 0, 2, 2] and (plan["episodes_reused"], plan["groups_reused"]) == (4, 2)
        await buf.trained.call_one(1, 2)  # 0 and 2 were trained again once: max_reuse 1, gone
        assert set(buf.actors[0].groups) == {1, 3}
        await add(buf, 2, 4, 2, (1.0, 0.0))
        plan, firsts = await trained_groups(buf, 2, [4])
        assert firsts == [4, 4, 1, 1, 3, 3] and plan["episodes_by_age"] == [2, 2, 2]
        await buf.trained.call_one(2, 3)
        await add(buf, 3, 5, 3, (1.0, 0.0))
        plan, firsts = await trained_groups(buf, 3, [5])  # 1 (version 0) is past the bound; 3 used up
        assert firsts == [5, 5, 4, 4]
    run(go())


def test_the_state_a_checkpoint_holds_brings_back_the_same_groups_and_use_counts(tmp_path):
    async def go():
        buf = await one_trained_one_waiting()
        await buf.save_state.call_one(str(tmp_path / "replay_buffer"))
        restored = buffer(ReuseBuffer, prompts=2, age=2, fresh_fraction=0.5)
        assert await restored.load_state.call_one(str(tmp_path / "replay_buffer")) == 2
        assert restored.actors[0].groups == buf.actors[0].groups
        assert await trained_groups(restored, 1, [1]) == await trained_groups(buf, 1, [1])
    run(go())


@pytest.mark.parametrize("impl", ["fifo", "replay"])
def test_the_controller_sends_the_trainer_only_references_to_micro_batches_in_the_buffer(tmp_path, impl):
    config = fake_config(steps=4, prompts=2, max_policy_age=1)
    config.replay_buffer.impl = impl
    config.trainer.mini_batches = 2  # pi_old calls too
    done = run(run_fake(config, tmp_path, Script()))
    assert set(done.trainer.received) == {"BatchRef"}  # no TrainBatch: no token tensor from the controller
    reused = [r["episodes_reused"] for r in done.rows]
    assert sum(reused) > 0 if impl == "replay" else sum(reused) == 0
    assert_staleness_bound(done.rows, read_jsonl(tmp_path / "rollouts.jsonl"), 1, fifo=impl == "fifo")
    assert [r["step"] for r in done.rows] == [1, 2, 3, 4]


def test_with_generation_kept_in_step_replay_trains_an_old_group_beside_each_fresh_one(tmp_path):
    """controller.generate_ahead 0 keeps generation in step with training (as in sync training) while the
    bound (2) leaves room for groups trained again: every step after the first trains one of each."""
    config = fake_config(steps=5, prompts=2, max_policy_age=2, generate_ahead=0)
    config.replay_buffer.impl = "replay"
    rows = run(run_fake(config, tmp_path, Script())).rows
    assert [r["episodes_reused"] for r in rows] == [0, 2, 2, 2, 2]
    assert [r["episodes_by_age"] for r in rows] == [[2], [2, 2], [2, 2], [2, 2], [2, 2]]  # the newest old group


@pytest.mark.processes
def test_stage_takes_a_groups_completions_from_their_generator_and_answers_false_once_it_died(monkeypatch):
    """A real buffer actor takes a graded group's completions from the generator actor holding them (a fake
    one, holding given Completions), which then no longer holds them, and trains exactly those tokens; a
    group whose holder has died (its process killed) is not staged (False: the controller generates it again)."""
    monkeypatch.setattr(monarch.actor, "unhandled_fault_hook", lambda failure: None)  # the holder's death is expected
    held = completions(4, 0, 3, length=5)

    async def run():
        holder_procs, holder = spawn("holder", FakeHolder, held)
        buf_procs, buf = spawn("buffer", FifoBuffer, ReplayBufferConfig(), TrainerConfig(micro_batch_size=2), 1, 1, 0)
        try:
            [staged] = await buf.stage.call_one([(4, 0, [[(0, 0)], [(0, 2)]])], [holder])  # completion 1 not trained
            left = await holder.keys.call_one()
            await buf.add.call_one(0, [episodes(4, 0, 2)])
            await buf.sample.call_one(0, [4])
            micro = await buf.micro_batch.call_one(BatchRef(0, 0, 0))
            os.kill(await holder.pid.call_one(), signal.SIGKILL)
            [gone] = await asyncio.wait_for(buf.stage.call_one([(5, 0, [[(0, 1)]])], [holder]), timeout=120)
            return staged, left, micro, gone
        finally:
            await buf_procs.stop()
            await holder_procs.stop()

    staged, left, micro, gone = asyncio.run(run())
    assert staged and left == [1]  # the two staged went to the buffer; the generator forgot them
    tokens = [(c.prompt_token_ids + c.token_ids).tolist() for c in (held[0], held[2])]
    assert (micro.input_ids.tolist(), micro.target_ids.tolist()) == ([t[:-1] for t in tokens], [t[1:] for t in tokens])
    assert gone is False


@pytest.mark.processes
def test_two_ranks_fetches_of_a_batchs_micro_batches_are_served_at_once():
    """Two trainer ranks fetch their micro-batches of one batch at the same moment from a real buffer actor:
    `micro_batch` is a concurrent endpoint (each collated in a thread), so the buffer serves the second
    fetch while it still collates the first. Its own clock (`spans`) shows the two fetches overlapping; a
    plain `@endpoint` would run them one after the other. 2 x 256 sequences of 1,000 tokens: collating
    one takes a while."""
    held = completions(0, 0, 512, length=1000)

    async def run():
        holder_procs, holder = spawn("holder", FakeHolder, held)
        buf_procs, buf = spawn("buffer", FifoBuffer, ReplayBufferConfig(), TrainerConfig(micro_batch_size=256), 1, 1,
                               0)
        try:
            assert await buf.stage.call_one([(0, 0, [[(0, i)] for i in range(len(held))])], [holder]) == [True]
            await buf.add.call_one(0, [episodes(0, 0, len(held))])
            plan = await buf.sample.call_one(0, [0])
            await buf.spans.call_one()
            fetched = await asyncio.gather(*(buf.micro_batch.call_one(BatchRef(0, 0, m)) for m in range(2)))
            return plan, fetched, await buf.spans.call_one()
        finally:
            await asyncio.gather(holder_procs.stop(), buf_procs.stop())

    plan, fetched, spans = asyncio.run(run())
    assert plan["micro_batches"] == [2] and [m.input_ids.shape[0] for m in fetched] == [256, 256]
    assert [m.input_ids[:, 1].tolist() for m in fetched] == [list(range(256)), list(range(256, 512))]
    assert sorted(s["what"] for s in spans) == ["fetch 0.0", "fetch 0.1"]
    first, second = sorted(spans, key=lambda s: s["start"])
    assert second["start"] < first["end"], spans  # the second fetch began before the first one ended
