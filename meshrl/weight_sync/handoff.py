"""A version a generator replica has read, handed to its vLLM workers in other processes without a file.

With `generator.tensor_parallel_size` > 1 vLLM runs one worker process per GPU of the replica. A
version used to reach them as a safetensors file in /dev/shm: every tensor cloned, the whole model
written, then read by every worker (three full copies, on the event loop; and a container's /dev/shm
is 64 MB). Now each worker maps the memory the generator's reader copied the version into (memfd:
anonymous shared memory of the generator's process, which /dev/shm's size does not bound) and hands
vLLM's `reload_weights` views of it; vLLM's weight loaders then copy only that worker's slice of each
tensor to its device. The tensors the state-dict adapter made anew (Llama's q/k rows reordered per
head, a merged LoRA layer's weight) are packed once into a spill buffer of the same kind.

The route is vLLM's own hook for RL weight updates: a worker extension (`worker_extension_cls`,
`SharedWeightsWorker` below, mixed into each worker) called through `collective_rpc` with plain data
(regions and offsets: no pickled callables, no VLLM_ALLOW_INSECURE_SERIALIZATION). vLLM's
weight-transfer engines (vllm/distributed/weight_transfer/: `ipc`, `nccl`, `sharded_rdt`) move a
trainer's GPU tensors (CUDA IPC handles, an NCCL group joined with the trainer, Ray); here the
version is already in the replica's host memory, which every worker can map.

The workers read views of the reader's memory, which the next read overwrites: the generator hands a
version over and the next read starts only once every worker has loaded it (its `loading` lock).
"""

import mmap
import os

import torch

from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync.ring import SharedMemory

Region = tuple  # (pid, fd, nbytes) of a memfd mapping, as SharedMemory.region() gives it, or a CUDA IPC region
Entry = tuple[str, int, int, str, tuple[int, ...]]  # (name, region index, byte offset, dtype, shape)


def locate(tensor: torch.Tensor, memory: list[torch.Tensor]) -> tuple[int, int] | None:
    """(index into `memory`, byte offset) of the flat uint8 buffer that `tensor` is a contiguous view of
    (its bytes all within it), or None."""
    if not tensor.is_contiguous():
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    for index, buffer in enumerate(memory):
        base = buffer.data_ptr()
        if base <= start and end <= base + buffer.numel():
            return index, start - base
    return None


def handoff_plan(weights: list[tuple[str, torch.Tensor]],
                 memory: list[torch.Tensor]) -> tuple[list[Entry], WeightLayout | None]:
    """Where a worker mapping `memory` (flat uint8 buffers) finds each of `weights`, in their order: an
    entry per tensor; region len(memory) is the spill buffer, laid out as the returned layout (None:
    every tensor is a contiguous view of `memory`, nothing to spill)."""
    found = {name: locate(tensor, memory) for name, tensor in weights}
    spill = {name: (tuple(t.shape), t.dtype) for name, t in weights if found[name] is None}
    layout = WeightLayout.of(spill) if spill else None
    offsets = {spec.name: spec.offset for spec in layout.specs} if layout else {}
    entries = []
    for name, tensor in weights:
        region, offset = found[name] or (len(memory), offsets[name])
        entries.append((name, region, offset, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
    return entries, layout


class Handoff:
    """Generator side: the message that hands a version to the workers (`SharedWeightsWorker.meshrl_load_shared`)."""

    def __init__(self):
        self.spill: SharedMemory | None = None  # grown once to the spilled tensors' size, then reused

    def message(self, weights: list[tuple[str, torch.Tensor]], memory: list[SharedMemory]) -> dict:
        """{"regions", "tensors"}: the kwargs of `collective_rpc("meshrl_load_shared", ...)`, spilled tensors
        copied into the spill buffer."""
        entries, layout = handoff_plan(weights, [m.tensor for m in memory])
        regions = [m.region() for m in memory]
        if layout is not None:
            if self.spill is None or self.spill.nbytes < layout.nbytes:
                self.spill = SharedMemory.create(max(layout.nbytes, 1))
            spilled = {name for name, region, *_ in entries if region == len(memory)}
            layout.pack({name: t for name, t in weights if name in spilled}, self.spill.tensor)
            regions.append(self.spill.region())
        return {"regions": regions, "tensors": entries}


def view(buffer: torch.Tensor, offset: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor an entry names, as a view of its region's bytes."""
    dtype = getattr(torch, dtype)
    nbytes = dtype.itemsize * torch.Size(shape).numel()
    return buffer[offset:offset + nbytes].view(dtype).view(tuple(shape))


def map_region(region: Region) -> torch.Tensor:
    """Another process's memfd (same host), mapped here as flat bytes (the mapping lives as long as the tensor),
    or its GPU memory, opened by CUDA IPC (a ring in device memory, meshrl/weight_sync/device_ring.py)."""
    if region[0] == "cuda_ipc":
        from meshrl.weight_sync.device_ring import open_region

        return open_region(region)
    pid, fd, nbytes = region
    handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        mapping = mmap.mmap(handle, nbytes)
    finally:
        os.close(handle)  # the mapping keeps the memory
    return torch.frombuffer(mapping, dtype=torch.uint8)


class SharedWeightsWorker:
    """Mixed into each of vLLM's workers (`worker_extension_cls`): loads a handed-over version."""

    def meshrl_load_shared(self, regions: list[Region], tensors: list[Entry]) -> None:
        """Load `tensors` (HF names; views of the generator's shared memory `regions`) with vLLM's
        `reload_weights`; each tensor-parallel worker's weight loaders copy only their own slice."""
        mapped = self.__dict__.setdefault("_meshrl_regions", {})
        for stale in set(mapped) - {tuple(r) for r in regions}:  # a region replaced since: unmapped
            del mapped[stale]
        for region in regions:
            if tuple(region) not in mapped:
                mapped[tuple(region)] = map_region(tuple(region))
        memory = [mapped[tuple(r)] for r in regions]
        weights = ((name, view(memory[region], offset, dtype, shape)) for name, region, offset, dtype, shape in tensors)
        self.reload_weights(weights_iterator=weights)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # the copies out of the regions are done when this returns: a ring in GPU memory is checked after
            torch.cuda.synchronize()
