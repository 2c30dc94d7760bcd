"""A run's weight relays (meshrl/weight_sync/relay.py): one per generator host when `weight_sync.relay`
says so, each in a process of its own on that host, attached to the trainer's rings; what a generator
replica attaches to (its host's relay, or the trainer's rings when there are no relays); a relay that
died replaced when a replica attaches next; and the bytes the relays read from the trainer's hosts.

Replica i runs on host i % hosts of the generators' group (meshrl/runtime/jobs.py, `Hosts.host`), and so
does its relay."""

import asyncio
import dataclasses
import json
import logging
from pathlib import Path

from meshrl.actors import spawn
from meshrl.actors.replicas import error_line
from meshrl.actors.timeouts import Timeouts, bounded, deadline
from meshrl.configs import Config
from meshrl.runtime.jobs import Hosts, RolePlacement
from meshrl.weight_sync.relay import RelayHandle, WeightRelay, relay_wanted

logger = logging.getLogger(__name__)


def relays_on(config: Config, placement: dict[str, RolePlacement]) -> bool:
    """`weight_sync.relay` resolved for this run's placement (`relay_wanted`)."""
    generators, trainer = placement["generator"], placement["trainer"]
    return relay_wanted(config.weight_sync.relay, config.generator.replicas, generators.hosts,
                        generators.group == trainer.group, config.weight_sync.transport)


class Relays:
    """The run's relays, one per generator host (none when off). `egress` is what the trainer's hosts sent
    them; `attach_to` what a replica attaches to."""

    def __init__(self, config: Config, placement: dict[str, RolePlacement], hosts: Hosts, timeouts: Timeouts):
        self.on = relays_on(config, placement)
        self.count = placement["generator"].hosts if self.on else 0
        self.config, self.hosts, self.timeouts = config, hosts, timeouts
        self.procs: list = [None] * self.count
        self.handles: list[RelayHandle | None] = [None] * self.count
        self.rings: list = []  # the trainer's rings the relays read
        self.lost_bytes = 0  # bytes read by relays that died or were stopped since their last `egress`
        self.starting = asyncio.Lock()

    async def start(self, rings: list) -> None:
        """A relay on each generator host, attached to the trainer's `rings`."""
        self.rings = rings
        await asyncio.gather(*(self._start(host) for host in range(self.count)))

    async def _start(self, host: int) -> None:
        w = self.config.weight_sync
        procs, relay = spawn("relay", WeightRelay, w.slots, w.chunk_mb, w.checksums, w.transport, w.timeout_s,
                             host=self.hosts.host("generator", host))
        self.procs[host] = procs
        async with deadline(self.timeouts.relay, "relay", "attach"):
            handle = await relay.attach.call_one(self.rings)
        self.handles[host] = dataclasses.replace(handle, relay=relay)

    async def attach(self, rings: list) -> None:
        """Every relay reads `rings` from now on (the trainer's new ones, after its restart); a relay that
        cannot is replaced."""
        self.rings = rings
        await asyncio.gather(*(self._reattach(host) for host in range(self.count)))

    async def _reattach(self, host: int) -> None:
        try:
            async with deadline(self.timeouts.relay, "relay", "attach"):
                await self.handles[host].relay.attach.call_one(self.rings)
        except Exception as e:  # the relay died or hung: another is started (logged there)
            await self._replace(host, e)

    async def attach_to(self, index: int) -> list:
        """What generator replica `index` attaches to (`attach_weights`): its host's relay (started again if it
        died), or the trainer's rings when there are no relays."""
        if not self.on:
            return self.rings
        host = index % self.count
        async with self.starting:  # two replicas of one host attaching at once start one relay
            try:
                async with deadline(self.timeouts.stop, "relay", "stats"):
                    await self.handles[host].relay.stats.call_one()
            except Exception as e:  # the relay died or hung: another is started (logged there)
                await self._replace(host, e)
        return [self.handles[host]]

    async def _replace(self, host: int, error: Exception) -> None:
        logger.warning("the weight relay of generator host %d failed (%s): starting another", host, error_line(error))
        await self._stop(host)
        await self._start(host)

    async def _stop(self, host: int) -> None:
        if self.handles[host] is not None:
            taken = await self._ask(self.handles[host].relay.egress.call_one(), "the relay's last egress")
            self.lost_bytes += taken or 0
        if self.procs[host] is not None:
            try:
                await bounded(self.procs[host].stop(), self.timeouts.stop, "stopping a weight relay")
            except Exception:  # a dead process's mesh may refuse to stop
                pass
        self.procs[host] = self.handles[host] = None

    async def _ask(self, call, what: str):
        """A bounded call to a relay; None if it is gone or does not answer."""
        try:
            return await bounded(call, self.timeouts.stop, what)
        except Exception:  # the relay is gone: nothing to ask (its bytes since the last egress are lost)
            return None

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
        if run_dir is not None and self.on:
            (run_dir / "relays.json").write_text(json.dumps(await self.stats(), indent=2))
        await asyncio.gather(*(self._stop(host) for host in range(self.count)), return_exceptions=True)


async def _none():
    return None
