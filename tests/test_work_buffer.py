"""The work buffer's rules, one at a time (pure logic: no actors, no event loop)."""

import random

import pytest

from meshrl.types import Completion, ScoredCompletion
from meshrl.work_buffer import Batch, Filling, Group, TooManyFailures, WorkBuffer


def build(f: Filling) -> Batch:
    """A stand-in for episodes.batch_builder: its kept groups, each completion one episode at its version."""
    return Batch(f.index, sorted(f.kept), [s.completion.policy_version for _, g in sorted(f.kept.items()) for s in g],
                 {"equal": f.equal, "stale": f.stale, "failed": f.failed})


def group(index: int, version: int = 0, rewards=(1.0, 0.0)) -> Group:
    scored = [ScoredCompletion(Completion(index, [1], [2], [-1.0], "", version, "stop"), r) for r in rewards]
    return Group(index, scored, len(scored), 2 * len(scored), version)


def buffer(steps=3, size=2, age=0, **kw) -> WorkBuffer:
    kw.setdefault("ahead", age)  # generation free to run as far ahead as the bound allows (fifo's resolved value)
    return WorkBuffer(steps, size, age, build, **kw)


def starts(work: WorkBuffer, version: int) -> list[int]:
    out = []
    while (i := work.start(version)) is not None:
        out.append(i)
    return out


@pytest.mark.parametrize("age", [0, 1, 2])
def test_the_gate_lets_groups_run_at_most_max_policy_age_batches_ahead(age):
    work = buffer(steps=6, size=2, age=age)
    # at version 0, batches 0..age may start: two groups each
    assert starts(work, 0) == list(range(2 * (age + 1)))
    assert work.next_batch() == age + 1 and not work.may_start(0)
    for i in range(2):
        assert (work.finish(group(i)) is not None) == (i == 1)
    assert work.batch(0) is not None and starts(work, 0) == []  # still version 0: nothing more
    assert starts(work, 1) == [2 * (age + 1), 2 * (age + 1) + 1]  # version 1 opens one more batch


def test_generation_may_run_fewer_versions_ahead_than_the_bound_allows():
    """`ahead` 0 with a bound of 2: generation waits for each version as in sync training, and the two
    versions of room are the replay buffer's, for groups trained again."""
    work = buffer(steps=6, size=2, age=2, ahead=0)
    assert starts(work, 0) == [0, 1] and not work.may_start(0)  # batch 1 waits for version 1
    assert starts(work, 1) == [2, 3]
    assert work.finish(group(2, version=0)) is None and work.finish(group(3, version=0)).index == 1  # within 2


def test_each_group_is_trained_in_the_batch_it_was_admitted_into_whenever_it_finishes():
    work = buffer(size=2, age=1)
    assert starts(work, 0) == [0, 1, 2, 3]  # 0 and 1 into batch 0, 2 and 3 into batch 1
    assert work.finish(group(3)) is None
    assert work.finish(group(1)) is None  # batch 0 still waits for prompt 0
    later = work.finish(group(2))
    assert later.index == 1 and set(later.groups) == {2, 3}
    assert work.batch(0) is None and work.batch(1) is later and not work.may_start(0)
    batch = work.finish(group(0))
    assert batch.index == 0 and set(batch.groups) == {0, 1} and work.batch(0) is batch
    work.trained(0)
    assert work.batch(0) is None and starts(work, 1) == [4, 5]  # batch 2's slots


@pytest.mark.parametrize("age", [0, 1, 2])
@pytest.mark.parametrize("seed", range(5))
def test_no_group_is_born_stale_whatever_order_groups_finish_in(age, seed):
    # groups finish in a random order, each sampled from the version published when it started; batches
    # are trained as soon as they are complete. Joining whichever batch was filling when it finished, a
    # group that outlived a publish landed in a later batch, out of its bound: stale, regenerated.
    rng = random.Random(seed)
    work, version, sampled_from, trained = buffer(steps=8, size=2, age=age), 0, {}, []
    while not work.done():
        sampled_from |= {i: version for i in starts(work, version)}
        # the slot budget: at most age + 1 batches' groups running, none for a batch beyond the bound
        assert len(work.running) <= (age + 1) * 2 and all(b <= version + age for b in work.running.values())
        if (batch := work.batch(version)) is not None and rng.random() < 0.5:
            work.trained(version)
            trained.append(batch.index)
            version += 1
        elif work.running:
            index = rng.choice(sorted(work.running))
            work.finish(group(index, version=sampled_from[index]))
    assert work.totals["groups_stale"] == 0


def test_a_group_sampled_from_a_version_its_batch_does_not_allow_is_stale_and_starts_again_first():
    work = buffer(steps=4, size=1, age=0)
    assert starts(work, 0) == [0] and work.finish(group(0)).index == 0
    work.trained(0)
    assert starts(work, 1) == [1]
    # served from version 0 although version 1 was asked for (a generator's fault): outside batch 1's bound
    assert work.finish(group(1, version=0)) is None
    assert work.filling[1].stale == 1 and work.filling[1].stale_tokens == 4
    assert work.totals["groups_stale"] == 1 and work.redo == [1]
    assert starts(work, 1) == [1]  # the stale prompt first, into the same batch


def test_equal_reward_groups_are_kept_unless_dropped_and_dynamic_sampling_stops_after_tries():
    plain = buffer(size=2)
    starts(plain, 0)
    plain.finish(group(0, rewards=(1.0, 1.0)))
    batch = plain.finish(group(1))
    assert batch.stats["equal"] == 1 and set(batch.groups) == {0, 1}

    unscored = buffer(size=2)  # every reward function raised: failed (test_silent_failures.py), not trained
    starts(unscored, 0)
    assert unscored.finish(group(0, rewards=())) is None and unscored.filling[0].failed == 1
    assert starts(unscored, 0) == [2]  # its slot goes to another prompt
    unscored.finish(group(1))
    batch = unscored.finish(group(2))
    assert batch is not None and set(batch.groups) == {1, 2}

    dropping = buffer(size=2, tries=3, drop_equal=True)
    assert starts(dropping, 0) == [0, 1]
    assert dropping.finish(group(0, rewards=(1.0, 1.0))) is None
    assert starts(dropping, 0) == [2]  # a dropped group frees its place: another prompt starts
    assert dropping.finish(group(1)) is None
    batch = dropping.finish(group(2, rewards=(0.0, 0.0)))  # the third try: short of signal, trained as it is
    assert batch is not None and set(batch.groups) == {1} and batch.stats["equal"] == 2


def test_a_failed_group_is_counted_not_retried_and_too_many_stop_the_run():
    work = buffer(size=4, max_failed_fraction=0.5)
    assert starts(work, 0) == [0, 1, 2, 3]
    work.fail(2, "ValueError: too long")
    work.fail(3, "ValueError: also too long", tokens=5)  # its grading failed: its tokens are lost
    assert work.totals["groups_failed"] == 2 and work.redo == [] and work.filling[0].failed_tokens == 5
    assert starts(work, 0) == [4, 5]  # their places go to new prompts
    with pytest.raises(TooManyFailures, match=r"3 groups of batch 0 failed, more than controller.max_failed_fraction "
                                              r"\(0.5\) of its 4; the first: prompt 2: ValueError: too long"):
        work.fail(4, "ValueError: again")


def test_a_stopped_group_starts_again_before_new_prompts():
    work = buffer(size=3)
    assert starts(work, 0) == [0, 1, 2]
    work.stop(1)
    assert work.redo == [1] and starts(work, 0) == [1]


def test_a_snapshot_holds_what_is_not_trained_and_running_groups_as_to_redo():
    work = buffer(steps=3, size=2, age=1)
    starts(work, 0)  # 0, 1, 2, 3
    work.finish(group(0))
    work.finish(group(1))  # batch 0 complete, not trained
    work.finish(group(2))  # in batch 1, which is filling
    snap = work.snapshot()
    assert snap["next_prompt"] == 4 and snap["redo"] == [3] and list(snap["ready"]) == [0]
    assert list(snap["filling"]) == [1] and list(snap["filling"][1].kept) == [2] and not snap["filling"][1].running
    work.finish(group(3))  # the snapshot does not move with the buffer
    assert list(snap["filling"][1].kept) == [2]

    resumed = buffer(steps=5, size=2, age=1)  # a resume may train longer
    resumed.restore(snap)
    assert resumed.batch(0).index == 0 and resumed.running == {}
    assert starts(resumed, 0) == [3]  # the group that was running, then the gate: batch 1 is full with it
    assert starts(resumed, 1) == [4, 5]


def test_handing_over_a_batch_outside_the_bound_is_an_error():
    work = buffer(size=1, age=0)
    starts(work, 0)
    work.ready[0] = Batch(0, [0], [1], {})  # an episode from the future
    with pytest.raises(RuntimeError, match="outside the staleness bound"):
        work.batch(0)


def test_a_group_finishing_after_the_last_batch_is_kept_for_a_longer_run():
    work = buffer(steps=1, size=1, tries=1)
    assert starts(work, 0) == [0]
    work.finish(group(0, rewards=(1.0, 1.0)))
    assert work.done() and starts(work, 1) == []
    with pytest.raises(RuntimeError, match="was not running"):
        work.finish(group(0))


def test_groups_lost_with_the_replay_buffer_start_again_first_into_the_batches_they_left():
    """Batch 0 trained, batch 1 complete, batch 2 half kept with a group running: the replay buffer that held
    the untrained groups' episodes died. Their prompts start again first; batches 1 and 2 fill again, and
    the running group still finishes into batch 2."""
    work = buffer(steps=4, size=2, age=2)
    assert starts(work, 0) == [0, 1, 2, 3, 4, 5]
    for i in (0, 1, 2, 3, 4):
        work.finish(group(i))
    assert sorted(work.ready) == [0, 1] and work.complete_below == 2
    work.trained(0)
    assert work.lose() == 3  # batch 1's two groups and batch 2's kept one
    assert work.redo == [2, 3, 4] and not work.ready and work.complete_below == 1 and work.batch(1) is None
    assert starts(work, 1) == [2, 3, 4, 6, 7]  # batch 1's slots, batch 2's free one, then batch 3's
    assert work.running == {5: 2, 2: 1, 3: 1, 4: 2, 6: 3, 7: 3}
    for i in (2, 3, 4, 5):
        work.finish(group(i, version=1))
    assert work.batch(1).groups == [2, 3] and work.batch(2).groups == [4, 5] and work.totals["groups_stale"] == 0
