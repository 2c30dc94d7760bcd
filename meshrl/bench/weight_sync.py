"""`meshrl bench weight-sync`: the weight ring against its floors, all measured in one run.

memcpy (a torch copy of the same bytes) is the floor for the shared-memory path; one raw
`RDMABuffer.read_into` of the same bytes is the floor for the RDMA path. Then the real trainer
publishes into its rings (one per rank, for each rank count asked) and a real vLLM generator pulls
and loads, and a stress phase counts torn reads while the trainer publishes as fast as it can.
"""

import asyncio
import statistics
import time

import torch
from monarch.actor import Actor, endpoint

from meshrl.actors import first, in_rank_order, spawn, spawn_ranks
from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.trainer import TitanTrainer
from meshrl.configs import GeneratorConfig, TrainerConfig, WeightSyncConfig
from meshrl.model import published_weights, resolve_checkpoint
from meshrl.weight_sync.shards import ShardedReader
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


async def bench_weight_sync(model: str = "smollm2", repeats: int = 5, stress_seconds: float = 10.0,
                            rank_counts: tuple[int, ...] = (1, 2)) -> dict:
    from monarch.rdma import get_rdma_backend

    checkpoint = str(resolve_checkpoint(model))
    layout, to_hf = published_weights(checkpoint)  # the whole model, whatever the ranks
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

    for ranks in rank_counts:
        figures = await _ring_figures(checkpoint, layout, to_hf.to_hf, ranks, repeats, gbps)
        figures.update(await _stress(checkpoint, ranks, stress_seconds))
        figures["ring_rdma_vs_raw"] = figures["ring_rdma_gbps"] / result["raw_rdma_gbps"]
        figures["ring_shm_vs_memcpy"] = figures["ring_shm_gbps"] / result["memcpy_gbps"]
        result[f"ranks_{ranks}"] = figures
    return result


async def _ring_figures(checkpoint: str, layout, to_hf, ranks: int, repeats: int, gbps) -> dict:
    """The real trainer's rings on `ranks` ranks, read whole by this process over each transport (every
    rank's shard, assembled as a generator does), then publish-to-loaded into a real vLLM generator."""
    figures, procs = {}, []
    try:
        sync = WeightSyncConfig()
        trainer_procs, trainer = await spawn_ranks("trainer", TitanTrainer, ranks,
                                                   TrainerConfig(num_threads=1, ranks=ranks), sync, checkpoint)
        procs.append(trainer_procs)
        generator_procs, generator = spawn("generator", VLLMGenerator, GeneratorConfig(num_threads=1), sync,
                                           checkpoint)
        procs.append(generator_procs)
        rings = await in_rank_order(trainer.weight_ring.call())
        await trainer.publish_weights.call()
        for transport in ("rdma", "shm"):
            reader = ShardedReader(rings, layout, to_hf, transport)
            figures[f"ring_{transport}_gbps"] = gbps(await _median_seconds(repeats, reader.pull_latest))

        figures["generator_transport"] = await generator.attach_weights.call_one(rings)
        publish_times = []
        for _ in range(repeats):
            start = time.perf_counter()
            version = await first(trainer.publish_weights.call())
            if await generator.pull_weights.call_one() != version:
                raise RuntimeError("the generator did not serve the version just published")
            publish_times.append(time.perf_counter() - start)
        figures["publish_to_loaded_s"] = statistics.median(publish_times)
    finally:
        for p in procs:
            await p.stop()
    return figures


async def _stress(checkpoint: str, ranks: int, seconds: float) -> dict:
    """With checksums: the trainer's ranks step and publish flat out while two generators pull."""
    procs = []
    try:
        sync = WeightSyncConfig(checksums=True)
        trainer_procs, trainer = await spawn_ranks("stress_trainer", TitanTrainer, ranks,
                                                   TrainerConfig(lr=1e-4, num_threads=1, ranks=ranks), sync, checkpoint)
        procs.append(trainer_procs)
        generators = []
        for i in range(2):
            p, g = spawn(f"stress_generator{i}", VLLMGenerator, GeneratorConfig(num_threads=1), sync, checkpoint)
            procs.append(p)
            generators.append(g)
        rings = await in_rank_order(trainer.weight_ring.call())
        for g in generators:
            await g.attach_weights.call_one(rings)
        stress = await stress_ring(trainer, generators, seconds, ranks)
    finally:
        for p in procs:
            await p.stop()
    return {"torn_reads_detected": stress["torn_reads_detected"], "torn_reads_loaded": stress["torn_reads_loaded"],
            "stress": {"seconds": seconds, "versions_published": stress["versions_published"],
                       "versions_loaded_per_generator": [len(v) for v in stress["versions_loaded"]]}}


TARGETS = [  # (metric, target, passes)
    ("ring_rdma_vs_raw", ">= 0.8", lambda r: r["ring_rdma_vs_raw"] >= 0.8),
    ("ring_shm_vs_memcpy", ">= 0.5", lambda r: r["ring_shm_vs_memcpy"] >= 0.5),
    ("publish_to_loaded_s", "<= 0.5", lambda r: r["publish_to_loaded_s"] <= 0.5),
    ("torn_reads_loaded", "== 0", lambda r: r["torn_reads_loaded"] == 0),
]


def report(result: dict) -> str:
    lines = [f"weight sync, {result['model']}: {result['bytes'] / 1e6:.1f} MB, RDMA backend {result['rdma_backend']}",
             f"  {'memcpy_gbps':22s} {result['memcpy_gbps']:8.3f} GB/s",
             f"  {'raw_rdma_gbps':22s} {result['raw_rdma_gbps']:8.3f} GB/s"]
    for key in (k for k in result if k.startswith("ranks_")):
        r = result[key]
        lines.append(f"  trainer {key.replace('_', ' ')}:")
        for figure in ("ring_rdma_gbps", "ring_shm_gbps"):
            lines.append(f"    {figure:20s} {r[figure]:8.3f} GB/s")
        lines.append(f"    {'publish_to_loaded_s':20s} {r['publish_to_loaded_s']:8.3f} s "
                     f"(median of {result['repeats']}, generator over {r['generator_transport']})")
        lines.append(f"    {'torn_reads_detected':20s} {r['torn_reads_detected']:8d}   torn_reads_loaded "
                     f"{r['torn_reads_loaded']} ({r['stress']['versions_published']} versions in "
                     f"{r['stress']['seconds']:.0f} s of stress)")
        for figure, target, passes in TARGETS:
            lines.append(f"    target {figure} {target}: {r[figure]:.3f} {'ok' if passes(r) else 'MISSED'}")
    return "\n".join(lines)


def run(model: str, repeats: int, stress_seconds: float, rank_counts: tuple[int, ...] = (1, 2)) -> dict:
    return asyncio.run(bench_weight_sync(model, repeats, stress_seconds, rank_counts))
