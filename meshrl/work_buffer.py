"""The one owner of the batch and staleness rules: which prompt starts next, whether a group may
start now, what a finished group does to its batch, when a batch is complete, and what a checkpoint
must hold. Pure and synchronous (no actor calls, no asyncio), so every rule is tested in
microseconds and every await point of the loops around it sees a consistent state.

The rule: batch b trains at policy version b (step b + 1). A group started now helps fill the batch
`next_batch()`; it may start once version `next_batch() - max_policy_age` is published, and when it
finishes it joins the batch being filled if its policy version (the oldest it sampled from) is at
most `max_policy_age` behind that batch's; otherwise it is stale and its prompt is started again.
"""

import bisect
import copy
from dataclasses import dataclass, field
from typing import Callable

from meshrl.advantages import all_equal
from meshrl.types import Episode, ScoredCompletion


@dataclass
class Group:
    """One prompt's group as it came back from the generators and a grader (meshrl/rollout.py)."""

    prompt_index: int
    scored: list[ScoredCompletion]  # those whose reward function did not fail
    completions: int
    tokens: int
    policy_version: int  # its oldest sequence's version (a sequence's counted by controller.staleness)
    launched: float = 0.0  # tracer times (seconds since the run started)
    gen_start: float = 0.0
    gen_end: float = 0.0


@dataclass
class Filling:
    """The batch being filled: every group that finished into it, kept or not."""

    index: int
    kept: dict[int, list[ScoredCompletion]] = field(default_factory=dict)  # prompt index -> its group
    groups: list[Group] = field(default_factory=list)  # finished into it (kept, equal-reward dropped, no reward)
    equal: int = 0  # groups whose rewards were all equal: no learning signal
    stale: int = 0  # finished too late for this batch's bound: their prompts start again
    failed: int = 0  # a call of theirs raised: counted, not trained
    first_error: str = ""  # the first failed group's prompt and error


@dataclass
class Batch:
    """A complete batch, everything the step that trains it needs, as one object."""

    index: int  # trained by step index + 1, at policy version index
    episodes: list[Episode]
    stats: dict  # its rollout metrics (rewards, checks, group counts, times)
    records: list[dict]  # one per trained completion, for rollouts.jsonl


class TooManyFailures(RuntimeError):
    """More groups of one batch failed than `controller.max_failed_fraction` allows."""


@dataclass
class WorkBuffer:
    steps: int  # batches to fill: one per training step
    batch_size: int  # groups kept per batch (controller.prompts_per_step)
    max_policy_age: int
    build: Callable[[Filling], Batch]  # a complete Filling -> its Batch (meshrl/episodes.py)
    tries: int = 0  # groups finished into a batch at most (dynamic sampling); 0: batch_size
    drop_equal: bool = False  # groups whose rewards are all equal are not kept
    max_failed_fraction: float = 0.5  # more failed groups than this share of batch_size stop the run

    def __post_init__(self):
        self.tries = self.tries or self.batch_size
        self.next_prompt = 0  # the task's next training sample never started
        self.redo: list[int] = []  # prompts to start before new ones (stopped or stale groups), sorted
        self.running: set[int] = set()
        self.filling = Filling(0)
        self.ready: dict[int, Batch] = {}  # complete, not yet trained
        self.totals = {"groups_failed": 0, "groups_stale": 0}

    def next_batch(self) -> int:
        """The batch a group started now would help fill."""
        return self.filling.index + (len(self.filling.kept) + len(self.running)) // self.batch_size

    def may_start(self, trainer_version: int) -> bool:
        """The staleness gate: a group for batch b waits for version b - max_policy_age, and no batch
        past the last one gets groups."""
        batch = self.next_batch()
        return batch < self.steps and trainer_version >= batch - self.max_policy_age

    def start(self, trainer_version: int) -> int | None:
        """The prompt to start a group for now (one stopped or stale first), or None if the gate is shut."""
        if not self.may_start(trainer_version):
            return None
        if self.redo:
            index = self.redo.pop(0)
        else:
            index, self.next_prompt = self.next_prompt, self.next_prompt + 1
        self.running.add(index)
        return index

    def finish(self, group: Group) -> Batch | None:
        """A group finished: it joins the batch being filled, or is stale (its prompt starts again).
        Returns the batch it completed, if it did."""
        self._end(group.prompt_index)
        f = self.filling
        if f.index >= self.steps:  # every batch is complete: kept for a longer run
            bisect.insort(self.redo, group.prompt_index)
            return None
        if f.index - group.policy_version > self.max_policy_age:
            f.stale += 1
            self.totals["groups_stale"] += 1
            bisect.insort(self.redo, group.prompt_index)
            return None
        f.groups.append(group)
        no_signal = bool(group.scored) and all_equal([s.reward for s in group.scored])
        f.equal += no_signal
        if group.scored and not (no_signal and self.drop_equal):
            f.kept[group.prompt_index] = group.scored
        if len(f.kept) < self.batch_size and len(f.groups) < self.tries:
            return None
        batch = self.ready[f.index] = self.build(f)
        self.filling = Filling(f.index + 1)
        return batch

    def fail(self, prompt_index: int, error: str) -> None:
        """A group failed (a call of its own raised, not a replica dying): counted, not trained, not
        retried. TooManyFailures once more than `max_failed_fraction` of a batch's groups failed."""
        self._end(prompt_index)
        f = self.filling
        f.failed += 1
        self.totals["groups_failed"] += 1
        f.first_error = f.first_error or f"prompt {prompt_index}: {error}"
        if f.failed > self.max_failed_fraction * self.batch_size:
            raise TooManyFailures(f"{f.failed} groups of batch {f.index} failed, more than "
                                  f"controller.max_failed_fraction ({self.max_failed_fraction:g}) of its "
                                  f"{self.batch_size}; the first: {f.first_error}")

    def stop(self, prompt_index: int) -> None:
        """A group stopped before it finished: its prompt starts again, first."""
        self._end(prompt_index)
        bisect.insort(self.redo, prompt_index)

    def batch(self, index: int) -> Batch | None:
        """Batch `index` once complete. Handing it over checks the bound: every episode of batch b was
        sampled from a version in [b - max_policy_age, b]."""
        batch = self.ready.get(index)
        if batch is not None:
            versions = [e.policy_version for e in batch.episodes]
            if versions and not (index - self.max_policy_age <= min(versions) and max(versions) <= index):
                raise RuntimeError(f"batch {index} holds episodes of policy versions {min(versions)} to "
                                   f"{max(versions)}: outside the staleness bound ({self.max_policy_age})")
        return batch

    def trained(self, index: int) -> None:
        """Batch `index` is trained and logged: forget it."""
        del self.ready[index]

    def done(self) -> bool:
        """Every batch is complete."""
        return self.filling.index >= self.steps

    def snapshot(self) -> dict:
        """What `restore` needs to go on from here: groups still running count as stopped."""
        return {"next_prompt": self.next_prompt, "redo": sorted([*self.redo, *self.running]),
                "filling": copy.deepcopy(self.filling), "ready": dict(self.ready), "totals": dict(self.totals)}

    def restore(self, snapshot: dict) -> None:
        """The position a snapshot holds (nothing running), for a run of `self.steps` batches."""
        self.next_prompt, self.redo = snapshot["next_prompt"], list(snapshot["redo"])
        self.filling, self.ready = copy.deepcopy(snapshot["filling"]), dict(snapshot["ready"])
        self.totals, self.running = dict(snapshot["totals"]), set()

    def _end(self, prompt_index: int) -> None:
        if prompt_index not in self.running:
            raise RuntimeError(f"prompt {prompt_index} ended but was not running")
        self.running.remove(prompt_index)
