"""A version handed to vLLM's workers in other processes without a file (meshrl/weight_sync/handoff.py):
where each tensor is found (a view of the reader's shared memory, or spilled once), and a worker in another
process (a fake of vLLM's, recording what `reload_weights` gets) mapping the generator's memory and loading
exactly the tensors handed over, from a real ring read; and the generator's swap through the workers
running off its event loop while its engine waits (a fake engine). Last, real vLLM with two CPU workers
(tensor parallel size 2) loading through it."""

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
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


@pytest.mark.processes
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


class FakeEngine:
    """vLLM's engine as the generator's driver sees it: 40 steps of work, each noted if taken during a swap."""

    def __init__(self):
        self.steps, self.during_swap, self.swapping = 0, 0, False

    def has_unfinished_requests(self) -> bool:
        return self.steps < 40

    def step(self) -> list:
        time.sleep(0.005)  # 0.2 s of steps in all: the swap starts while some are left
        self.steps += 1
        self.during_swap += self.swapping
        return []


def generator_with(through_workers: bool):
    """A VLLMGenerator's swap and driver on a fake engine, its reload taking 0.3 s and noting whether new
    requests were admitted meanwhile."""
    from meshrl.actors.generator import VLLMGenerator
    from meshrl.actors.weight_updates import WeightUpdates

    generator = VLLMGenerator.__new__(VLLMGenerator)
    generator.engine, generator.book, generator.running = FakeEngine(), WeightUpdates(), {}
    generator.update, generator.ring, generator.adapter = "in_flight", None, None
    generator.through_workers, generator.swapped = through_workers, asyncio.Event()
    generator.swapped.set()
    generator.admitted_during_swap = []

    def reload(weights):
        generator.engine.steps_before_swap = generator.engine.steps
        generator.engine.swapping = True
        time.sleep(0.3)
        generator.admitted_during_swap.append(generator.book.admitting.is_set())
        generator.engine.swapping = False

    generator.reload = reload
    return generator


@pytest.mark.parametrize("through_workers", [True, False])
def test_a_swap_into_workers_runs_off_the_event_loop_and_the_engine_waits_for_it(through_workers):
    """Through the workers (tensor parallelism) the swap runs in a thread: the event loop answers other work
    meanwhile, while the driver takes no engine step and no request is admitted; then the driver goes on.
    Into the one worker in the process (size 1) it runs on the event loop between two steps, as before."""
    generator = generator_with(through_workers)

    async def run():
        driver = asyncio.create_task(generator._drive())
        await asyncio.sleep(0)
        ticks = []

        async def tick():
            while True:
                ticks.append(generator.engine.swapping)
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        await generator._swap([])
        ticking.cancel()
        await driver
        return sum(ticks)

    ticks_during_swap = asyncio.run(run())
    engine = generator.engine
    assert engine.steps == 40 and engine.during_swap == 0 and 0 < engine.steps_before_swap < 40
    if through_workers:
        assert ticks_during_swap >= 5 and generator.admitted_during_swap == [False]
    else:
        assert ticks_during_swap == 0


def tensor_parallel_replica_loads() -> dict:
    """Run in a process of its own (vLLM's workers are its children): a replica of tiny Qwen3 with tensor
    parallel size 2 (two CPU workers, one core each), greedy tokens before any load, after a handoff whose
    norms are doubled (made anew: spilled) and after a handoff of the checkpoint's own weights (all views)."""
    import glob
    import os

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per worker (vLLM's auto-binding wants a NUMA node each)
    from safetensors.torch import load_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from meshrl.actors.engine import start_vllm
    from meshrl.actors.generator import HANDOFF_WORKER
    from meshrl.models.model import resolve_checkpoint
    from meshrl.weight_sync.ring import SharedMemory

    checkpoint = str(resolve_checkpoint("tiny_qwen3"))
    llm = start_vllm(checkpoint, dtype="bfloat16", max_model_len=256, memory_fraction=0.0, seed=0, num_threads=1,
                     cpus="", kv_cache_gib=1, tensor_parallel_size=2, worker_extension_cls=HANDOFF_WORKER)

    def greedy() -> list[int]:
        out = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    hf = {name: t for path in sorted(glob.glob(f"{checkpoint}/*.safetensors")) for name, t in load_file(path).items()}
    layout = WeightLayout.of_tensors(hf)
    memory = SharedMemory.create(layout.nbytes)
    layout.pack(hf, memory.tensor)
    read = layout.unpack(memory.tensor)  # as a reader's copy: views of shared memory
    handoff, result = Handoff(), {"before": greedy()}
    doubled = [(name, 2 * t if "norm" in name else t) for name, t in read]
    message = handoff.message(doubled, [memory])
    result["spilled"] = sorted(name for name, region, *_ in message["tensors"] if region == 1)
    llm.collective_rpc("meshrl_load_shared", kwargs=message)
    result["doubled"] = greedy()
    llm.collective_rpc("meshrl_load_shared", kwargs=handoff.message(read, [memory]))
    result["restored"] = greedy()
    result["norms"] = sorted(name for name in hf if "norm" in name)
    return result


@pytest.mark.processes
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two CPU workers need two cores")
def test_a_tensor_parallel_replica_of_two_cpu_workers_loads_each_handoff():
    """Real vLLM with tensor parallel size 2 (two worker processes, vLLM's multiprocessing executor): a
    handoff with the norms doubled changes the greedy tokens; a handoff of the checkpoint's own weights
    brings back exactly the tokens of the start, so each worker loaded its own slices right, from views of
    the generator's memory and from the spill buffer."""
    tests = os.path.dirname(__file__)
    code = "import json, test_weight_handoff as t; print('RESULT', json.dumps(t.tensor_parallel_replica_loads()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=tests, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["spilled"] == result["norms"] and result["norms"]
    assert result["doubled"] != result["before"] and result["restored"] == result["before"], result
