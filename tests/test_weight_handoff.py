"""A version handed to vLLM's workers in other processes without a file (meshrl/weight_sync/handoff.py):
where each tensor is found (a view of the reader's shared memory, or spilled once), and a worker in another
process (a fake of vLLM's, recording what `reload_weights` gets) mapping the generator's memory and loading
exactly the tensors handed over, from a real ring read."""

import asyncio
import multiprocessing

import torch

from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync.handoff import Handoff, SharedWeightsWorker, handoff_plan
from meshrl.weight_sync.ring import WeightRing
from meshrl.weight_sync.shards import ShardedReader


def test_the_plan_points_at_views_of_the_readers_memory_and_spills_the_rest():
    memory = [torch.zeros(256, dtype=torch.uint8), torch.zeros(128, dtype=torch.uint8)]
    a = memory[0][64:128].view(torch.float32)  # 16 floats at byte 64 of region 0
    b = memory[1][32:96].view(torch.bfloat16).view(4, 8)  # at byte 32 of region 1
    c = torch.ones(3, dtype=torch.float32)  # made anew (an adapter's permuted rows): 12 bytes, spilled
    d = memory[0][:64].view(torch.float32).view(4, 4).t()  # not contiguous: spilled, after c at 64
    e = memory[0][200:256].view(torch.float32)  # 14 floats, the last byte of region 0 included
    entries, spill = handoff_plan([("a", a), ("b", b), ("d", d), ("c", c), ("e", e)], memory)
    assert entries == [("a", 0, 64, "float32", (16,)), ("b", 1, 32, "bfloat16", (4, 8)),
                       ("d", 2, 64, "float32", (4, 4)), ("c", 2, 0, "float32", (3,)), ("e", 0, 200, "float32", (14,))]
    assert [(s.name, s.offset) for s in spill.specs] == [("c", 0), ("d", 64)] and spill.nbytes == 128
    assert handoff_plan([("a", a)], memory)[1] is None  # nothing to spill


class FakeVLLMWorker(SharedWeightsWorker):
    """vLLM's worker as the extension sees it: `reload_weights(weights_iterator=...)`, here recording copies."""

    def __init__(self):
        self.loaded = []

    def reload_weights(self, weights_iterator):
        self.loaded.append({name: tensor.clone() for name, tensor in weights_iterator})


WORKER: list[FakeVLLMWorker] = []  # in the worker process: its one worker, kept between loads


def load_in_the_worker_process(message: dict) -> tuple[dict, int]:
    """In another process: its worker loads `message`; what it got, and how many regions it holds mapped."""
    if not WORKER:
        WORKER.append(FakeVLLMWorker())
    WORKER[0].meshrl_load_shared(**message)
    return WORKER[0].loaded[-1], len(WORKER[0]._meshrl_regions)


def test_a_worker_in_another_process_loads_exactly_what_the_reader_read_and_the_adapter_made():
    """A real ring read by a real reader, its tensors renamed and one made anew (as Llama's q/k rows are):
    the worker in another process gets every tensor bit for bit, the renamed ones straight from the reader's
    shared memory, the made one from the spill buffer; the next version, read once the worker has loaded
    this one (as a generator does), reuses both mappings."""
    full = WeightLayout.of({"q": ((8, 4), torch.bfloat16), "mlp": ((5, 3), torch.bfloat16)})
    ring = WeightRing(full, slots=2)

    def to_hf(state: dict) -> dict:
        return {"hf.q": state["q"].view(2, 4, 4).transpose(0, 1).reshape(8, 4), "hf.mlp": state["mlp"]}

    reader = ShardedReader([ring.handle()], full, to_hf, transport="shm")
    handoff, regions, loaded = Handoff(), [], []
    with multiprocessing.get_context("spawn").Pool(1) as worker:
        for version in (1, 2):
            ring.publish({"q": torch.arange(32.0).view(8, 4) * version, "mlp": -torch.arange(15.0).view(5, 3)},
                         version)
            _, weights = asyncio.run(reader.read_latest())
            message = handoff.message(weights, reader.memory())
            assert [entry[:2] for entry in message["tensors"]] == [("hf.q", 1), ("hf.mlp", 0)]  # 1: the spill
            got, mapped = worker.apply(load_in_the_worker_process, (message,))
            assert mapped == 2 and list(got) == ["hf.q", "hf.mlp"]
            assert all(torch.equal(got[name], tensor) for name, tensor in weights)
            regions.append(message["regions"])
            loaded.append(got)
    assert regions[0] == regions[1]  # the spill buffer is kept, not grown, and the worker maps nothing new
    assert torch.equal(loaded[1]["hf.q"], 2 * loaded[0]["hf.q"]) and loaded[1]["hf.q"].abs().sum() > 0
