"""`meshrl bench weight-sync`: the weight ring against its floors, all measured in one run.

memcpy (a torch copy of the same bytes) is the floor for the shared-memory path; one raw
`RDMABuffer.read_into` of the same bytes is the floor for the RDMA path. Then the real trainer
publishes into its ring and a real vLLM generator pulls and loads, and a stress phase counts
torn reads while the trainer publishes as fast as it can.
"""

import asyncio
import statistics
import time

import torch
from monarch.actor import Actor, endpoint

from meshrl.actors import spawn
from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.trainer import TitanTrainer
from meshrl.configs import GeneratorConfig, TrainerConfig, WeightSyncConfig
from meshrl.model import load_hf_weights, resolve_checkpoint
from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync.ring import RingReader
from meshrl.weight_sync.stress import stress_ring


class ByteSource(Actor):
    """One registered buffer of `nbytes`: what a raw RDMA read, with no ring, reads from."""

    def __init__(self, nbytes: int):
        self.bytes = torch.ones(nbytes, dtype=torch.uint8)

    @endpoint
    async def buffer(self):
        from monarch.rdma import RDMABuffer

        return RDMABuffer(self.bytes)


async def _median_seconds(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def bench_weight_sync(model: str = "smollm2", repeats: int = 5, stress_seconds: float = 10.0) -> dict:
    from monarch.rdma import get_rdma_backend

    checkpoint = str(resolve_checkpoint(model))
    layout = WeightLayout.of_tensors(load_hf_weights(checkpoint))
    nbytes = layout.nbytes
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    result = {"model": model, "bytes": nbytes, "rdma_backend": get_rdma_backend(), "repeats": repeats}

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)

    async def memcpy():
        dst.copy_(src)

    result["memcpy_gbps"] = gbps(await _median_seconds(repeats, memcpy))

    source_procs, source = spawn("byte_source", ByteSource, nbytes)
    raw = await source.buffer.call_one()
    result["raw_rdma_gbps"] = gbps(await _median_seconds(repeats, lambda: raw.read_into(dst)))
    await source_procs.stop()

    # The real trainer's ring, read by this process over each transport, then pulled into vLLM.
    procs = []
    try:
        sync = WeightSyncConfig()
        trainer_procs, trainer = spawn("trainer", TitanTrainer, TrainerConfig(num_threads=1), sync, checkpoint)
        generator_procs, generator = spawn("generator", VLLMGenerator, GeneratorConfig(num_threads=1), sync,
                                           checkpoint)
        procs += [trainer_procs, generator_procs]
        ring = await trainer.weight_ring.call_one()
        await trainer.publish_weights.call_one()
        for transport in ("rdma", "shm"):
            reader = RingReader(ring, layout, transport)
            result[f"ring_{transport}_gbps"] = gbps(await _median_seconds(repeats, reader.pull_latest))

        result["generator_transport"] = await generator.attach_weights.call_one(ring)
        publish_times = []
        for _ in range(repeats):
            start = time.perf_counter()
            version = await trainer.publish_weights.call_one()
            if await generator.pull_weights.call_one() != version:
                raise RuntimeError("the generator did not serve the version just published")
            publish_times.append(time.perf_counter() - start)
        result["publish_to_loaded_s"] = statistics.median(publish_times)
    finally:
        for p in procs:
            await p.stop()

    # Stress with checksums: the trainer steps and publishes flat out while two generators pull.
    procs = []
    try:
        sync = WeightSyncConfig(checksums=True)
        trainer_procs, trainer = spawn("stress_trainer", TitanTrainer, TrainerConfig(lr=1e-4, num_threads=1),
                                       sync, checkpoint)
        procs.append(trainer_procs)
        generators = []
        for i in range(2):
            p, g = spawn(f"stress_generator{i}", VLLMGenerator, GeneratorConfig(num_threads=1), sync, checkpoint)
            procs.append(p)
            generators.append(g)
        ring = await trainer.weight_ring.call_one()
        for g in generators:
            await g.attach_weights.call_one(ring)
        stress = await stress_ring(trainer, generators, stress_seconds)
    finally:
        for p in procs:
            await p.stop()
    result["torn_reads_detected"] = stress["torn_reads_detected"]
    result["torn_reads_loaded"] = stress["torn_reads_loaded"]
    result["stress"] = {"seconds": stress_seconds, "versions_published": stress["versions_published"],
                        "versions_loaded_per_generator": [len(v) for v in stress["versions_loaded"]]}
    result["ring_rdma_vs_raw"] = result["ring_rdma_gbps"] / result["raw_rdma_gbps"]
    result["ring_shm_vs_memcpy"] = result["ring_shm_gbps"] / result["memcpy_gbps"]
    return result


TARGETS = [  # (metric, target, passes)
    ("ring_rdma_vs_raw", ">= 0.8", lambda r: r["ring_rdma_vs_raw"] >= 0.8),
    ("ring_shm_vs_memcpy", ">= 0.5", lambda r: r["ring_shm_vs_memcpy"] >= 0.5),
    ("publish_to_loaded_s", "<= 0.5", lambda r: r["publish_to_loaded_s"] <= 0.5),
    ("torn_reads_loaded", "== 0", lambda r: r["torn_reads_loaded"] == 0),
]


def report(result: dict) -> str:
    lines = [f"weight sync, {result['model']}: {result['bytes'] / 1e6:.1f} MB, RDMA backend {result['rdma_backend']}"]
    for key in ("memcpy_gbps", "raw_rdma_gbps", "ring_rdma_gbps", "ring_shm_gbps"):
        lines.append(f"  {key:22s} {result[key]:8.3f} GB/s")
    lines.append(f"  {'publish_to_loaded_s':22s} {result['publish_to_loaded_s']:8.3f} s "
                 f"(median of {result['repeats']}, generator over {result['generator_transport']})")
    lines.append(f"  {'torn_reads_detected':22s} {result['torn_reads_detected']:8d}   "
                 f"{'torn_reads_loaded'} {result['torn_reads_loaded']} "
                 f"({result['stress']['versions_published']} versions in {result['stress']['seconds']:.0f} s of stress)")
    for key, target, passes in TARGETS:
        lines.append(f"  target {key} {target}: {result[key]:.3f} {'ok' if passes(result) else 'MISSED'}")
    return "\n".join(lines)


def run(model: str, repeats: int, stress_seconds: float) -> dict:
    return asyncio.run(bench_weight_sync(model, repeats, stress_seconds))
