"""One copy of each version per generator host: a relay on the host pulls it from the trainer's rings and
republishes it into a ring of its own there, which the host's replicas read over shared memory.

Without a relay every replica reads the whole model from the trainer's rings, so the trainer's hosts send
replicas x model bytes per version; with one per generator host they send generator hosts x model bytes.
The relay (`WeightRelay`, a light actor in a process of its own beside the host's replicas; it builds no
model) reads the trainer's rings as a replica would (`ShardedReader`: RDMA or its TCP fallback, torn and
checksummed reads refused) and publishes what it read into a `WeightRing` on its host: the same seqlock,
slots and checksums, so a replica's read of the relay's ring is checked as a read of the trainer's is.

A relay pulls on demand: a replica looking for a newer version (`RelayedReader.newest`, which the
generator calls before each load: at a `generate` asking for `min_version`, and every `weight_sync.poll_s`
while generating in flight) asks its relay first, and the relay pulls the trainer's newest version if it
holds an older one, then answers. So a version is on the host as soon as a replica looks for it, exactly
once however many replicas look (the pulls are serialized), and a replica asking for a version the
trainer has published always finds it. The replica's own read (`weight_sync.timeout_s`) bounds both.

A relay that dies: the replica's next call to it raises (Monarch's supervision, within seconds), and from
then on that replica reads the trainer's rings itself, as without a relay (its bytes then count as the
trainer's egress, `take_trainer_bytes`). A replica that is replaced, or re-attached after a trainer
restart, gets a live relay again: the run starts a new one on the host (meshrl/runtime/relays.py).
"""

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Callable

from monarch.actor import Actor, concurrent_endpoint

from meshrl.checks import AUTO_ON_OFF
from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync.device_ring import DeviceRingHandle, DeviceRingReader, remote_handles
from meshrl.weight_sync.disk import DiskHandle, DiskReader
from meshrl.weight_sync.ring import RingHandle, WeightRing, host_id
from meshrl.weight_sync.shards import ShardedReader, Weights

logger = logging.getLogger(__name__)


def relay_wanted(setting: str, replicas: int, generator_hosts: int, beside_trainer: bool, transport: str) -> bool:
    """Whether a run starts a relay on each generator host (`weight_sync.relay`). `auto`, the default for a
    deployment: on when a generator host runs 2 or more replicas (ceil(replicas / hosts)) and the
    generators are not on the trainer's hosts (there every replica reads the trainer's ring over shared
    memory already: nothing leaves the host, and a relay would only add a copy). Never with transport disk
    (no ring to relay)."""
    if setting not in AUTO_ON_OFF:
        raise ValueError(f"weight_sync.relay must be one of {', '.join(AUTO_ON_OFF)}, not {setting!r}")
    if transport == "disk" or setting == "off":
        return False
    return setting == "on" or (-(-replicas // max(generator_hosts, 1)) >= 2 and not beside_trainer)


def full_layout(handles: list[RingHandle | None]) -> WeightLayout:
    """The whole model's layout from the trainer's ring handles (each holds its ranks' rows of every tensor,
    in rank order): each tensor's rows added up. A relay needs no model to know it."""
    rows: dict[str, list] = {}
    for handle in filter(None, handles):
        for spec in handle.layout.specs:
            rows.setdefault(spec.name, [0, spec.shape[1:], spec.dtype])[0] += spec.shape[0]
    return WeightLayout.of({name: ((n, *rest), dtype) for name, (n, rest, dtype) in rows.items()})


@dataclass
class RelayHandle:
    """What a replica attaches to instead of the trainer's rings (passed to its `attach_weights` as the one
    item of its list): its host's relay and the relay's ring, and the trainer's rings should the relay die."""

    ring: RingHandle  # the relay's ring, on the replica's host
    relay: object  # the relay actor: `newest` pulls the trainer's newest version onto the host
    trainer: list  # the trainer's ring handles, read directly if the relay is gone
    upstream: str  # how the relay reads the trainer's rings: rdma | shm


class WeightRelay(Actor):
    """On a generator host: pulls each version the host's replicas look for once from the trainer's rings
    and republishes it into its own ring there."""

    def __init__(self, slots: int = 2, chunk_mb: int = 16, checksums: bool = False, transport: str = "auto",
                 timeout_s: float = 0.0):
        """`timeout_s` (weight_sync.timeout_s; 0: none): a pull from the trainer's rings that takes longer fails,
        for the replicas waiting on it, and stops at its next chunk; the next replica to ask pulls again."""
        self.slots, self.chunk_mb, self.checksums, self.transport = slots, chunk_mb, checksums, transport
        self.timeout_s = timeout_s
        self.reader: ShardedReader | None = None  # of the trainer's rings
        self.ring: WeightRing | None = None  # this host's copy
        self.published = -1  # the newest version in `ring`
        self.pulling = asyncio.Lock()  # one pull and publish at a time: each version is read once
        self.reported = 0  # bytes read from the trainer at the last `egress`
        self.version_bytes: dict[int, int] = {}  # version -> bytes read from the trainer's rings to get it

    @concurrent_endpoint
    async def attach(self, rings: list) -> RelayHandle:
        """Read the trainer's rings `rings` (every rank's handle, in rank order) from now on: at the start, and
        after a trainer restart (its new rings). The relay's own ring is made once and kept."""
        layout = full_layout(rings)
        async with self.pulling:
            if self.reader is not None:  # the bytes of the old reader stay counted
                self.reported -= self.reader.bytes_read
            self.reader = self.trainer_reader(rings, layout)
            if self.ring is None:
                self.ring = WeightRing(layout, self.slots, self.chunk_mb, self.checksums)
            else:
                self.ring.layout.check_matches(layout)
        # the run puts this actor in the handle (`relay`) before handing it to the replicas
        return RelayHandle(self.ring.handle(), None, rings, self.reader.transport)

    def trainer_reader(self, rings: list, layout: WeightLayout) -> ShardedReader:
        """The reader of the trainer's rings: whole tensors under the trainer's names, as the rings hold them."""
        return ShardedReader(remote_handles(rings), layout, lambda named: named, self.transport)

    @concurrent_endpoint
    async def newest(self) -> int:
        """Pull the trainer's newest version if newer than this ring's, publish it here, and return the newest
        version this ring holds (-1: none)."""
        if self.reader is None:
            raise RuntimeError("the relay was not attached to the trainer's rings")
        async with self.pulling:
            before = self.reader.bytes_read
            try:
                latest = await asyncio.wait_for(self.reader.read_latest(newer_than=self.published),
                                                self.timeout_s or None)
            except TimeoutError:
                raise TimeoutError(f"the relay's pull from the trainer's rings did not finish within "
                                   f"{self.timeout_s:g} s (weight_sync.timeout_s)") from None
            if latest is not None:
                version, weights = latest
                await asyncio.to_thread(self.ring.publish, dict(weights), version)
                self.version_bytes[version] = self.version_bytes.get(version, 0) + self.reader.bytes_read - before
                self.published = version
            return self.published

    @concurrent_endpoint
    async def egress(self) -> int:
        """Bytes this relay read from the trainer's rings since the last call."""
        now = self.reader.bytes_read if self.reader else 0
        taken, self.reported = now - self.reported, now
        return taken

    @concurrent_endpoint
    async def stats(self) -> dict:
        """Its process, the newest version relayed, bytes read from the trainer per version, torn and refused reads."""
        reader = self.reader
        return {"pid": os.getpid(), "published": self.published, "version_bytes": dict(self.version_bytes),
                "transport": reader.transport if reader else None, "torn_reads": reader.torn_reads if reader else 0,
                "corrupt_reads": reader.corrupt_reads if reader else 0}


class RelayedReader:
    """Generator side, as `ShardedReader`: reads its host's relay's ring over shared memory, the relay asked
    first to bring the trainer's newest version onto the host; the trainer's rings once the relay is gone."""

    def __init__(self, handle: RelayHandle, layout: WeightLayout, to_hf: Callable[[dict], dict], transport: str = "auto"):
        """`transport`: how to read the trainer's rings should the relay die (the relay's ring: shared memory,
        on this replica's host by construction)."""
        self.handle, self.layout, self.to_hf, self.fallback_transport = handle, layout, to_hf, transport
        self.local = ShardedReader([handle.ring], layout, to_hf, "shm")
        self.fallback: ShardedReader | None = None  # the trainer's rings, once the relay died

    @property
    def reader(self) -> ShardedReader:
        return self.fallback or self.local

    @property
    def transport(self) -> str:
        return self.fallback.transport if self.fallback else f"relay:{self.handle.upstream}"

    @property
    def torn_reads(self) -> int:
        return self.local.torn_reads + (self.fallback.torn_reads if self.fallback else 0)

    @property
    def corrupt_reads(self) -> int:
        return self.local.corrupt_reads + (self.fallback.corrupt_reads if self.fallback else 0)

    def memory(self) -> list:
        return self.reader.memory()

    def take_trainer_bytes(self) -> int:
        """Bytes this replica read from the trainer's rings since the last call: 0 while its relay lives."""
        return self.fallback.take_trainer_bytes() if self.fallback else 0

    async def newest(self) -> int:
        """The newest version this replica can load: the relay's, after it pulled the trainer's newest."""
        if self.fallback is None:
            from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

            try:
                await self.handle.relay.newest.call_one()
                return await self.local.newest()
            except SupervisionError as e:
                reason = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
                logger.warning("this host's weight relay is gone (%s): reading the trainer's rings directly", reason)
                self.fallback = ShardedReader(remote_handles(self.handle.trainer), self.layout, self.to_hf,
                                              self.fallback_transport)
        return await self.fallback.newest()

    async def read_latest(self, newer_than: int = -1) -> tuple[int, Weights] | None:
        return await self.reader.read_latest(newer_than)

    async def load_latest(self, load: Callable[[int, Weights], None], newer_than: int = -1) -> int | None:
        return await self.reader.load_latest(load, newer_than)


def open_reader(handles: list, layout: WeightLayout, to_hf: Callable[[dict], dict], transport: str = "auto"):
    """The reader a replica loads versions through, from what it was attached to (`attach_weights`): the
    trainer's rings (`ShardedReader`), its host's relay (`RelayedReader`) or a directory of versions
    (`DiskReader`)."""
    if disk := [h for h in handles if isinstance(h, DiskHandle)]:
        return DiskReader(disk[0])
    device = [h for h in handles if isinstance(h, DeviceRingHandle)]
    if len(device) == 1 and device[0].host == host_id():  # the trainer's GPUs beside this replica: CUDA IPC
        return DeviceRingReader(device[0], layout, to_hf)
    if device:  # on other hosts, or on several: over RDMA, as a host ring's readers there
        return ShardedReader(remote_handles(handles), layout, to_hf, "rdma")
    if relayed := [h for h in handles if isinstance(h, RelayHandle)]:
        return RelayedReader(relayed[0], layout, to_hf, transport)
    return ShardedReader(handles, layout, to_hf, transport)
