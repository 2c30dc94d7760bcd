"""The controller's add and discard calls to the replay buffer, made beside its loops, one at a time, and as
few as the decisions allow: the groups kept within `FLUSH_S` of each other (or while a call is on its
way) go in one `add` per batch, and the tries let go (dropped, stale) ride in it (`discard` alone only
when no group was kept meanwhile). Waiting for them (`sent()`: the training loop before a batch's
`sample`, a checkpoint) sends what waits at once, so a kept group waits at most `FLUSH_S` before it is
sent and never delays a step. A call that fails stops the rest, and `sent()` raises its error, until the
dead buffer's replacement (meshrl/restarts.py) has them lost."""

import asyncio
from typing import Callable

from meshrl.actors.timeouts import Timeout, deadline
from meshrl.types import GroupEpisodes

# Seconds a decision waits for others to share its message: 64 groups kept in a burst take one add, not 64
FLUSH_S = 0.05


class BufferCalls:
    """The decisions still to send (`adds`: batch -> its kept groups' episodes, in the order kept; `discards`:
    (group, attempt) of each try let go), the timer that sends them, and the task sending (`sending`)."""

    def __init__(self, buffer: Callable[[], object], timeout: Timeout | None):
        """`buffer()`: the replay buffer in place (a restart replaces it); `timeout`: each call's bound."""
        self.buffer, self.timeout = buffer, timeout
        self.adds: dict[int, list[GroupEpisodes]] = {}
        self.discards: list[tuple[int, int]] = []
        self.sending: asyncio.Future | None = None
        self.timer: asyncio.TimerHandle | None = None

    def add(self, batch: int, episodes: GroupEpisodes) -> None:
        """A kept group of batch `batch`: its episodes go in that batch's next add."""
        self.adds.setdefault(batch, []).append(episodes)
        self._soon()

    def discard(self, group: int, attempt: int) -> None:
        """A finished group not trained: the buffer lets the tokens that try staged go (those of a later try at
        the same prompt, staged before this reaches the buffer, stay)."""
        self.discards.append((group, attempt))
        self._soon()

    def _soon(self) -> None:
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        """Send what waits now (after the call on its way, if one is)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if (self.adds or self.discards) and (self.sending is None or (
                self.sending.done() and (self.sending.cancelled() or not self.sending.exception()))):
            self.sending = asyncio.ensure_future(self._send_all())

    async def _send_all(self) -> None:
        while self.adds or self.discards:
            # out of the queue before they are sent: a group kept meanwhile goes in the next call, never into one
            # already on its way (lost with it if the buffer died: its restart generates them again)
            if self.adds:
                batch = min(self.adds)
                call = ("add", batch, self.adds.pop(batch), self.discards)
            else:
                call = ("discard", self.discards)
            self.discards = []
            endpoint, *args = call
            async with deadline(self.timeout, "replay_buffer", endpoint):
                await getattr(self.buffer(), endpoint).call_one(*args)

    async def sent(self) -> None:
        """Send what waits and wait until every call asked for so far is made (raising the error of one that
        failed)."""
        self.flush()
        if self.sending is not None:
            await self.sending

    def lose(self) -> None:
        """The replay buffer died: the calls on their way to it and those waiting are lost with it (their
        groups generated again)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.sending is not None:
            self.sending.cancel()
            self.sending.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.sending, self.adds, self.discards = None, {}, []


class Stages:
    """Graded groups' `stage` calls, several to a message: while one is on its way, the groups graded meanwhile
    wait and go together in the next (no timer: a group alone is sent at once, and under load the messages grow
    with the rate). Each group's caller gets its own answer (True: staged; False: a generator holding its
    turns is gone), or the call's error."""

    def __init__(self, buffer: Callable[[], object], timeout: Timeout | None):
        self.buffer, self.timeout = buffer, timeout
        self.waiting: list[tuple[int, int, list, asyncio.Future]] = []  # group id, attempt, sequences, answer
        self.sending = False

    async def stage(self, group_id: int, attempt: int, sequences: list[list[tuple[object, int]]]) -> bool:
        """Group `group_id`'s try `attempt` staged, each sequence's turns as (the generator actor mesh holding
        it, its key), with the other groups waiting."""
        answer = asyncio.get_running_loop().create_future()
        self.waiting.append((group_id, attempt, sequences, answer))
        if not self.sending:
            self.sending = True
            asyncio.ensure_future(self._send_all())
        return await answer

    async def _send_all(self) -> None:
        try:
            while self.waiting:
                batch, self.waiting = self.waiting, []
                await self._send(batch)
        finally:
            self.sending = False

    async def _send(self, batch: list) -> None:
        holders: list = []  # every group's holders, each once (a mesh reference pickles to about 2.5 KB)
        at: dict[int, int] = {}  # id(holder) -> its index in `holders`
        groups = []
        for group_id, attempt, sequences, _ in batch:
            for turns in sequences:
                for holder, _ in turns:
                    if id(holder) not in at:
                        at[id(holder)] = len(holders)
                        holders.append(holder)
            groups.append((group_id, attempt, [[(at[id(h)], key) for h, key in turns] for turns in sequences]))
        try:
            async with deadline(self.timeout, "replay_buffer", "stage"):
                answers = await self.buffer().stage.call_one(groups, holders)
        except BaseException as e:  # every group of the call gets its error (a cancellation too: stopped)
            for *_, future in batch:
                if not future.done():
                    future.set_exception(e if isinstance(e, Exception) else asyncio.CancelledError())
            if not isinstance(e, Exception):
                raise
            return
        for (*_, future), staged in zip(batch, answers):
            if not future.done():  # its group may have stopped meanwhile
                future.set_result(staged)
