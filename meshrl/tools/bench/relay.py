"""`meshrl bench relay`: the bytes that leave the trainer's ring per version, and the seconds from a publish
to every replica holding it, with each replica reading the trainer's ring itself and with one relay on
their host (meshrl/weight_sync/relay.py).

The trainer's ring lies in this process, with the model's published layout (the bytes do not matter);
the replicas are stand-ins that read as a generator does (`open_reader`, `newest`, `load_latest`) without
loading vLLM, each in a process of its own. Every read of the trainer's ring is RDMA (forced: on one
machine it stands in for the trainer's host being another; Monarch's TCP fallback where there is no
ibverbs), and the replicas read the relay's ring over shared memory. A version is published, every
replica is asked to load it at once, and the time until all hold it is taken, per version.
"""

import asyncio
import statistics
import time

import torch
from monarch.actor import Actor, endpoint, this_host

from meshrl.actors import cpu_name, spawn
from meshrl.models.model import resolve_checkpoint
from meshrl.weight_sync import WeightLayout, published_weights
from meshrl.weight_sync.relay import WeightRelay, open_reader
from meshrl.weight_sync.ring import WeightRing


class ReadingReplica(Actor):
    """A generator replica's reading of versions, without vLLM: attach, then load the newest version."""

    def __init__(self, layout: WeightLayout):
        self.layout, self.reader, self.version = layout, None, 0

    @endpoint
    async def attach(self, handles: list) -> str:
        self.reader = open_reader(handles, self.layout, lambda named: named, "rdma")
        return self.reader.transport

    @endpoint
    async def load(self) -> int:
        if await self.reader.newest() > self.version:
            self.version = await self.reader.load_latest(lambda v, weights: None, newer_than=self.version) or self.version
        return self.version

    @endpoint
    async def trainer_bytes(self) -> int:
        return self.reader.take_trainer_bytes()


async def _arm(ring: WeightRing, weights: dict, replicas: int, versions: int, first: int, relay: bool) -> dict:
    """Publish `versions` versions from `first` on; each time, every replica loads it. The seconds per version
    and the bytes read from the trainer's ring per version."""
    procs = this_host().spawn_procs(per_host={"procs": replicas}, name="replicas")
    readers = [procs.spawn("replica", ReadingReplica, ring.layout).slice(procs=i) for i in range(replicas)]
    relay_procs = None
    try:
        handles = [ring.handle()]
        if relay:
            relay_procs, actor = spawn("relay", WeightRelay, ring.slots, 16, False, "rdma")
            handle = await actor.attach.call_one(handles)
            handle.relay, handles = actor, [handle]
        transports = [await r.attach.call_one(handles) for r in readers]
        seconds, egress = [], []
        for version in range(first, first + versions):
            ring.publish(weights, version)
            start = time.perf_counter()
            loaded = await asyncio.gather(*(r.load.call_one() for r in readers))
            seconds.append(time.perf_counter() - start)
            assert loaded == [version] * replicas, loaded
            sent = sum([await r.trainer_bytes.call_one() for r in readers])
            egress.append(sent + (await actor.egress.call_one() if relay else 0))
        return {"replica_transport": transports[0], "seconds": seconds, "median_s": statistics.median(seconds),
                "egress_bytes_per_version": egress}
    finally:
        await procs.stop()
        if relay_procs is not None:
            await relay_procs.stop()


async def bench_relay(model: str = "smollm2", replicas: int = 2, versions: int = 3) -> dict:
    layout, _ = published_weights(resolve_checkpoint(model), "bfloat16")
    weights = {spec.name: torch.ones(spec.shape, dtype=spec.dtype) for spec in layout.specs}
    ring = WeightRing(layout, slots=2)
    direct = await _arm(ring, weights, replicas, versions, 1, relay=False)
    relayed = await _arm(ring, weights, replicas, versions, 1 + versions, relay=True)
    return {"model": model, "model_bytes": layout.nbytes, "replicas": replicas, "versions": versions,
            "cpu": cpu_name(), "direct": direct, "relay": relayed}


def report(result: dict) -> str:
    mb = result["model_bytes"] / 1e6
    lines = [f"{result['model']}: {mb:.0f} MB a version, {result['replicas']} replicas on one host ({result['cpu']})"]
    for arm in ("direct", "relay"):
        r = result[arm]
        lines.append(f"  {arm:6s} ({r['replica_transport']}): {statistics.median(r['egress_bytes_per_version']) / 1e6:.0f} "
                     f"MB from the trainer's ring a version, {r['median_s']:.2f} s publish to all loaded (median)")
    return "\n".join(lines)


def run(model: str, replicas: int, versions: int) -> dict:
    return asyncio.run(bench_relay(model, replicas, versions))
