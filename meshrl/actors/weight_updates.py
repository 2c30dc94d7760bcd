"""What a generator replica keeps about its weight updates, whatever its engine: whether new requests
may start (a drain holds them back until the running ones are done), how long its engine had requests,
and the loads it did since its last report (roles.Generator.weight_updates, and each generate answer's
`Generation.report`). The vLLM generator, the benches' stand-in and the tests' fake one load alike
through it. And the controller's side: a report into the step's figures (`absorb`), as each generate
answer brings one, and every replica's gathered at the run's end (`gather_reports`)."""

import asyncio
import time
from contextlib import asynccontextmanager

from meshrl.actors.timeouts import deadline


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


def no_figures() -> dict:
    """The generators' figures before any report (`gather_reports`)."""
    return {"pull": 0.0, "transfer": 0.0, "load": 0.0, "busy": 0.0, "prompts": 0, "cached": 0, "rates": [],
            "egress": 0}


def cache_figures(f: dict) -> dict:
    """The prompt tokens served from cache and prefilled, all replicas together, and
    `prefix_cache_hit_rate`, each replica's share of its prompt tokens served from its cache averaged over
    the replicas that had prompts (absent if none did)."""
    return {"prompt_tokens_cached": f["cached"], "prompt_tokens_prefilled": f["prompts"] - f["cached"],
            **({"prefix_cache_hit_rate": sum(f["rates"]) / len(f["rates"])} if f["rates"] else {})}


def absorb(replica: int, updates: dict, tracer, figures: dict, counts: dict) -> None:
    """What generator replica `replica` reported (roles.Generator.weight_updates' dict): its loads become
    `pull` spans of the trace; into `figures` (from `no_figures`): the longest load's seconds (`pull`), and the longest of its two parts: reading
    the rings (`transfer`) and loading into the engine, which takes no step meanwhile (`load`); the seconds its
    engine had requests to run, its prompt tokens and those its prefix cache served, its share served from its
    cache (for `cache_figures`), and the bytes it read from the trainer's rings itself (`egress`; a relay's are
    its own); its swap and cache counts added to `counts`."""
    f = figures
    f["busy"] += updates["busy_s"]
    if updates.get("prompt_tokens"):  # optional in the contract (roles.Generator.weight_updates)
        f["prompts"] += updates["prompt_tokens"]
        f["cached"] += updates["cached_prompt_tokens"]
        f["rates"].append(updates["cached_prompt_tokens"] / updates["prompt_tokens"])
    f["egress"] += updates.get("trainer_bytes", 0)  # optional in the contract
    for pull in updates["pulls"]:
        tracer.add("generator", "pull", pull["start"], pull["end"], replica, pull["version"])
        f["pull"] = max(f["pull"], pull["end"] - pull["start"])
        read = pull.get("read_s", 0.0)  # reading the rings, the engine stepping on (unless draining)
        f["transfer"] = max(f["transfer"], read)
        f["load"] = max(f["load"], pull["end"] - pull["start"] - read)  # into vLLM: the engine takes no step
    for key in counts:
        counts[key] += updates[key]


async def gather_reports(replicas: list, timeout, tracer, figures: dict, counts: dict) -> None:
    """What the healthy generator `replicas` did since their last report, each `absorb`ed; each ask bounded by
    `timeout`; a replica failing now is its pool's to find."""
    async def ask(replica):  # bookkeeping: bounded, not traced
        async with deadline(timeout, "generator", "weight_updates"):
            return replica, await replica.actor.weight_updates.call_one()

    answers = await asyncio.gather(*(ask(r) for r in replicas if r.healthy), return_exceptions=True)
    for replica, updates in (a for a in answers if not isinstance(a, BaseException)):
        absorb(replica.index, updates, tracer, figures, counts)
