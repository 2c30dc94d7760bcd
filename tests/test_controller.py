"""The controller's loops, collector, work buffer, replica pools and checkpoints, driven by fake actors
that follow the role contracts (tests/support/simulation.py): the staleness gate, batch counting, failures by kind,
and a stop at every await point of the loops followed by a resume. Milliseconds per run."""

import asyncio
import json
import logging
from collections import Counter

import pytest
from assertions import assert_each_group_trained_once, assert_staleness_bound, read_jsonl
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

from meshrl import checkpoint
from meshrl.actors.replicas import RoleFailed
from meshrl.work_buffer import TooManyFailures, WorkBuffer
from support.simulation import Costs, FakeTrainer, Script, fake_config, run_fake


def run(config, run_dir, script=None, **kw):
    return asyncio.run(run_fake(config, run_dir, script, **kw))


@pytest.mark.parametrize("age", [0, 1, 2])
def test_episodes_are_never_older_than_max_policy_age_and_async_runs_ahead(tmp_path, age):
    # a slow trainer: the generators would run far ahead if the gate let them
    script = Script(yields={"forward_backward": 20, "generate": 2})
    done = run(fake_config(steps=6, prompts=3, max_policy_age=age), tmp_path, script)
    assert [r["step"] for r in done.rows] == list(range(1, 7))
    # reaches the bound (async overlaps), never passes it
    assert_staleness_bound(done.rows, read_jsonl(tmp_path / "rollouts.jsonl"), age, reached=age > 0)
    assert_each_group_trained_once(done.trainer.trained, range(18), 2)  # every prompt once, none skipped


@pytest.mark.parametrize("age", [0, 1])
def test_a_publish_overlaps_the_next_steps_training_when_the_bound_allows(tmp_path, age):
    costs = Costs(generate_per_token=0.001, train_per_token=0.002, publish=0.05)
    done = run(fake_config(steps=4, prompts=2, max_policy_age=age), tmp_path, costs=costs)
    spans = read_jsonl(tmp_path / "trace.jsonl")
    on_actor = [s for s in spans if s["role"] == "trainer" and s["clock"] == "actor"]  # the fake trainer's own times
    publishes = [s for s in on_actor if s["what"] == "publish"]
    trains = [s for s in on_actor if s["what"] == "train"]
    overlapping = [p for p in publishes if any(p["start"] < t["start"] < p["end"] for t in trains)]
    assert len(publishes) == 4 and [p["policy_version"] for p in publishes] == [1, 2, 3, 4]
    assert [s["policy_version"] for s in spans if s["what"] == "publish" and s["clock"] == "controller"] == [1, 2, 3, 4]
    # async: the next step trains on the actor while the publish copies; sync: its batch needs the new version first
    assert bool(overlapping) == (age > 0)
    assert [r["policy_version"] for r in done.rows] == [1, 2, 3, 4] and done.controller.trainer_version == 4
    assert_staleness_bound(done.rows, read_jsonl(tmp_path / "rollouts.jsonl"), age)
    assert all(r["publish_wait_s"] < 0.05 for r in done.rows[:-1])  # the loop did not wait for the copies


@pytest.mark.parametrize("age", [0, 1])
def test_a_trainer_that_dies_without_a_way_back_ends_the_run_with_its_error(tmp_path, age):
    # the loop does not wait for the publish; a batch that needs its version must not wait forever either
    script = Script(die_at={"publish_weights": 2})
    with pytest.raises(SupervisionError, match="the process exited"):  # its publish, or the next call to it
        asyncio.run(asyncio.wait_for(run_fake(fake_config(steps=4, prompts=2, max_policy_age=age), tmp_path, script,
                                              restart=False), 30))


@pytest.mark.parametrize("age", [0, 1])
@pytest.mark.parametrize("call", ["forward_backward", "optim_step", "publish_weights", "save_state"])
def test_a_trainer_that_dies_at_any_call_is_restarted_and_trains_what_the_whole_run_did(tmp_path, age, call):
    """Restored from the newest checkpoint (or the initial policy), the batches logged since trained again,
    then the failed step again: the new trainer's updates are the whole run's from that checkpoint on, every
    step is logged once with continuous versions, and the restart is counted."""
    config = fake_config(steps=5, prompts=2, max_policy_age=age)
    config.checkpoint.every = 2
    whole = run(config, tmp_path / "whole")
    per_step = len(whole.trainer.trained) // 5
    calls = {"forward_backward": [1, 3, 5], "optim_step": [1, 3, 5], "publish_weights": [1, 3, 5],
             "save_state": [1, 3]}  # (the replay buffer's save_state calls come between the trainer's)
    for k in calls[call]:
        done = run(config, tmp_path / f"{k}", Script(die_at={call: k}))
        assert [r["step"] for r in done.rows] == [1, 2, 3, 4, 5], k
        assert [r["policy_version"] for r in done.rows] == [1, 2, 3, 4, 5], k
        assert done.rows[-1]["trainer_restarts"] == 1 and done.controller.trainer_version == 5, k
        replayed = len(done.trainer.trained)
        assert replayed % per_step == 0 and done.trainer.trained == whole.trainer.trained[-replayed:], k
        assert [r["tokens_trained"] for r in done.rows] == [r["tokens_trained"] for r in whole.rows], k
        restarts = [s for s in read_jsonl(tmp_path / f"{k}" / "trace.jsonl") if s["what"] == "restart"]
        assert len(restarts) == 1, k


@pytest.mark.parametrize("age", [0, 1])
def test_the_training_loop_sleeps_while_it_waits_for_a_batch(tmp_path, age, monkeypatch):
    # it once woke up again and again for a publish already done: a core spinning while generation ran
    looks = Counter()
    batch = WorkBuffer.batch

    def counted(self, index):
        looks[index] += 1
        return batch(self, index)
    monkeypatch.setattr(WorkBuffer, "batch", counted)
    costs = Costs(generate_per_token=0.004, train_per_token=0.0001, publish=0.001)  # ~0.1 s of generation a step
    done = run(fake_config(steps=4, prompts=2, max_policy_age=age), tmp_path, costs=costs)
    assert len(done.rows) == 4
    # a look when the wait starts, one per group that finishes or publish that ends, one when complete
    assert max(looks.values()) <= 8, looks


def test_sync_training_alternates_generation_and_training(tmp_path):
    calls = []

    class Watch(Script):
        async def point(self, endpoint, replica, args=()):
            calls.append(endpoint)
            await super().point(endpoint, replica, args)

    run(fake_config(steps=3, prompts=2, max_policy_age=0), tmp_path, Watch(yields={"generate": 3}))
    training = [c for c in calls if c in ("generate", "forward_backward", "publish_weights")]
    # each step: its batch's generate calls, then training; no generate call while a step trains
    phases = [c for i, c in enumerate(training) if i == 0 or c != training[i - 1]]
    assert phases[:7] == ["generate", "forward_backward", "publish_weights"] * 2 + ["generate"]


@pytest.mark.parametrize("age", [0, 1])
def test_synchronous_training_puts_every_replica_to_sleep_before_each_step_trains(tmp_path, age):
    """generator.engine.sleep: with max_policy_age 0 each step asks every replica to free its GPU memory once
    its batch is generated and before it trains; one step ahead the engines generate while the step trains."""
    calls = []

    class Watch(Script):
        async def point(self, endpoint, replica, args=()):
            calls.append(endpoint)
            await super().point(endpoint, replica, args)

    run(fake_config(steps=3, prompts=2, max_policy_age=age, replicas=2), tmp_path, Watch())
    if age:
        assert "sleep" not in calls
        return
    steps = [c for c in calls if c in ("sleep", "forward_backward")]
    phases = [c for i, c in enumerate(steps) if i == 0 or c != steps[i - 1]]
    assert phases == ["sleep", "forward_backward"] * 3 and calls.count("sleep") == 3 * 2
    assert calls.index("sleep") > calls.index("generate")


@pytest.mark.parametrize("drop", [False, True])
def test_equal_reward_groups_are_counted_and_with_dynamic_sampling_replaced_by_new_prompts(tmp_path, drop):
    config = fake_config(steps=3, prompts=2, drop_equal_reward_groups=drop, max_sample_rounds=4)
    done = run(config, tmp_path, Script(equal={1, 2, 5}))
    assert sum(r["equal_reward_groups"] for r in done.rows) == 3
    # the share of each step's scored groups (kept, and dropped for equal rewards) that carry a signal: by
    # hand, steps of prompts {0, 1}, {2, 3}, {4, 5}; dropping, {0, 1, 2, 3} (1 and 2 dropped), {4, 5, 6}, {7, 8}
    assert [r["groups_with_signal"] for r in done.rows] == pytest.approx([0.5, 2 / 3, 1.0] if drop else [0.5] * 3)
    if drop:  # not trained; other prompts fill their places, every batch full
        assert_each_group_trained_once(done.trainer.trained, [0, 3, 4, 6, 7, 8], 2)
        assert all(r["episodes"] == 4 for r in done.rows)
        assert [r["groups_dropped"] for r in done.rows] == [r["equal_reward_groups"] for r in done.rows]
        # generated, not trained: 2 completions of 3 tokens a dropped group
        assert [r["tokens_discarded"] for r in done.rows] == [6 * r["groups_dropped"] for r in done.rows]
        assert sum(r["tokens_discarded_dropped"] for r in done.rows) == 18
    else:  # trained with zero advantage
        assert_each_group_trained_once(done.trainer.trained, range(6), 2)
        assert all(r["groups_dropped"] == 0 for r in done.rows)
        assert all(r["tokens_discarded"] == 0 for r in done.rows)


def test_a_group_that_finishes_late_is_trained_in_its_own_batch_not_generated_again(tmp_path):
    # prompt 2 (batch 1's, sampled from version 0) finishes only once version 1 is out, after batch 2's
    # groups: joining whichever batch was filling, it landed in batch 2, two versions old, and was
    # generated again; in the slot it was admitted into it trains with batch 1, one version old
    done = run(fake_config(steps=5, prompts=2, max_policy_age=1), tmp_path, Script(late={2: 1}))
    assert all(r["groups_stale"] == 0 and r["tokens_discarded"] == 0 for r in done.rows)
    assert done.trainer.trained[1] == [2, 2, 3, 3]
    assert_each_group_trained_once(done.trainer.trained, range(10), 2)
    records = read_jsonl(tmp_path / "rollouts.jsonl")
    assert [(r["step"], r["staleness"]) for r in records if r["prompt_index"] == 2] == [(2, 1), (2, 1)]


def test_a_stale_groups_discard_arriving_after_its_prompts_next_try_was_staged_leaves_that_try_alone(tmp_path):
    # prompt 3 (batch 1, which trains at version 1) says it served version 0: stale, its staged sequences are let
    # go and the prompt is generated again at once. The discard waits for the buffer calls' flush (or behind an
    # add whose delivery takes 50 yields) while the new try is generated, graded and staged: its stage reaches
    # the buffer first. A discard naming the prompt alone deleted the new try's sequences, and the add of the new
    # try then failed ("never staged"); each try is staged apart, and the discard names its own
    script = Script(behind={3}, yields={"add": 50})
    done = run(fake_config(steps=3, prompts=2, max_policy_age=0), tmp_path, script)
    stages = [i for i, (endpoint, args) in enumerate(script.sent)
              if endpoint == "stage" and any(group == 3 for group, _, _ in args[0])]
    [discarded] = [i for i, (endpoint, args) in enumerate(script.sent)
                   if endpoint in ("add", "discard") and any(group == 3 for group, _ in args[-1])]
    assert len(stages) == 2 and stages[1] < discarded  # the next try's stage went first
    assert [r["groups_stale"] for r in done.rows] == [0, 1, 0] and done.rows[-1]["replay_buffer_restarts"] == 0
    assert_each_group_trained_once(done.trainer.trained, range(6), 2)


@pytest.mark.parametrize("rule", ["oldest_token", "newest_token"])
def test_a_group_spanning_versions_is_counted_from_its_oldest_or_newest_token(tmp_path, rule):
    # loaded in flight while prompt 2 generates: its tokens come from version 0, then version 1; the
    # records, the step's metrics and the bound all count it by the rule
    config = fake_config(steps=5, prompts=2, max_policy_age=1, staleness=rule)
    config.generator.weight_update = "in_flight"
    done = run(config, tmp_path, Script(late={2: 1}))
    late = [r for r in read_jsonl(tmp_path / "rollouts.jsonl") if r["prompt_index"] == 2]
    assert done.rows[-1]["weight_swaps_in_flight"] >= 1 and sum(r["tokens_after_swap"] for r in done.rows) > 0
    assert all(r["policy_version"] == 0 and r["versions"][0][0] == [0, 0] and r["versions"][0][-1][1] == 1
               for r in late)
    assert len(late) == 2 and {r["step"] for r in late} == {2}  # its group, trained once, in its batch
    counted = 0 if rule == "oldest_token" else 1
    assert {(r["counted_version"], r["staleness"]) for r in late} == {(counted, 1 - counted)}
    assert done.rows[1]["staleness_max"] == 1  # prompt 3, all from version 0, is in the same batch
    assert all(r["groups_stale"] == 0 for r in done.rows)


def test_a_group_whose_call_raises_fails_alone_and_the_run_goes_on(tmp_path, caplog):
    script = Script(reject={4})
    with caplog.at_level(logging.WARNING):
        done = run(fake_config(steps=4, prompts=3), tmp_path, script)
    assert [r["step"] for r in done.rows] == [1, 2, 3, 4]
    assert sum(r["groups_failed"] for r in done.rows) == 1
    assert done.rows[-1]["generator_restarts"] == 0 and done.spawned == [0, 1]  # no replica replaced
    assert_each_group_trained_once(done.trainer.trained, [p for p in range(13) if p != 4], 2)
    assert "the group of prompt 4 failed and is not trained" in caplog.text and "longer than" in caplog.text


def test_more_failed_groups_than_max_failed_fraction_stop_the_run_naming_the_first(tmp_path):
    with pytest.raises(TooManyFailures, match=r"groups of batch 1 failed.*the first: prompt 3: .*prompt 3 is longer"):
        run(fake_config(steps=4, prompts=2, max_failed_fraction=0.5), tmp_path, Script(reject={3, 4}))


def test_a_dead_replica_is_replaced_and_its_group_redone_elsewhere(tmp_path):
    done = run(fake_config(steps=4, prompts=3, max_policy_age=1), tmp_path, Script(die_at={"generate": 5}))
    assert done.rows[-1]["generator_restarts"] == 1 and done.rows[-1]["generator_calls_retried"] >= 1
    assert len(done.spawned) == 3  # two, and one replacement
    assert_each_group_trained_once(done.trainer.trained, range(12), 2)  # none lost, none twice
    assert all(r["groups_failed"] == 0 for r in done.rows)


def test_the_controllers_bytes_in_per_group_stay_the_same_however_long_the_completions(tmp_path):
    """No token passes through the controller: the answers it receives for a group (generate, score,
    stage) are as large for 512-token completions as for 8-token ones."""
    per_group, tokens = {}, {}
    for length in (8, 512):
        config = fake_config(steps=3, prompts=3, max_policy_age=1)
        config.generator.max_tokens = length
        done = run(config, tmp_path / str(length))
        per_group[length] = sum(r["controller_bytes_in"] for r in done.rows) / 9
        tokens[length] = sum(r["tokens_generated"] for r in done.rows)
    assert tokens[512] == 64 * tokens[8]
    # the same but for a few bytes: larger token ids and counts pickle longer (the fake's ids count up)
    assert 0 < per_group[512] <= 1.1 * per_group[8], per_group


@pytest.mark.parametrize("age", [0, 1])
def test_no_completion_is_left_held_by_a_generator_or_staged_in_the_buffer_at_the_end_of_a_run(tmp_path, age):
    """Every completion a generator keeps is taken by the replay buffer or let go: those of groups dropped
    (equal rewards, dynamic sampling), failed (rejected by vLLM), evaluated, and stopped at the end."""
    config = fake_config(steps=4, prompts=3, max_policy_age=age)
    config.controller.drop_equal_reward_groups = True
    done = run(config, tmp_path, Script(equal={1, 4}, reject={2}))
    assert sum(r["groups_dropped"] for r in done.rows) >= 2 and sum(r["groups_failed"] for r in done.rows) == 1
    generators = [a for r in done.controller.generators.replicas for a in r.actor.actors]
    assert [g.held.by_key for g in generators] == [{}] * len(generators)
    assert done.controller.buffer.actors[0].staged == {}


def test_a_grader_that_dies_at_the_grading_a_generator_sent_it_is_replaced_and_the_group_graded_on_another(tmp_path):
    # the generator finds its grader dead and says so in its answer: the controller replaces the grader and has
    # the group graded on the replacement (one grader), nothing generated again
    done = run(fake_config(steps=3, prompts=2), tmp_path, Script(die_at={"score": 3}))
    assert done.rows[-1]["grader_restarts"] == 1 and done.graders == [0, 0]
    assert done.rows[-1]["generator_restarts"] == 0 and done.spawned == [0, 1]
    assert all(r["groups_failed"] == 0 and r["groups_regenerated"] == 0 for r in done.rows)
    assert_each_group_trained_once(done.trainer.trained, range(6), 2)


def test_a_reward_function_that_raises_fails_its_group_and_its_grader_serves_on(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        done = run(fake_config(steps=3, prompts=2), tmp_path, Script(unscorable={2}))
    assert sum(r["groups_failed"] for r in done.rows) == 1
    assert done.rows[-1]["grader_restarts"] == 0 and done.graders == [0]
    assert_each_group_trained_once(done.trainer.trained, [p for p in range(7) if p != 2], 2)
    assert "the group of prompt 2 failed and is not trained" in caplog.text and "reward function raised" in caplog.text


def test_a_generator_that_dies_holding_a_groups_tokens_costs_the_group_which_is_generated_again(tmp_path):
    # a replica dies at the sixth time completions are taken from it (the buffer's stages, and the first eval's
    # two example prompts, whose replies are printed): what it held is lost
    config = fake_config(steps=4, prompts=3, max_policy_age=1)
    done = run(config, tmp_path, Script(die_at={"completions": 6}))
    regenerated = sum(r["groups_regenerated"] for r in done.rows)
    assert regenerated >= 1
    # each lost attempt's tokens (a group of 2 completions of max_tokens) were generated for their batch and
    # not trained: counted as such, and nothing else was discarded
    lost = regenerated * config.controller.group_size * config.generator.max_tokens
    assert sum(r["tokens_discarded_lost"] for r in done.rows) == lost
    assert all(r["tokens_discarded"] == r["tokens_discarded_lost"] for r in done.rows)
    assert done.rows[-1]["generator_restarts"] == 1
    assert all(r["groups_failed"] == 0 for r in done.rows)
    assert_each_group_trained_once(done.trainer.trained, range(12), 2)  # none lost, none twice


@pytest.mark.parametrize("endpoint, role", [("generate", "generator"), ("score", "grader")])
def test_a_call_that_hangs_is_timed_out_and_its_replica_replaced(tmp_path, endpoint, role):
    # one grader: its replacement's calls must not queue behind the call still parked on the hung one
    done = run(fake_config(steps=3, prompts=2), tmp_path, Script(hang_at={endpoint: 3}), call_timeout=0.2)
    assert done.rows[-1][f"{role}_restarts"] == 1
    assert (done.spawned if role == "generator" else done.graders) == ([0, 1, 0] if role == "generator" else [0, 0])
    assert_each_group_trained_once(done.trainer.trained, range(6), 2)


def full_run_calls(config, tmp_path) -> list[str]:
    script = Script()
    run(config, tmp_path / "whole", script)
    return script.calls


@pytest.mark.parametrize("age", [0, 1, 2])
def test_a_stop_at_every_await_point_then_a_resume_trains_every_prompt_exactly_once(tmp_path, age):
    config = fake_config(steps=4, prompts=3, max_policy_age=age)
    whole = full_run_calls(config, tmp_path)
    uninterrupted = [sorted(set(u)) for u in run(config, tmp_path / "again").trainer.trained]
    for k in range(1, len(whole) + 1):
        run_dir = tmp_path / f"stop-at-{k}"
        first = run(config, run_dir, Script(stop_at=k, yields={"generate": k % 3}))
        saved = checkpoint.latest(run_dir)
        assert first.controller.signals.stopped_by == "SIGINT"
        assert (saved is None) == (not first.rows), k  # a checkpoint of every step logged, if any was
        second = run(config, run_dir, resume=saved is not None)
        steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
        assert steps == [1, 2, 3, 4], (k, steps)  # every step logged once
        # every prompt trained once across the two halves, and none lost: the rest are still to do
        halves = first.trainer.trained[:len(first.rows)] + second.trainer.trained
        left = second.controller.work.snapshot()  # the prompts started and not trained: still to do
        assert_each_group_trained_once(halves, set(range(left["next_prompt"])) - set(left["redo"]), 2)
        records = read_jsonl(run_dir / "rollouts.jsonl")
        assert sorted({r["prompt_index"] for r in records}) == sorted({p for u in halves for p in u}), k
        assert_staleness_bound(read_jsonl(run_dir / "metrics.jsonl"), records, age)
        if age == 0:  # synchronous: each step trains the prompts it would have trained uninterrupted
            assert [sorted(set(u)) for u in halves] == uninterrupted, k


def test_replay_stopped_at_every_await_point_and_resumed_trains_no_group_more_than_max_reuse_times_again(tmp_path):
    """The replay buffer's groups and use counts are in each checkpoint: a resume goes on with them."""
    config = fake_config(steps=5, prompts=2, max_policy_age=1)
    config.replay_buffer.impl, config.replay_buffer.max_reuse = "replay", 1
    whole = full_run_calls(config, tmp_path)
    reused_whole = sum(r["episodes_reused"] for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl"))
    assert reused_whole > 0
    for k in range(1, len(whole) + 1, 2):
        run_dir = tmp_path / f"stop-at-{k}"
        first = run(config, run_dir, Script(stop_at=k, yields={"generate": k % 3}))
        saved = checkpoint.latest(run_dir)
        second = run(config, run_dir, resume=saved is not None)
        rows = read_jsonl(run_dir / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and [r["policy_version"] for r in rows] == [1, 2, 3, 4, 5]
        halves = first.trainer.trained[:len(first.rows)] + second.trainer.trained
        uses = Counter(p for update in halves for p in set(update))
        assert max(uses.values()) <= 2, (k, uses)  # once fresh, once again at most
        assert sum(r["episodes_reused"] for r in rows) > 0
        assert_staleness_bound(rows, read_jsonl(run_dir / "rollouts.jsonl"), 1, fifo=False)


def test_a_stop_whose_checkpoint_hangs_goes_on_without_it_after_stop_timeout(tmp_path, caplog):
    class HangingSave(Script):
        async def point(self, endpoint, replica, args=()):
            await super().point(endpoint, replica, args)
            if endpoint == "save_state":
                await asyncio.sleep(3600)

    config = fake_config(steps=100, prompts=2)
    script = HangingSave(stop_at=40)
    with caplog.at_level(logging.WARNING):
        done = run(config, tmp_path, script, stop_timeout=0.3)
    assert done.rows and checkpoint.latest(tmp_path) is None
    assert "the stop's checkpoint did not finish within 0.3 s (controller.stop_timeout_s)" in caplog.text


def test_a_stop_while_the_last_publish_outlives_stop_timeout_checkpoints_its_version(tmp_path, caplog):
    # the stop's wait for the last publish gives up after stop_timeout_s: the publish goes on (it is not
    # cancelled), and the checkpoint waits for it, bounded again, instead of awaiting a cancelled future
    class StopAtSecondPublish(Script):
        async def point(self, endpoint, replica, args=()):
            await super().point(endpoint, replica, args)
            if endpoint == "publish_weights" and self.counts[endpoint] == 2:
                self.signals.request("SIGINT")

    with caplog.at_level(logging.WARNING):
        done = run(fake_config(steps=100, prompts=2, max_policy_age=1), tmp_path, StopAtSecondPublish(),
                   stop_timeout=0.4, costs=Costs(publish=0.6))
    assert [r["step"] for r in done.rows] == [1, 2]
    assert "the last publish did not finish within 0.4 s" in caplog.text
    saved = json.loads((checkpoint.latest(tmp_path) / "checkpoint.json").read_text())
    assert saved["step"] == 2 and saved["policy_version"] == 2 and done.controller.trainer_version == 2


def test_the_fake_trainer_answers_with_the_real_loss_metrics():
    import torch

    from meshrl.losses import LossConfig, policy_loss
    from support.simulation import FakeWeights
    from meshrl.tools.checks.workloads import HeldBatches
    from meshrl.types import Episode, TrainBatch

    batch = TrainBatch.collate([Episode([1, 2, 3], [False, True, True], [0.0, -1.0, -2.0], 1.0, 0, 0)], 2, 1)
    real = policy_loss(batch.behaviour_logprobs.clone(), batch, LossConfig(), torch.zeros(1, 2))[1]
    trainer, held = FakeTrainer(FakeWeights()), HeldBatches()  # it takes the micro-batch by reference, as in a run
    trainer.buffer = held
    [fake] = asyncio.run(trainer.forward_backward([held.hold(batch)]))
    assert fake.keys() == real.keys() and fake["tokens"] == real["tokens"] == 2
    assert fake["behaviour_weight"] == real["behaviour_weight"] and fake["ratio"] == real["ratio"]


@pytest.mark.parametrize("age", [0, 1])
@pytest.mark.parametrize("call", ["stage", "add", "sample", "micro_batch", "trained"])
def test_a_replay_buffer_that_dies_is_restarted_empty_and_its_groups_are_generated_again(tmp_path, age, call):
    """The groups the dead buffer held for untrained batches start again and are trained in their batches:
    every prompt is trained exactly once, every step logged once, and a checkpoint is written at once (the
    log of the batches trained since the newest one died with the buffer)."""
    config = fake_config(steps=5, prompts=2, max_policy_age=age)
    for k in (1, 3, 4):
        run_dir = tmp_path / f"{k}"
        done = run(config, run_dir, Script(die_at={call: k}))
        assert [r["step"] for r in done.rows] == [1, 2, 3, 4, 5], k
        assert [r["policy_version"] for r in done.rows] == [1, 2, 3, 4, 5], k
        assert done.rows[-1]["replay_buffer_restarts"] == 1 and done.rows[-1]["trainer_restarts"] == 0, k
        assert_each_group_trained_once(done.trainer.trained, range(10), 2)  # each once, none lost
        assert_staleness_bound(done.rows, read_jsonl(run_dir / "rollouts.jsonl"), age)
        restarted_at = [s["policy_version"] for s in read_jsonl(run_dir / "trace.jsonl") if s["what"] == "restart"]
        assert len(restarted_at) == 1, k
        steps_saved = [p.name for p in (run_dir / "checkpoints").iterdir()]
        assert (f"step-{restarted_at[0]}" in steps_saved) == (restarted_at[0] > 0), (k, steps_saved)


def test_a_replay_buffer_that_dies_after_part_of_a_step_was_applied_ends_the_run_with_one_line(tmp_path):
    """Two updates a step: the buffer dies while the second fetches its micro-batch. The first update is
    applied and its batch died with the buffer, so the step cannot be trained again exactly."""
    config = fake_config(steps=3, prompts=2)
    config.trainer.mini_batches, config.trainer.micro_batch_size = 2, 2
    with pytest.raises(RoleFailed, match=r"after 1 of step 1's updates were applied, which cannot be undone.*--resume"):
        run(config, tmp_path, Script(die_at={"micro_batch": 3}))  # 1: pi_old of update 2; 2: update 1
