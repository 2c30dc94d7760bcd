"""A run's weight relays (meshrl/weight_sync/relay.py): one per generator host when `weight_sync.relay`
says so, each in a process of its own on that host, attached to the trainer's rings; what a generator
replica attaches to (the relay of the host it runs on, or the trainer's rings when there are no relays); a
relay that died replaced within seconds (each is asked every few seconds whether it lives), and named in
processes.json ("relay0", ...) so `meshrl chaos` kills relays too; and the bytes the relays read from the
trainer's hosts.

Replica i runs on host i % hosts of the generators' group (meshrl/runtime/jobs.py, `Hosts.host`), and so
does relay i % hosts, which it reads. A host lost with everything on it (it can no longer start a process:
`Hosts.lose`) takes its replicas and its relay with it: they start again on the group's next host, where
the moved replicas read the moved relay."""

import asyncio
import dataclasses
import json
import logging
from pathlib import Path
from typing import Callable

from meshrl.actors import spawn
from meshrl.actors.replicas import error_line, processes
from meshrl.actors.timeouts import CallTimeout, Timeout, Timeouts, bounded, deadline
from meshrl.configs import Config
from meshrl.runtime.jobs import Hosts, RolePlacement
from meshrl.weight_sync.relay import RelayHandle, WeightRelay, relay_wanted

logger = logging.getLogger(__name__)
WATCH_S = 2.0  # how often each relay is asked whether it lives
ANSWER = Timeout(15.0, "a live relay answers its stats at once")  # past it, the relay is taken as dead


def relays_on(config: Config, placement: dict[str, RolePlacement]) -> bool:
    """`weight_sync.relay` resolved for this run's placement (`relay_wanted`)."""
    generators, trainer = placement["generator"], placement["trainer"]
    return relay_wanted(config.weight_sync.relay, config.generator.replicas, generators.hosts,
                        generators.group == trainer.group, config.weight_sync.transport)


class Relays:
    """The run's relays, one per generator host (none when off), relay h where replica h goes (`Hosts.host`).
    `egress` is what the trainer's hosts sent them; `attach_to` what a replica attaches to; `pids` and
    `host_names` name the live ones for processes.json and placement.json ("relay0", ...)."""

    def __init__(self, config: Config, placement: dict[str, RolePlacement], hosts: Hosts, timeouts: Timeouts,
                 on_change: Callable[[], None] | None = None):
        """`on_change` is called when a relay is replaced or its host lost (the run rewrites processes.json)."""
        self.on = relays_on(config, placement)
        self.count = placement["generator"].hosts if self.on else 0
        self.config, self.hosts, self.timeouts, self.on_change = config, hosts, timeouts, on_change
        self.procs: list = [None] * self.count
        self.handles: list[RelayHandle | None] = [None] * self.count
        self.where: list[tuple[str, int] | None] = [None] * self.count  # each live relay's (host name, pid)
        self.rings: list = []  # the trainer's rings the relays read
        self.lost_bytes = 0  # bytes read by relays that died or were stopped since their last `egress`
        self.starting = [asyncio.Lock() for _ in range(self.count)]  # one host's replicas attaching start one relay
        self.watching: asyncio.Task | None = None

    async def start(self, rings: list) -> None:
        """A relay on each generator host, attached to the trainer's `rings`; then one that dies is replaced
        within seconds (`_watch`)."""
        self.rings = rings
        await asyncio.gather(*(self._start(host) for host in range(self.count)))
        if self.on:
            self.watching = asyncio.create_task(self._watch())

    async def _start(self, host: int) -> None:
        """Relay `host` on the host replica `host` goes on (`Hosts.host`: host `host` of the group, or another if it
        is lost), attached to the rings. A host that cannot start the relay's process is lost if the group has
        others (`Hosts.lose`), and the relay starts on another."""
        w = self.config.weight_sync
        while True:
            try:
                procs, relay = spawn("relay", WeightRelay, w.slots, w.chunk_mb, w.checksums, w.transport, w.timeout_s,
                                     host=self.hosts.host("generator", host))
            except Exception as e:  # Monarch may refuse at once a spawn on a host it knows is gone
                if not self.hosts.lose("generator", host, e):
                    raise
                continue
            self.procs[host] = procs
            try:
                async with deadline(self.timeouts.relay, "relay", "start"):
                    [self.where[host]] = await processes(procs, "relay")
                break
            except Exception as e:  # no process on that host: lost if the group has others, else the run's failure
                if not self.hosts.lose("generator", host, e):
                    raise
                await self._stop(host, ask=False)
        async with deadline(self.timeouts.relay, "relay", "attach"):
            handle = await relay.attach.call_one(self.rings)
        self.handles[host] = dataclasses.replace(handle, relay=relay)

    async def attach(self, rings: list) -> None:
        """Every relay reads `rings` from now on (the trainer's new ones, after its restart); a relay that
        cannot is replaced."""
        self.rings = rings
        await asyncio.gather(*(self._reattach(host) for host in range(self.count)))

    async def _reattach(self, host: int) -> None:
        async with self.starting[host]:
            try:
                async with deadline(self.timeouts.relay, "relay", "attach"):
                    await self.handles[host].relay.attach.call_one(self.rings)
            except Exception as e:  # the relay died or hung (or never started): another is started (logged there)
                await self._replace(host, e)

    async def attach_to(self, index: int) -> list:
        """What generator replica `index` attaches to (`attach_weights`): relay index % relays, on the replica's
        host (started again if it died), or the trainer's rings when there are no relays or it cannot start."""
        if not self.on:
            return self.rings
        host = index % self.count
        async with self.starting[host]:  # two replicas of one host attaching at once start one relay
            await self._check(host)
        return [self.handles[host]] if self.handles[host] else self.rings

    async def _check(self, host: int) -> None:
        """Relay `host` replaced if it does not answer its `stats` at once (a concurrent endpoint)."""
        if self.handles[host] is None:  # its last start failed (said then)
            return await self._replace(host, RuntimeError("it did not start"))
        try:
            async with deadline(ANSWER, "relay", "stats"):
                await self.handles[host].relay.stats.call_one()
        except Exception as e:  # the relay died or hung: another is started (logged there)
            await self._replace(host, e)

    async def _watch(self) -> None:
        """Every `WATCH_S`, each relay asked whether it lives (`_check`): one that died is replaced at once, not
        only when a replica attaches next, and processes.json names its successor (`meshrl chaos` waits for it)."""
        while True:
            await asyncio.sleep(WATCH_S)
            for host in range(self.count):
                try:
                    async with self.starting[host]:
                        await self._check(host)
                except Exception as e:  # tried again at the next round, or when a replica attaches
                    logger.warning("the weight relay of generator host %d could not be started again: %s", host,
                                   error_line(e))

    async def _replace(self, host: int, error: Exception) -> None:
        logger.warning("the weight relay of generator host %d failed (%s): starting another", host, error_line(error))
        await self._stop(host, ask=not isinstance(error, CallTimeout))  # a hung one would not answer
        try:
            await self._start(host)
        finally:
            if self.on_change:
                self.on_change()

    async def _stop(self, host: int, ask: bool = True) -> None:
        """The relay of `host` stopped; `ask`: its bytes read since the last `egress` counted first."""
        if self.handles[host] is not None and ask:
            taken = await self._ask(self.handles[host].relay.egress.call_one(), "the relay's last egress")
            self.lost_bytes += taken or 0
        procs, self.procs[host], self.handles[host], self.where[host] = self.procs[host], None, None, None
        if procs is not None:
            try:
                await bounded(procs.stop(), self.timeouts.stop, "stopping a weight relay")
            except Exception:  # a dead process's mesh may refuse to stop
                pass

    async def _ask(self, call, what: str):
        """A bounded call to a relay (a concurrent endpoint: a live one answers at once); None if it is gone or
        does not answer."""
        try:
            return await bounded(call, ANSWER, what)
        except Exception:  # the relay is gone: nothing to ask (its bytes since the last egress are lost)
            return None

    def pids(self) -> dict[str, int]:
        """Each live relay's pid, "relay0", "relay1", ... by its host's index (processes.json)."""
        return {f"relay{host}": where[1] for host, where in enumerate(self.where) if where and self.handles[host]}

    def host_names(self) -> dict[str, str]:
        """Each live relay's host name (placement.json)."""
        return {f"relay{host}": where[0] for host, where in enumerate(self.where) if where and self.handles[host]}

    async def egress(self) -> int:
        """Bytes the relays read from the trainer's rings since the last call (0 with no relays): with one pull a
        version per generator host, generator hosts x the model's bytes per version."""
        taken = await asyncio.gather(*(self._ask(h.relay.egress.call_one(), "a relay's egress")
                                       for h in self.handles if h is not None))
        total, self.lost_bytes = sum(t or 0 for t in taken) + self.lost_bytes, 0
        return total

    async def stats(self) -> list[dict]:
        """Each live relay's `stats` (its host's index added), in host order."""
        found = await asyncio.gather(*(self._ask(h.relay.stats.call_one(), "a relay's stats") if h else _none()
                                       for h in self.handles))
        return [{"host": host, **s} for host, s in enumerate(found) if s]

    async def stop(self, run_dir: Path | None = None) -> None:
        """relays.json (what each relay read from the trainer, per version) in `run_dir`, then every relay
        stopped."""
        if self.watching:
            self.watching.cancel()
            await asyncio.gather(self.watching, return_exceptions=True)
        if run_dir is not None and self.on:
            (run_dir / "relays.json").write_text(json.dumps(await self.stats(), indent=2))
        await asyncio.gather(*(self._stop(host) for host in range(self.count)), return_exceptions=True)


async def _none():
    return None
