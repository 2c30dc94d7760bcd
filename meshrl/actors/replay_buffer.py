"""The replay buffer: the data plane between the generators and the trainer, on a process of its own.

A graded group's Completions come here from the generators holding them (`stage`, which the
controller asks for; the buffer takes them itself, concurrently with everything else). The controller
then says what to train (`add`, in batches of groups: which sequence and turns each episode trains,
its advantage and version, flattened into Episodes here) or lets the group go (`discard`), and keeps
only what its rules need (prompt, reward, version, length). When the work buffer says batch b is
complete, the controller asks for its plan (`sample`): the buffer composes the batch and its
micro-batches and answers only their count per optimizer update; the trainer's ranks (and the
reference's) then take each micro-batch from the buffer themselves, all at once (`micro_batch`, by a
`BatchRef`, a concurrent endpoint: each collated in a thread the first time it is asked for, every
fetch a span of the buffer's own clock) and put back what they compute for it (`attach`: pi_old, the
reference's logprobs). No token of a training batch passes through the controller, nor (single-turn) the
text of its completions: the buffer fills that text into a trained batch's records and writes them to
rollouts.jsonl (`trained`); a conversation's text, which the controller holds to drive it, comes in its record.

The state the concurrent endpoints share is guarded by the event loop itself: each touches it only
between awaits (a dict read or write), and a micro-batch is collated once (one future per micro-batch,
which every rank asking for it awaits).

The work buffer (meshrl/work_buffer.py) stays the one owner of admission and of the staleness bound;
this buffer asserts the bound for every episode it hands out. Two implementations, by
`replay_buffer.impl`:

- `fifo` (FifoBuffer): each group trained once, in the batch it was generated for.
- `replay` (ReuseBuffer): a batch trains its fresh groups (`fresh_fraction` of `prompts_per_step`)
  and fills the rest with groups trained before, while their version stays within the bound and up to
  `max_reuse` times again, those with the widest spread of rewards first (`priority reward_std`: a
  group whose rewards are all equal has no learning signal, and comes last), or the newest first
  (`priority newest`); ties go to the newer group, then the lower prompt index, so a rerun composes the
  same batches. The decoupled loss's behaviour weight already corrects for the older policy they were
  sampled from.

Every batch handed out is logged, in order, until a checkpoint holding its step has been written
(`checkpointed`); asked for again (`sample` of a logged batch), it is handed out exactly as the first
time. The state (groups waiting, their use counts) is saved with each checkpoint (`save_state`).
"""

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from monarch.actor import Actor, concurrent_endpoint, endpoint

from meshrl.actors import for_throughput, pin_cpus
from meshrl.actors.held import take_held
from meshrl.actors.replay_buffer_config import ReplayBufferConfig
from meshrl.actors.roles import TokensLost
from meshrl.actors.trace import ActorClock
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.advantages import population_std
from meshrl.episodes import RolloutRecorder, flatten
from meshrl.train_step import micro_batches, padding_fraction, split
from meshrl.types import BatchRef, Completion, Episode, GroupEpisodes, TrainBatch

logger = logging.getLogger(__name__)


@dataclass
class StoredGroup:
    """One prompt's group of episodes, as the controller added it."""

    batch: int  # the batch it was generated for
    episodes: list[Episode]
    version: int  # its oldest episode's policy version
    reward_std: float  # the spread of its rewards: 0 means no learning signal
    uses: int = 0  # times trained
    records: list[dict] = field(default_factory=list)  # rollouts.jsonl's, its text filled in


@dataclass
class MicroBatch:
    """A micro-batch of a composed batch: its episodes, collated the first time a rank asks for it."""

    episodes: list[Episode]
    loss_tokens: int
    loss_sequences: int
    collated: asyncio.Future | None = None  # -> TrainBatch


@dataclass
class Handed:
    """A batch as handed out: its groups in the order trained, and how many of its episodes were reused."""

    groups: list[int]
    episodes: list[Episode] = field(default_factory=list)
    fresh: int = 0  # its first groups, generated for it (their records are written when it is trained)
    reused: int = 0  # episodes trained before
    groups_reused: int = 0
    trained: bool = False  # its step was logged (handed out again, to a restarted trainer, it counts no new use)


class FifoBuffer(Actor):
    """Each group trained once, in the batch it was generated for (roles.ReplayBuffer)."""

    def __init__(self, config: ReplayBufferConfig, trainer: TrainerConfig, prompts_per_step: int,
                 max_policy_age: int, pad_id: int):
        if config.cpus:
            pin_cpus(config.cpus, 1)
        for_throughput()
        self.config, self.trainer, self.pad_id = config, trainer, pad_id
        self.prompts_per_step, self.max_policy_age = prompts_per_step, max_policy_age
        self.groups: dict[int, StoredGroup] = {}  # by group id (its prompt index)
        # graded groups' sequences, by group id, then by the controller's try at it: each try staged apart (an older
        # try's stage finishing late, or a discard of it arriving late, leaves a newer try's sequences alone)
        self.staged: dict[int, dict[int, list[list[Completion]]]] = {}
        self.log: dict[int, Handed] = {}  # batches handed out since the newest checkpoint, by index
        self.micro: dict[int, list[list[MicroBatch]]] = {}  # the micro-batches of batches not yet trained
        self.clock = ActorClock()  # its fetches, as it timed them
        self.recorder: RolloutRecorder | None = None

    @concurrent_endpoint
    async def stage(self, groups: list[tuple[int, int, list[list[tuple[int, int]]]]], holders: list) -> list[bool]:
        """Take graded groups' Completions from the generators holding them, forgetting them there: each group
        (group id, the controller's try at it, its sequences' model turns as (index into `holders`, key)) staged
        under that try. One take per holder for all the groups, all at once. For each group, False if a holder
        of its turns is gone (its process died): the controller generates that group again."""
        wanted: dict[int, list[int]] = {}
        for _, _, sequences in groups:
            for turns in sequences:
                for holder, key in turns:
                    wanted.setdefault(holder, []).append(key)
        taken = await asyncio.gather(*(take_held(holders[h], keys, forget=True) for h, keys in wanted.items()),
                                     return_exceptions=True)
        by_key, lost = {}, set()
        for (h, keys), completions in zip(wanted.items(), taken):
            if isinstance(completions, TokensLost):  # a holder that died, or no longer holds them: its groups are lost
                lost.add(h)
                logger.warning("completions could not be taken from their generator: %s",
                               str(completions).splitlines()[0] if str(completions) else type(completions).__name__)
            elif isinstance(completions, BaseException):
                raise completions
            else:
                by_key.update(zip(keys, completions))
        answers = []
        for group_id, attempt, sequences in groups:
            whole = not any(h in lost for turns in sequences for h, _ in turns)
            if whole:
                self.staged.setdefault(group_id, {})[attempt] = [[by_key[key] for _, key in turns] for turns in sequences]
            answers.append(whole)
        return answers

    @endpoint
    async def discard(self, tries: list[tuple[int, int]]) -> None:
        """Staged tries not trained (dropped, stale), each (group id, attempt): let them go (another try at the
        same group stays)."""
        self._let_go(tries)

    def _let_go(self, tries: list[tuple[int, int]]) -> None:
        for group_id, attempt in tries:
            staged = self.staged.get(group_id, {})
            staged.pop(attempt, None)
            if not staged:
                self.staged.pop(group_id, None)

    @endpoint
    async def add(self, batch: int, groups: list[GroupEpisodes], discard: list[tuple[int, int]] = ()) -> None:
        """Kept groups' episodes, generated for batch `batch`: flattened here from their staged sequences; and
        the tries `discard` names let go, as `discard` does (the controller's decisions, one message)."""
        self._let_go(discard)
        for group in groups:
            # its other tries (stopped while their stage was on its way) are never trained: they go with it
            tries = self.staged.pop(group.group_id, {})
            if group.attempt not in tries:
                raise RuntimeError(f"group {group.group_id} (try {group.attempt}) was added to batch {batch} but its "
                                   "completions were never staged here")
            sequences = tries[group.attempt]
            episodes = flatten(group, sequences)
            records = [{**r, "completion": sequences[i][-1].text} if "completion" not in r else r
                       for i, r in enumerate(group.records)]
            self.groups[group.group_id] = StoredGroup(batch, episodes, min(group.versions, default=batch),
                                                      population_std(group.rewards) if group.rewards else 0.0,
                                                      records=records)

    @endpoint
    async def record_rollouts(self, run_dir: str, fraction: float, resumed_step: int | None) -> None:
        """Write rollouts.jsonl in `run_dir` from now on (a resumed run's: the records after `resumed_step` go)."""
        self.recorder = RolloutRecorder(Path(run_dir), fraction, resumed_step)

    @endpoint
    async def sample(self, batch: int, fresh: list[int]) -> dict:
        """Compose batch `batch` from its fresh groups `fresh` (in this order; a logged batch: as it was
        handed out), split it into micro-batches (each collated when a rank first asks for it), and return its
        plan: {"micro_batches": [count per update], "episodes_trained", "episodes_reused", "groups_reused",
        "tokens_trained", "tokens_processed", "padding_fraction", "staleness_mean", "staleness_max",
        "episodes_by_age": [episodes of age 0, 1, ...]}."""
        handed = self.log.get(batch) or self.compose(batch, fresh)
        ages = [batch - e.policy_version for e in handed.episodes]
        if ages and not 0 <= min(ages) <= max(ages) <= self.max_policy_age:
            raise RuntimeError(f"batch {batch} would train episodes of policy versions {batch - max(ages)} to "
                               f"{batch - min(ages)}: outside the staleness bound ({self.max_policy_age})")
        self.log[batch] = handed
        t = self.trainer
        updates = []
        for chunk in split(handed.episodes, t.mini_batches):
            updates.append([MicroBatch(*micro) for micro in micro_batches(chunk, t.micro_batch_size, t.micro_batch_tokens)])
        self.micro[batch] = updates
        return {"micro_batches": [len(u) for u in updates], "episodes_trained": len(handed.episodes),
                "episodes_reused": handed.reused, "groups_reused": handed.groups_reused,
                "tokens_trained": sum(e.num_response_tokens for e in handed.episodes),  # those the loss is over
                "tokens_processed": sum(len(e.tokens) for e in handed.episodes),  # prompt and response
                "padding_fraction": padding_fraction(handed.episodes, [m.episodes for u in updates for m in u]),
                "staleness_mean": sum(ages) / len(ages) if ages else 0.0, "staleness_max": max(ages, default=0),
                "episodes_by_age": [ages.count(a) for a in range(max(ages, default=0) + 1)]}

    def compose(self, batch: int, fresh: list[int]) -> Handed:
        """The groups batch `batch` trains: here, exactly its fresh ones."""
        return Handed(list(fresh), [e for g in fresh for e in self.groups[g].episodes], len(fresh))

    @concurrent_endpoint
    async def micro_batch(self, ref: BatchRef) -> TrainBatch:
        """The micro-batch `ref` names, with what was attached to it; an `idle` one trains nothing (no loss
        token: a rank's turn in a round short of micro-batches). Collated in a thread the first time it is
        asked for, while other ranks' fetches go on; each fetch a span of the buffer's clock."""
        with self.clock.span(f"fetch {ref.update}.{ref.micro}" + (" idle" if ref.idle else ""), ref.batch):
            micro = await self._collated(ref)
        if ref.idle:
            return dataclasses.replace(micro, loss_mask=torch.zeros_like(micro.loss_mask))
        return micro

    def _collated(self, ref: BatchRef) -> asyncio.Future:
        micro = self.micro[ref.batch][ref.update][ref.micro]
        if micro.collated is None:
            micro.collated = asyncio.ensure_future(asyncio.to_thread(
                TrainBatch.collate, micro.episodes, micro.loss_tokens, micro.loss_sequences, self.pad_id))
        return micro.collated

    @concurrent_endpoint
    async def attach(self, ref: BatchRef, values: torch.Tensor) -> None:
        """What an actor computed for micro-batch `ref` (its `into`: old_logprobs or ref_logprobs)."""
        if not ref.idle:
            setattr(await self._collated(ref), ref.into, values)

    @endpoint
    async def spans(self) -> list[dict]:
        """Its fetches since the last call, as it timed them (meshrl/actors/trace.py's ActorClock)."""
        return self.clock.take()

    @endpoint
    async def trained(self, batch: int, step: int) -> None:
        """Batch `batch` is trained as step `step` (whose row the controller logs next): its micro-batches go,
        its fresh groups' records go to rollouts.jsonl and its groups count a use (the first time only: a
        restarted trainer trains logged batches again)."""
        self.micro.pop(batch, None)
        handed = self.log[batch]
        if handed.trained:
            return
        handed.trained = True
        if self.recorder:
            self.recorder.write(step, batch, [r for g in handed.groups[:handed.fresh] for r in self.groups[g].records])
        for g in handed.groups:
            self.groups[g].uses += 1
        self.evict(batch + 1)

    def evict(self, next_batch: int) -> None:
        """Forget the groups no batch from `next_batch` on may train: here, every group trained."""
        self.groups = {g: s for g, s in self.groups.items() if not s.uses}

    @endpoint
    async def checkpointed(self, step: int) -> None:
        """A checkpoint of the steps up to `step` is written: the batches they trained leave the log."""
        self.log = {b: h for b, h in self.log.items() if b >= step}

    @endpoint
    async def logged(self) -> list[int]:
        """The batches handed out since the newest checkpoint, in order."""
        return sorted(self.log)

    @endpoint
    async def save_state(self, path: str) -> None:
        """The groups waiting and their use counts, into `path` (a checkpoint's `replay_buffer/`)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        state = {g: [s.batch, s.episodes, s.version, s.reward_std, s.uses, s.records] for g, s in self.groups.items()}
        torch.save({"groups": state}, Path(path) / "state.pt")

    @endpoint
    async def load_state(self, path: str) -> int:
        """Restore what `save_state` wrote; returns the number of groups restored."""
        from meshrl.checkpoint import load_safely

        state = load_safely(Path(path) / "state.pt", [Episode])
        self.groups = {g: StoredGroup(*fields) for g, fields in state["groups"].items()}
        self.log, self.micro, self.staged = {}, {}, {}
        return len(self.groups)


class ReuseBuffer(FifoBuffer):
    """Groups trained again (roles.ReplayBuffer): each batch's fresh groups, then groups trained
    before, while within the staleness bound and up to `max_reuse` times again, by priority."""

    def compose(self, batch: int, fresh: list[int]) -> Handed:
        old = [g for g, s in self.groups.items() if g not in fresh and self.reusable(s, batch)]
        key = ((lambda g: (-self.groups[g].reward_std, -self.groups[g].version, g))
               if self.config.priority == "reward_std" else (lambda g: (-self.groups[g].version, g)))
        again = sorted(old, key=key)[:max(self.prompts_per_step - len(fresh), 0)]
        groups = list(fresh) + sorted(again)
        episodes = [e for g in groups for e in self.groups[g].episodes]
        return Handed(groups, episodes, len(fresh), sum(len(self.groups[g].episodes) for g in again), len(again))

    def reusable(self, group: StoredGroup, batch: int) -> bool:
        """Trained before, at most max_reuse times again so far, and within the bound for `batch`."""
        return 0 < group.uses <= self.config.max_reuse and batch - group.version <= self.max_policy_age

    def evict(self, next_batch: int) -> None:
        self.groups = {g: s for g, s in self.groups.items() if not s.uses or self.reusable(s, next_batch)}


IMPLEMENTATIONS = {"fifo": "meshrl.actors.replay_buffer:FifoBuffer", "replay": "meshrl.actors.replay_buffer:ReuseBuffer"}


def buffer_impl(impl: str) -> str:
    """The "module:Class" `replay_buffer.impl` names: fifo, replay, or the user's own."""
    return IMPLEMENTATIONS.get(impl, impl)
