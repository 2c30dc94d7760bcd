"""Counting the Monarch messages this process sends, by endpoint: the controller's budget per group.

A controller's CPU per group is mostly the messages it sends (each `call_one` round trip costs it
0.3-0.5 ms on 2 cores, docs/performance.md), so the count per group is a budget, held by a test
(tests/test_message_budget.py) and reported by `meshrl bench controller --real`.

How: every ActorMesh this process builds while `MessageCounter.installed()` is open (spawned,
sliced, or received in a message) gets endpoints that count, then send as Monarch's do. A call on
a mesh of n actors counts n messages (one to each), `call_one` and `choose` one; the count runs only
between `start()` and `stop()`, so spawning and supervision probes before or after are not counted.
"""

import contextlib
from collections import Counter
from typing import Iterator

from monarch._src.actor.actor_mesh import ActorMesh

# The budget: the Monarch messages the controller may send per group routed (trained and evaluated), held by
# tests/test_message_budget.py at 64 generator actors (1.22 measured there, 2026-11-28: generate 1, its grading
# riding on it; stage and add 0.05; the trainer's calls, one per rank per update, and the step's other calls
# 0.17; no weight_updates, as no call was stopped at the end); docs/performance.md gives each endpoint's share
# at larger runs. Was 5.19 (2026-11-27), 3.07 before the trainer's and the grader's calls were folded.
MESSAGES_PER_GROUP = 1.5
ADVERBS = ("call", "call_one", "choose", "stream", "broadcast")  # those that send to `size` actors (one for the last three)


class CountingEndpoint:
    """A Monarch endpoint that counts each send into its counter, then sends it."""

    def __init__(self, endpoint, name: str, size: int, counter: "MessageCounter"):
        self._endpoint, self._name_, self._size, self._counter = endpoint, name, size, counter

    def __getattr__(self, attr: str):
        value = getattr(self._endpoint, attr)
        if attr not in ADVERBS:
            return value

        def send(*args, **kwargs):
            self._counter.sent(self._name_, 1 if attr in ("call_one", "choose") else self._size)
            return value(*args, **kwargs)
        return send


class MessageCounter:
    """Messages sent while counting, by endpoint name."""

    def __init__(self):
        self.by_endpoint: Counter[str] = Counter()
        self.counting = False

    def sent(self, endpoint: str, messages: int) -> None:
        if self.counting:
            self.by_endpoint[endpoint] += messages

    def start(self) -> None:
        self.by_endpoint.clear()
        self.counting = True

    def stop(self) -> dict[str, int]:
        """What was sent since `start()`, by endpoint, most first."""
        self.counting = False
        return dict(self.by_endpoint.most_common())

    @contextlib.contextmanager
    def installed(self) -> Iterator["MessageCounter"]:
        """Meshes built meanwhile count their sends (ActorMesh._endpoint wrapped; put back on exit)."""
        original = ActorMesh._endpoint

        def counted(mesh, name, impl, propagator):
            return CountingEndpoint(original(mesh, name, impl, propagator), impl.__name__, len(mesh._shape.ndslice), self)
        ActorMesh._endpoint = counted
        try:
            yield self
        finally:
            ActorMesh._endpoint = original
