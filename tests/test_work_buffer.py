"""The work buffer's rules, one at a time (pure logic: no actors, no event loop)."""

import pytest

from meshrl.types import Completion, Episode, ScoredCompletion
from meshrl.work_buffer import Batch, Filling, Group, TooManyFailures, WorkBuffer


def build(f: Filling) -> Batch:
    """A stand-in for episodes.batch_builder: one episode per kept completion, at its group's version."""
    episodes = [Episode([1, 2], [False, True], [0.0, -1.0], 0.0, s.completion.policy_version, gid)
                for gid, group in f.kept.items() for s in group]
    return Batch(f.index, episodes, {"equal": f.equal, "stale": f.stale, "failed": f.failed}, [])


def group(index: int, version: int = 0, rewards=(1.0, 0.0)) -> Group:
    scored = [ScoredCompletion(Completion(index, [1], [2], [-1.0], "", version, "stop"), r) for r in rewards]
    return Group(index, scored, len(scored), 2 * len(scored), version)


def buffer(steps=3, size=2, age=0, **kw) -> WorkBuffer:
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


def test_groups_join_batches_in_the_order_they_finish_and_complete_them():
    work = buffer(size=2, age=1)
    assert starts(work, 0) == [0, 1, 2, 3]
    assert work.finish(group(3)) is None
    batch = work.finish(group(1))
    assert batch.index == 0 and {e.group_id for e in batch.episodes} == {3, 1}
    assert work.filling.index == 1 and work.batch(0) is batch
    work.trained(0)
    assert work.batch(0) is None


def test_a_stale_group_is_not_kept_and_its_prompt_starts_again_first():
    work = buffer(steps=4, size=1, age=1)
    assert starts(work, 0) == [0, 1]
    assert work.finish(group(1, version=0)).index == 0
    work.trained(0)
    assert starts(work, 1) == [2]
    assert work.finish(group(2, version=1)).index == 1  # batch 1 filled by a later prompt
    work.trained(1)
    # prompt 0 finishes late, sampled at version 0: for batch 2 that is 2 versions old
    assert work.finish(group(0, version=0)) is None
    assert work.filling.stale == 1 and work.totals["groups_stale"] == 1 and work.redo == [0]
    assert starts(work, 2) == [0, 3]  # the stale prompt first


def test_equal_reward_groups_are_kept_unless_dropped_and_dynamic_sampling_stops_after_tries():
    plain = buffer(size=2)
    starts(plain, 0)
    plain.finish(group(0, rewards=(1.0, 1.0)))
    batch = plain.finish(group(1))
    assert batch.stats["equal"] == 1 and {e.group_id for e in batch.episodes} == {0, 1}

    unscored = buffer(size=2)  # every reward function raised: tried, not trained
    starts(unscored, 0)
    unscored.finish(group(0, rewards=()))
    batch = unscored.finish(group(1))
    assert batch is not None and {e.group_id for e in batch.episodes} == {1}

    dropping = buffer(size=2, tries=3, drop_equal=True)
    assert starts(dropping, 0) == [0, 1]
    assert dropping.finish(group(0, rewards=(1.0, 1.0))) is None
    assert starts(dropping, 0) == [2]  # a dropped group frees its place: another prompt starts
    assert dropping.finish(group(1)) is None
    batch = dropping.finish(group(2, rewards=(0.0, 0.0)))  # the third try: short of signal, trained as it is
    assert batch is not None and {e.group_id for e in batch.episodes} == {1} and batch.stats["equal"] == 2


def test_a_failed_group_is_counted_not_retried_and_too_many_stop_the_run():
    work = buffer(size=4, max_failed_fraction=0.5)
    assert starts(work, 0) == [0, 1, 2, 3]
    work.fail(2, "ValueError: too long")
    work.fail(3, "ValueError: also too long")
    assert work.totals["groups_failed"] == 2 and work.redo == []
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
    assert list(snap["filling"].kept) == [2]
    work.finish(group(3))  # the snapshot does not move with the buffer
    assert list(snap["filling"].kept) == [2]

    resumed = buffer(steps=5, size=2, age=1)  # a resume may train longer
    resumed.restore(snap)
    assert resumed.batch(0).index == 0 and resumed.running == set()
    assert starts(resumed, 0) == [3]  # the group that was running, then the gate: batch 1 is full with it
    assert starts(resumed, 1) == [4, 5]


def test_handing_over_a_batch_outside_the_bound_is_an_error():
    work = buffer(size=1, age=0)
    starts(work, 0)
    work.ready[0] = Batch(0, [Episode([1, 2], [False, True], [0.0, 0.0], 0.0, 1, 0)], {}, [])  # from the future
    with pytest.raises(RuntimeError, match="outside the staleness bound"):
        work.batch(0)


def test_a_group_finishing_after_the_last_batch_is_kept_for_a_longer_run():
    work = buffer(steps=1, size=1, tries=1)
    assert starts(work, 0) == [0]
    work.finish(group(0, rewards=(1.0, 1.0)))
    assert work.done() and starts(work, 1) == []
    with pytest.raises(RuntimeError, match="was not running"):
        work.finish(group(0))
