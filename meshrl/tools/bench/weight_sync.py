"""`meshrl bench weight-sync`: the weight ring against its floors, all measured in one run.

memcpy (a torch copy of the same bytes) is the floor for the shared-memory path; the best raw read
of the same bytes with 1, 2, 4, 8 or 16 concurrent `RDMABuffer.read_into` streams is the floor for the
RDMA path; transfers are timed warm, best of the repeats. Then the real trainer publishes into its
ring (one ring its ranks share, this being one host; for each rank count asked), this process reads it
as a generator does (nothing else running), a real vLLM generator pulls and loads (publish, ring read and vLLM load timed apart), and a stress phase counts torn reads while the
trainer publishes as fast as it can (the stress driver of tests/support/: the stress phase runs from a repository
checkout, meshrl/tools/bench/checkout.py). Last, the same publish-to-loaded with a LoRA adapter (`--lora-rank`)
in place of the whole model: the adapter's bytes, and vLLM loading it in place.
"""

import asyncio
import statistics
import time

import torch
from monarch.actor import Actor, endpoint

from meshrl.actors import first, in_rank_order, spawn, spawn_ranks
from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.generator_config import GeneratorConfig
from meshrl.actors.trainer import TitanTrainer
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.models.lora import LoraConfig
from meshrl.models.model import resolve_checkpoint
from meshrl.tools.bench.checkout import from_checkout
from meshrl.weight_sync import WeightSyncConfig, published_weights
from meshrl.weight_sync.shards import ShardedReader

STREAMS = (1, 2, 4, 8, 16)


class ByteSource(Actor):
    """`nbytes` of memory: what a raw RDMA read, with no ring, reads from."""

    def __init__(self, nbytes: int):
        self.bytes = torch.ones(nbytes, dtype=torch.uint8)

    @endpoint
    async def buffers(self, streams: int) -> list:
        """The bytes as `streams` registered buffers of consecutive chunks."""
        from monarch.rdma import RDMABuffer

        return [RDMABuffer(chunk) for chunk in self.bytes.chunk(streams)]


class FloorGenerator(VLLMGenerator):
    """The real generator, and the floor of its loads: vLLM reloading tensors already in its process."""

    @endpoint
    async def reload_floor_s(self, repeats: int) -> float:
        copies = []
        await self.ring.load_latest(lambda _, weights: copies.append([(n, t.clone()) for n, t in weights]))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.reload(copies[-1])
            times.append(time.perf_counter() - start)
        return statistics.median(times)


async def _best_seconds(repeats: int, fn) -> float:
    """The fastest of `repeats` timed calls of `fn`, after two untimed ones: a transfer's figure, warm (the
    first reads over Monarch's TCP fallback open connections, and later ones vary by 2x on a shared machine)."""
    for _ in range(2):
        await fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return min(times)


async def bench_weight_sync(model: str = "smollm2", repeats: int = 5, stress_seconds: float = 10.0,
                            rank_counts: tuple[int, ...] = (1, 2), lora_rank: int = 16) -> dict:
    from monarch.rdma import get_rdma_backend

    stress = from_checkout("weight_stress").stress_ring if stress_seconds > 0 else None  # before any figure
    checkpoint = str(resolve_checkpoint(model))
    layout, to_hf = published_weights(checkpoint)  # the whole model, whatever the ranks
    nbytes = layout.nbytes
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    result = {"model": model, "bytes": nbytes, "rdma_backend": get_rdma_backend(), "repeats": repeats}

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)

    async def memcpy():
        dst.copy_(src)

    result["memcpy_gbps"] = gbps(await _best_seconds(repeats, memcpy))

    source_procs, source = spawn("byte_source", ByteSource, nbytes)
    for streams in STREAMS:
        buffers = await source.buffers.call_one(streams)
        chunks = dst.chunk(streams)

        async def read():
            await asyncio.gather(*(b.read_into(c) for b, c in zip(buffers, chunks)))

        result[f"raw_rdma_{streams}_streams_gbps"] = gbps(await _best_seconds(repeats, read))
    result["raw_rdma_gbps"] = max(result[f"raw_rdma_{s}_streams_gbps"] for s in STREAMS)
    await source_procs.stop()

    for ranks in rank_counts:
        figures = await _ring_figures(checkpoint, layout, to_hf, ranks, repeats, gbps)
        if stress:
            figures.update(await _stress(stress, checkpoint, ranks, stress_seconds))
        figures["ring_rdma_vs_raw"] = figures["ring_rdma_gbps"] / result["raw_rdma_gbps"]
        figures["ring_shm_vs_memcpy"] = figures["ring_shm_gbps"] / result["memcpy_gbps"]
        result[f"ranks_{ranks}"] = figures
    if lora_rank:
        result["lora"] = await _adapter_figures(checkpoint, LoraConfig(rank=lora_rank), repeats)
        result["lora"]["publish_to_loaded_vs_full"] = (result["lora"]["publish_to_loaded_s"]
                                                       / result[f"ranks_{rank_counts[0]}"]["publish_to_loaded_s"])
    return result


async def _ring_figures(checkpoint: str, layout, to_hf, ranks: int, repeats: int, gbps) -> dict:
    """The real trainer's ring on `ranks` ranks, read whole by this process over each transport: over
    RDMA into its landing buffer (the floor: the raw read), over shared memory into the reader's own
    memory, as a generator's read copies it before its load (the floor: one memcpy);
    then publish-to-loaded into a real vLLM generator, with its parts: the trainer's publish, the
    generator's ring read, and the rest (vLLM's load)."""
    figures, procs = {}, []
    try:
        sync = WeightSyncConfig()
        trainer_procs, trainer = await spawn_ranks("trainer", TitanTrainer, ranks,
                                                   TrainerConfig(num_threads=1, ranks=ranks), sync, checkpoint)
        procs.append(trainer_procs)
        rings = await in_rank_order(trainer.weight_ring.call())
        await trainer.publish_weights.call()
        for transport in ("rdma", "shm"):
            # either way the transfer ends with the bytes checked in the reader's own memory (the read
            # copies a version out of the rings before any load), as the raw read's and a memcpy's do
            reader = ShardedReader(rings, layout, to_hf, transport)
            figures[f"ring_{transport}_gbps"] = gbps(await _best_seconds(
                repeats, lambda: reader.load_latest(lambda version, weights: None)))

        generator_procs, generator = spawn("generator", FloorGenerator, GeneratorConfig(weight_update="drain", num_threads=1), sync,
                                           checkpoint)
        procs.append(generator_procs)
        figures["generator_transport"] = await generator.attach_weights.call_one(rings)  # once it is up
        figures.update(await _publish_to_loaded(trainer, generator, repeats))
        figures["vllm_reload_floor_s"] = await generator.reload_floor_s.call_one(repeats)
    finally:
        for p in procs:
            await p.stop()
    return figures


async def _publish_to_loaded(trainer, generator, repeats: int) -> dict:
    """The median of `repeats` publishes each pulled and loaded by `generator`, and its parts: the trainer's
    publish, the generator's ring read, and the rest (vLLM's load)."""
    totals, publishes = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        version = await first(trainer.publish_weights.call())
        publishes.append(time.perf_counter() - start)
        if await generator.pull_weights.call_one() != version:
            raise RuntimeError("the generator did not serve the version just published")
        totals.append(time.perf_counter() - start)
    pulls = (await generator.weight_updates.call_one())["pulls"][-repeats:]
    return {"publish_to_loaded_s": statistics.median(totals), "publish_s": statistics.median(publishes),
            "generator_read_s": statistics.median(p["read_s"] for p in pulls),
            "generator_load_s": statistics.median(p["end"] - p["start"] - p["read_s"] for p in pulls)}


async def _adapter_figures(checkpoint: str, lora: LoraConfig, repeats: int) -> dict:
    """A LoRA trainer (one rank) publishing its adapter, a LoRA generator loading each into vLLM in place:
    the adapter's bytes and its publish-to-loaded, as for the whole model."""
    procs = []
    try:
        sync = WeightSyncConfig()
        trainer_procs, trainer = spawn("lora_trainer", TitanTrainer, TrainerConfig(num_threads=1, lora=lora), sync,
                                       checkpoint)
        procs.append(trainer_procs)
        generator_procs, generator = spawn("lora_generator", VLLMGenerator, GeneratorConfig(weight_update="drain", num_threads=1), sync,
                                           checkpoint, lora)
        procs.append(generator_procs)
        transport = await generator.attach_weights.call_one([await trainer.weight_ring.call_one()])
        await trainer.publish_weights.call_one()  # warm: the first load also sizes vLLM's buffers
        await generator.pull_weights.call_one()
        layout, _ = published_weights(checkpoint, sync.dtype, lora)
        return {"rank": lora.rank, "bytes": layout.nbytes, "generator_transport": transport,
                **await _publish_to_loaded(trainer, generator, repeats)}
    finally:
        for p in procs:
            await p.stop()


async def _stress(stress_ring, checkpoint: str, ranks: int, seconds: float) -> dict:
    """With checksums: the trainer's ranks step and publish flat out while two generators pull (`stress_ring`)."""
    procs = []
    try:
        sync = WeightSyncConfig(checksums=True)
        trainer_procs, trainer = await spawn_ranks("stress_trainer", TitanTrainer, ranks,
                                                   TrainerConfig(lr=1e-4, num_threads=1, ranks=ranks), sync, checkpoint)
        procs.append(trainer_procs)
        generators = []
        for i in range(2):
            p, g = spawn(f"stress_generator{i}", VLLMGenerator, GeneratorConfig(weight_update="drain", num_threads=1), sync, checkpoint)
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
    ("ring_shm_vs_memcpy", ">= 0.6", lambda r: r["ring_shm_vs_memcpy"] >= 0.6),
    ("publish_to_loaded_s", "<= 0.2", lambda r: r["publish_to_loaded_s"] <= 0.2),
    ("torn_reads_loaded", "== 0", lambda r: r["torn_reads_loaded"] == 0),
]


def report(result: dict) -> str:
    lines = [f"weight sync, {result['model']}: {result['bytes'] / 1e6:.1f} MB, RDMA backend {result['rdma_backend']}",
             f"  {'memcpy_gbps':22s} {result['memcpy_gbps']:8.3f} GB/s"]
    for streams in STREAMS:
        lines.append(f"  raw_rdma_{streams}_streams_gbps{'':4s} {result[f'raw_rdma_{streams}_streams_gbps']:8.3f} GB/s")
    for key in (k for k in result if k.startswith("ranks_")):
        r = result[key]
        lines.append(f"  trainer {key.replace('_', ' ')}:")
        for figure in ("ring_rdma_gbps", "ring_shm_gbps"):
            lines.append(f"    {figure:20s} {r[figure]:8.3f} GB/s")
        lines.append(f"    {'publish_to_loaded_s':20s} {r['publish_to_loaded_s']:8.3f} s "
                     f"(median of {result['repeats']}, generator over {r['generator_transport']}): publish "
                     f"{r['publish_s']:.3f} s, ring read {r['generator_read_s']:.3f} s, vLLM load "
                     f"{r['generator_load_s']:.3f} s (vLLM reloading tensors it holds: {r['vllm_reload_floor_s']:.3f} s)")
        if "stress" in r:
            lines.append(f"    {'torn_reads_detected':20s} {r['torn_reads_detected']:8d}   torn_reads_loaded "
                         f"{r['torn_reads_loaded']} ({r['stress']['versions_published']} versions in "
                         f"{r['stress']['seconds']:.0f} s of stress)")
        for figure, target, passes in (t for t in TARGETS if t[0] in r):
            lines.append(f"    target {figure} {target}: {r[figure]:.3f} {'ok' if passes(r) else 'MISSED'}")
    if "lora" in result:
        r = result["lora"]
        lines.append(f"  a LoRA adapter of rank {r['rank']} instead (one rank): {r['bytes'] / 1e6:.2f} MB, "
                     f"{r['bytes'] / result['bytes']:.1%} of the model")
        lines.append(f"    {'publish_to_loaded_s':20s} {r['publish_to_loaded_s']:8.3f} s (median of {result['repeats']}, "
                     f"generator over {r['generator_transport']}): publish {r['publish_s']:.3f} s, ring read "
                     f"{r['generator_read_s']:.3f} s, vLLM load {r['generator_load_s']:.3f} s; "
                     f"{r['publish_to_loaded_vs_full']:.2f} x the whole model's")
    return "\n".join(lines)


def run(model: str, repeats: int, stress_seconds: float, rank_counts: tuple[int, ...] = (1, 2),
        lora_rank: int = 16) -> dict:
    return asyncio.run(bench_weight_sync(model, repeats, stress_seconds, rank_counts, lora_rank))
