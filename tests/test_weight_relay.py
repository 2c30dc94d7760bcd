"""The weight relay (meshrl/weight_sync/relay.py) on real Monarch actors, on the CPU, with a tiny layout:
the trainer's rings in the test's process (two ranks' rows, read over RDMA as from another host), a relay
in a process of its own, and stand-in replicas reading through it as generators do (`open_reader`). Each
version leaves the trainer's rings once however many replicas read it; a replica asking right after a
publish finds it (the relay pulls on demand); a dead relay leaves its replicas reading the trainer's rings
themselves, and the run's `Relays` start another. Then a run on three test hosts in network namespaces:
the trainer's host sends each version once per generator host."""

import asyncio
import json
import os
import signal
import subprocess
import sys

import monarch.actor
import pytest
import torch
from assertions import read_jsonl
from monarch.actor import Actor, ActorError, endpoint, this_host
from netns_hosts import leftovers, namespace_hosts, usable

from meshrl.actors import spawn
from meshrl.actors.timeouts import Timeouts
from meshrl.configs.named import load_config
from meshrl.models.model import resolve_checkpoint
from meshrl.runtime.jobs import RolePlacement
from meshrl.runtime.relays import Relays
from meshrl.weight_sync import WeightLayout, published_weights
from meshrl.weight_sync.relay import RelayedReader, WeightRelay, full_layout, open_reader, relay_wanted
from meshrl.weight_sync.ring import WeightRing
from meshrl.weight_sync.shards import ShardedReader, shard_layout, shard_rows


def full_weights(version: int) -> dict[str, torch.Tensor]:
    base = torch.arange(50 * 40, dtype=torch.float32).view(50, 40)
    return {"w": base + 1000 * version, "b": torch.arange(30.0) - version, "one": torch.tensor([float(version)])}


LAYOUT = WeightLayout.of_tensors(full_weights(0))
WORLD = 2


def trainer_rings() -> list[WeightRing]:
    """Two trainer ranks on hosts of their own: a ring each, holding the rank's rows."""
    return [WeightRing(shard_layout(LAYOUT, rank, WORLD), slots=2, chunk_mb=1, ranks=(rank, rank + 1), world=WORLD)
            for rank in range(WORLD)]


def publish(rings: list[WeightRing], version: int) -> None:
    for rank, ring in enumerate(rings):
        ring.publish({k: v[slice(*shard_rows(v.shape[0], rank, WORLD))] for k, v in full_weights(version).items()},
                     version)


def version_bytes() -> int:
    """What one version of the rings weighs: every rank's rows as laid out in its ring."""
    return sum(shard_layout(LAYOUT, rank, WORLD).nbytes for rank in range(WORLD))


def to_hf(named: dict) -> dict:
    return {f"hf.{name}": t for name, t in named.items()}


class ReaderReplica(Actor):
    """A stand-in generator replica: attaches and loads as VLLMGenerator does (`open_reader`, `newest`, then
    `load_latest` newer than what it holds), without vLLM."""

    def __init__(self):
        self.reader = None
        self.version = 0

    @endpoint
    async def attach(self, handles: list) -> str:
        self.reader = open_reader(handles, LAYOUT, to_hf, "rdma")
        return self.reader.transport

    @endpoint
    async def load(self) -> tuple[int, dict]:
        """Look for a newer version and load it: (the version now held, each tensor's values if loaded)."""
        got = {}
        if await self.reader.newest() > self.version:
            loaded = await self.reader.load_latest(lambda v, weights: got.update({n: t.tolist() for n, t in weights}),
                                                   newer_than=self.version)
            self.version = loaded or self.version
        return self.version, got

    @endpoint
    async def report(self) -> dict:
        r = self.reader
        return {"transport": r.transport, "trainer_bytes": r.take_trainer_bytes(), "torn": r.torn_reads,
                "corrupt": r.corrupt_reads}


def expected(version: int) -> dict:
    return {f"hf.{n}": t.tolist() for n, t in full_weights(version).items()}


@pytest.mark.parametrize("setting, replicas, hosts, beside_trainer, transport, on", [
    ("auto", 4, 2, False, "auto", True),  # two replicas a host: a relay each
    ("auto", 3, 2, False, "rdma", True),  # the first host runs two
    ("auto", 2, 2, False, "auto", False),  # one replica a host: nothing to share
    ("auto", 4, 1, True, "auto", False),  # on the trainer's host: its ring is read over shared memory already
    ("on", 1, 1, True, "auto", True),
    ("off", 8, 1, False, "auto", False),
    ("on", 4, 2, False, "disk", False),  # no ring to relay
])
def test_the_relay_setting_resolves_per_deployment(setting, replicas, hosts, beside_trainer, transport, on):
    assert relay_wanted(setting, replicas, hosts, beside_trainer, transport) is on


def test_a_bad_relay_setting_is_one_clear_error():
    with pytest.raises(ValueError, match="weight_sync.relay must be one of auto, on, off"):
        relay_wanted("yes", 4, 2, False, "auto")
    with pytest.raises(ValueError, match="weight_sync.relay republishes the trainer's ring"):
        load_config("smoke", ["--weight_sync.relay", "on", "--weight_sync.transport", "disk"]).check()
    with pytest.raises(ValueError, match="weight_sync.relay"):
        load_config("smoke", ["--weight_sync.relay", "yes"]).check()


def test_the_relay_knows_the_whole_model_from_the_ranks_rings_alone():
    assert full_layout([r.handle() for r in trainer_rings()]) == LAYOUT
    assert full_layout([WeightRing(LAYOUT).handle(), None]) == LAYOUT  # one ring, another rank writing into it


@pytest.mark.processes
def test_each_version_leaves_the_trainers_rings_once_for_all_the_replicas_of_a_host():
    async def main():
        rings = trainer_rings()
        relay_procs, relay = spawn("relay", WeightRelay, 2, 1, True, "rdma")
        replica_procs = this_host().spawn_procs(per_host={"procs": 2}, name="replicas")
        replicas = [replica_procs.spawn("replica", ReaderReplica).slice(procs=i) for i in range(2)]
        try:
            handle = await relay.attach.call_one([r.handle() for r in rings])
            assert handle.upstream == "rdma"
            handle.relay = relay
            assert [await r.attach.call_one([handle]) for r in replicas] == ["relay:rdma"] * 2
            assert [await r.load.call_one() for r in replicas] == [(0, {})] * 2  # nothing published yet
            for version in (1, 2, 3):
                publish(rings, version)
                # asked right after the publish, each replica gets the version whole: the relay pulls on demand
                assert [await r.load.call_one() for r in replicas] == [(version, expected(version))] * 2
                assert await relay.egress.call_one() == version_bytes()  # once, for both replicas
            publish(rings, 4)
            publish(rings, 5)  # two versions before anyone looks: only the newest is pulled
            assert [(await r.load.call_one())[0] for r in replicas] == [5, 5]
            assert await relay.egress.call_one() == version_bytes()
            stats = await relay.stats.call_one()
            assert stats["version_bytes"] == {v: version_bytes() for v in (1, 2, 3, 5)}
            assert stats["torn_reads"] == stats["corrupt_reads"] == 0
            # the replicas read the relay's ring on their host, nothing from the trainer's
            assert [await r.report.call_one() for r in replicas] == [
                {"transport": "relay:rdma", "trainer_bytes": 0, "torn": 0, "corrupt": 0}] * 2
        finally:
            await asyncio.gather(replica_procs.stop(), relay_procs.stop())

    asyncio.run(main())


@pytest.mark.processes
def test_replicas_whose_relay_died_read_the_trainers_rings_themselves(monkeypatch):
    monkeypatch.setattr(monarch.actor, "unhandled_fault_hook", lambda failure: None)  # the relay's death is expected

    async def main():
        rings = trainer_rings()
        relay_procs, relay = spawn("relay", WeightRelay, 2, 1, True, "rdma")
        replica_procs, replica = spawn("replica", ReaderReplica)
        try:
            handle = await relay.attach.call_one([r.handle() for r in rings])
            handle.relay = relay
            await replica.attach.call_one([handle])
            publish(rings, 1)
            assert await replica.load.call_one() == (1, expected(1))
            os.kill((await relay.stats.call_one())["pid"], signal.SIGKILL)
            publish(rings, 2)
            # the replica's call to its relay raises (no hang), and it loads the version from the trainer's rings
            assert await asyncio.wait_for(replica.load.call_one(), 120) == (2, expected(2))
            assert await replica.report.call_one() == {"transport": "rdma", "trainer_bytes": version_bytes(),
                                                       "torn": 0, "corrupt": 0}
        finally:
            await replica_procs.stop()
            try:
                await relay_procs.stop()
            except Exception:
                pass

    asyncio.run(main())


class StallingRelay(WeightRelay):
    """Its first pull from the trainer's rings never finishes (a trainer host that stopped answering)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.stalled = False

    def trainer_reader(self, rings, layout):
        reader = super().trainer_reader(rings, layout)
        read = reader.read_latest

        async def stall_once(newer_than=-1):
            if not self.stalled:
                self.stalled = True
                await asyncio.Event().wait()
            return await read(newer_than)

        reader.read_latest = stall_once
        return reader


@pytest.mark.processes
def test_a_relays_pull_that_stalls_fails_within_the_timeout_and_the_next_ask_pulls_again():
    async def main():
        rings = trainer_rings()
        relay_procs, relay = spawn("relay", StallingRelay, 2, 1, True, "rdma", 2.0)
        replica_procs, replica = spawn("replica", ReaderReplica)
        try:
            handle = await relay.attach.call_one([r.handle() for r in rings])
            handle.relay = relay
            await replica.attach.call_one([handle])
            publish(rings, 1)
            with pytest.raises(ActorError, match=r"did not finish within 2 s \(weight_sync.timeout_s\)"):
                await asyncio.wait_for(replica.load.call_one(), 60)
            assert await replica.load.call_one() == (1, expected(1))
        finally:
            await asyncio.gather(replica_procs.stop(), relay_procs.stop())

    asyncio.run(main())


class FakeHosts:
    """A fake of meshrl.runtime.jobs.Hosts: every generator host is this one."""

    def host(self, role: str, index: int):
        return this_host()


@pytest.mark.processes
def test_the_run_starts_another_relay_for_a_replica_whose_relay_died(monkeypatch, tmp_path):
    monkeypatch.setattr(monarch.actor, "unhandled_fault_hook", lambda failure: None)
    config = load_config("smoke", ["--weight_sync.relay", "on", "--weight_sync.transport", "rdma",
                                   "--generator.replicas", "4", "--controller.stop_timeout_s", "30"])
    placement = {"generator": RolePlacement("generators", 2, 2), "trainer": RolePlacement("trainer", 1, 1)}

    async def main():
        rings = trainer_rings()
        relays = Relays(config, placement, FakeHosts(), Timeouts.of(config))
        replica_procs, replica = spawn("replica", ReaderReplica)
        try:
            await relays.start([r.handle() for r in rings])
            assert relays.count == 2 and (await relays.attach_to(1))[0] is relays.handles[1]  # replica 1: host 1
            await replica.attach.call_one(await relays.attach_to(0))
            publish(rings, 1)
            assert (await replica.load.call_one())[0] == 1
            assert await relays.egress() == version_bytes()
            dead = (await relays.handles[0].relay.stats.call_one())["pid"]
            os.kill(dead, signal.SIGKILL)
            # the replica attached anew (a replacement, or after a trainer restart) gets a live relay
            await replica.attach.call_one(await relays.attach_to(0))
            assert (await relays.handles[0].relay.stats.call_one())["pid"] != dead
            publish(rings, 2)
            assert await replica.load.call_one() == (2, expected(2))
            assert await replica.report.call_one() == {"transport": "relay:rdma", "trainer_bytes": 0, "torn": 0,
                                                       "corrupt": 0}
            assert await relays.egress() == version_bytes()
            await relays.stop(tmp_path)
            written = json.loads((tmp_path / "relays.json").read_text())
            assert [(r["host"], r["version_bytes"]) for r in written] == [(0, {"2": version_bytes()}), (1, {})]
        finally:
            await replica_procs.stop()
            await relays.stop()

    asyncio.run(main())


def test_a_relayed_reader_hands_on_its_own_copy_never_the_relays_ring():
    """In one process: the replica's reader copies the relay's ring into memory of its own, as from the
    trainer's (what it checked is what gets loaded)."""
    relay_ring = WeightRing(LAYOUT, slots=2)
    relay_ring.publish(full_weights(1), 1)
    from meshrl.weight_sync.relay import RelayHandle

    reader = RelayedReader(RelayHandle(relay_ring.handle(), None, [], "shm"), LAYOUT, to_hf)
    assert isinstance(reader.local, ShardedReader) and reader.transport == "relay:shm"
    handed = []
    assert asyncio.run(reader.load_latest(lambda _, weights: handed.extend(weights))) == 1
    ring = relay_ring.memory.tensor
    assert handed and not any(ring.data_ptr() <= t.data_ptr() < ring.data_ptr() + ring.numel() for _, t in handed)
    assert reader.take_trainer_bytes() == 0 and reader.local.take_trainer_bytes() == LAYOUT.nbytes


THREE_HOSTS = ["--job.hosts", "trainer:1,generators:2", "--trainer.hosts", "trainer", "--generator.hosts",
               "generators", "--generator.replicas", "4"]


@pytest.mark.processes
@pytest.mark.skipif(bool(usable()), reason=usable())
def test_three_hosts_send_each_version_once_per_generator_host(tmp_path):
    """The trainer on one host, two generator hosts with two replicas each (weight_sync.relay auto): the
    trainer's host sends 2 x the model's bytes per version, and the generators load every version whole."""
    run_dir = tmp_path / "run"
    with namespace_hosts(3, tmp_path) as hosts:
        result = subprocess.run(
            [sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
             "--controller.steps", "3", "--weight_sync.checksums", "true", "--job.kind", "workers",
             "--job.workers", ",".join(hosts.addresses), "--job.bind", hosts.bind, *hosts.job_args, *THREE_HOSTS],
            capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
    assert not leftovers(hosts), leftovers(hosts)
    placement = json.loads((run_dir / "placement.json").read_text())
    generators = {name: p for name, p in placement.items() if name.startswith("generator")}
    assert len(generators) == 4 and {p["weight_transport"] for p in generators.values()} == {"relay:rdma"}
    assert sorted(p["host"] for p in generators.values()) == sorted(hosts.names[1:] * 2)
    config = json.loads((run_dir / "config.json").read_text())
    published = json.loads((run_dir / "summary.json").read_text())["dtypes"].get("weight_sync", {}).get("dtype")
    model_bytes = published_weights(resolve_checkpoint(config["model"]["source"]),
                                    published or config["weight_sync"]["dtype"])[0].nbytes
    relays = json.loads((run_dir / "relays.json").read_text())
    assert len(relays) == 2 and all(r["torn_reads"] == r["corrupt_reads"] == 0 for r in relays)
    per_version: dict[str, int] = {}
    for relay in relays:
        for version, sent in relay["version_bytes"].items():
            per_version[version] = per_version.get(version, 0) + sent
    assert per_version == {str(v): 2 * model_bytes for v in (1, 2, 3)}
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["policy_version"] == 3
    # the step rows' weight_bytes_egress: whole pulls by the relays (the replicas read none from the trainer), at
    # most one a version and host; the last version's pulls may come after the last row (the final eval's)
    egress = [r["weight_bytes_egress"] for r in rows]
    assert all(e % model_bytes == 0 for e in egress) and 0 < sum(egress) <= 2 * 3 * model_bytes, egress
    # every pull loaded a whole version (checksums on: each verified before vLLM loaded it), every version was pulled
    pulls = [s for s in read_jsonl(run_dir / "trace.jsonl") if s["what"] == "pull"]
    assert {s["policy_version"] for s in pulls} == {1, 2, 3}

