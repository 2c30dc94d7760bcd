"""What a generator replica keeps about its weight updates, whatever its engine: whether new requests
may start (a drain holds them back until the running ones are done), how long its engine had requests,
and the loads it did since the controller last asked (roles.Generator.weight_updates). The vLLM
generator and the fake one (meshrl/tools/simulation.py) load alike through it."""

import asyncio
import time
from contextlib import asynccontextmanager


class WeightUpdates:
    def __init__(self):
        self.admitting = asyncio.Event()  # cleared while a drain waits for the running requests
        self.admitting.set()
        self.idle = asyncio.Event()  # no request running
        self.idle.set()
        self.busy_s, self.busy_since = 0.0, None  # seconds the engine had requests since asked; since when now
        self.counts = {"weight_swaps_in_flight": 0, "prefix_cache_resets_refused": 0}
        self.pulls: list[dict] = []

    def running(self) -> None:
        """Requests were added: the engine is busy."""
        self.idle.clear()
        self.busy_since = self.busy_since or time.monotonic()

    def done(self) -> None:
        """No request is left."""
        if self.busy_since is not None:
            self.busy_s += time.monotonic() - self.busy_since
            self.busy_since = None
        self.idle.set()

    @asynccontextmanager
    async def loading(self, drain: bool):
        """Around a load: with `drain`, no new request starts and the running ones finish first."""
        try:
            if drain:
                self.admitting.clear()
                await self.idle.wait()
            yield
        finally:
            self.admitting.set()

    def loaded(self, start: float, version: int, in_flight: bool, reset: bool = True, read_s: float = 0.0) -> None:
        """A load that began at wall-clock `start`, of which `read_s` read the rings (the rest loaded into
        vLLM); `in_flight`: requests were running; `reset`: whether the prefix-cache reset asked for was
        done (False: vLLM refused it)."""
        self.counts["weight_swaps_in_flight"] += in_flight
        self.counts["prefix_cache_resets_refused"] += not reset
        self.pulls.append({"start": start, "end": time.time(), "version": version, "in_flight": in_flight,
                           "read_s": read_s})

    def report(self) -> dict:
        """Since the last report: the loads (`pulls`), the counts, the engine's busy seconds (`busy_s`)."""
        now = time.monotonic()
        busy = self.busy_s + (now - self.busy_since if self.busy_since is not None else 0.0)
        self.busy_s, self.busy_since = 0.0, now if self.busy_since is not None else None
        report = {"pulls": self.pulls, **self.counts, "busy_s": busy}
        self.pulls, self.counts = [], dict.fromkeys(self.counts, 0)
        return report
