"""The controller's add and discard calls to the replay buffer, made beside its loops in the order it decided
them, one at a time: the groups kept while an add is on its way go together in the next. A call that fails
stops the rest, and `sent()` raises its error, until the dead buffer's replacement (meshrl/restarts.py) has
them lost."""

import asyncio
from typing import Callable

from meshrl.actors.timeouts import Timeout, deadline
from meshrl.types import GroupEpisodes


class BufferCalls:
    """The calls still to make, in order (`waiting`: ("add", (batch, [a kept group's episodes, ...])) or
    ("discard", (group, attempt))), and the task making them (`sending`)."""

    def __init__(self, buffer: Callable[[], object], timeout: Timeout | None):
        """`buffer()`: the replay buffer in place (a restart replaces it); `timeout`: each call's bound."""
        self.buffer, self.timeout = buffer, timeout
        self.waiting: list[tuple[str, tuple]] = []
        self.sending: asyncio.Future | None = None

    def add(self, batch: int, episodes: GroupEpisodes) -> None:
        """A kept group of batch `batch`: its episodes join the add waiting for that batch, if there is one."""
        last = self.waiting[-1] if self.waiting else None  # not yet on its way: the sender takes each out first
        if last and last[0] == "add" and last[1][0] == batch:
            last[1][1].append(episodes)
        else:
            self._send("add", batch, [episodes])

    def discard(self, group: int, attempt: int) -> None:
        """A finished group not trained: the buffer lets the tokens staged by that attempt go (those of a later
        attempt at the same prompt, staged before this call arrives, stay)."""
        self._send("discard", group, attempt)

    def _send(self, endpoint: str, *args) -> None:
        self.waiting.append((endpoint, args))
        if self.sending is None or (self.sending.done() and (self.sending.cancelled() or not self.sending.exception())):
            self.sending = asyncio.ensure_future(self._send_all())

    async def _send_all(self) -> None:
        while self.waiting:
            # out of the list before it is sent: a group kept meanwhile goes in the next call, never into one
            # already on its way (lost with it if the buffer died: its restart generates them again)
            endpoint, args = self.waiting.pop(0)
            async with deadline(self.timeout, "replay_buffer", endpoint):
                await getattr(self.buffer(), endpoint).call_one(*args)

    async def sent(self) -> None:
        """Wait until every call asked for so far is made (raising the error of one that failed)."""
        if self.sending is not None:
            await self.sending

    def lose(self) -> None:
        """The replay buffer died: the calls on their way to it and those waiting are lost with it (their
        groups generated again)."""
        if self.sending is not None:
            self.sending.cancel()
            self.sending.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.sending, self.waiting = None, []
