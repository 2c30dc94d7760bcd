"""Trainer -> generator weight transfer.

Both sides agree on a `WeightLayout`: the policy's HF-named tensors packed back to back in one
flat byte buffer, in the dtype the generator loads. A mismatch is an error naming the tensor,
never a silent misread. `ring.py` moves such buffers from the trainer to the generators.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from meshrl.checks import AUTO_ON_OFF, at_least, one_of
from meshrl.models.lora import LoraConfig, PeftNames, base_of, is_adapter
from meshrl.models.model import build_policy, read_hf_config

RING_TRANSPORTS = ("auto", "rdma", "shm")  # how a reader reaches a ring (ring.py): auto picks shm on the ring's host
STAGINGS = ("auto", "pinned", "pageable")  # how a trainer rank's shard reaches its ring (staging.py)
MEMORIES = ("auto", "host", "device")  # where the ring's slots live (device_ring.py)


@dataclass
class WeightSyncConfig:
    """The `weight_sync` section: the versioned weight ring from the trainer to the generators."""

    slots: int = 2  # versions the trainer's ring holds; readers of the newest never race the writer
    transport: str = "auto"  # auto (shared memory on the trainer's host, else rdma) | shm | rdma | disk (no ring: the plain path, each version saved as a file and loaded from it; a baseline)
    chunk_mb: int = 16  # RDMA reads a slot in chunks of this size, concurrently
    checksums: bool = False  # CRC32 every published version and verify the generator's copy before loading it (stress tests); forced on where the ring's seqlock cannot be ordered (no libatomic fence on a CPU other than x86: meshrl/weight_sync/ordering.py)
    timeout_s: float = 300.0  # one generator's pull of a version (read and load): past it the replica is replaced
    dtype: str = "auto"  # what versions are published in: auto (the dtype the generators serve) | bfloat16 | float32
    poll_s: float = 0.05  # in_flight and recompute: how often a generating replica looks for a newer version
    verify: bool = False  # also write each version to disk_dir and have every generator load it a second time from there and compare every tensor vLLM holds (meshrl/weight_sync/verify.py)
    disk_dir: str = ""  # disk and verify: where the versions' files go, on a filesystem the trainer and the generators share; "": RUN_DIR/weights
    relay: str = "auto"  # a relay on each generator host pulls each version once from the trainer's rings and its replicas read it there over shared memory (meshrl/weight_sync/relay.py): auto (on where a generator host runs 2+ replicas and the generators are not on the trainer's hosts) | on | off
    memory: str = "auto"  # where the ring's slots live: host (shared host memory) | device (the trainer's GPUs; generators on its host load from them by CUDA IPC, device to device, and those on other hosts read them by Monarch RDMA, meshrl/weight_sync/device_ring.py; on the CPU a memfd stands in) | auto (device where the GPU plan puts the trainer on one host's GPUs and the generators beside it, else host)
    staging: str = "auto"  # how a trainer rank's shard reaches its ring: auto (pinned on CUDA, pageable on the CPU) | pinned (device-to-host on a side CUDA stream into pinned memory, then a memcpy: the next forward and backward run meanwhile) | pageable (straight from the weights into the ring's memory, in the copy thread)

    def check(self) -> None:
        at_least(self, "weight_sync", slots=1, chunk_mb=1)
        one_of(self, "weight_sync", transport=RING_TRANSPORTS + ("disk",),
               dtype=("auto", "bfloat16", "float32", "float16"), staging=STAGINGS, relay=AUTO_ON_OFF, memory=MEMORIES)
        if self.memory == "device" and self.transport not in ("auto", "rdma"):
            raise ValueError(f"weight_sync.memory device is read by CUDA IPC on the trainer's host and by RDMA on "
                             f"others, not by {self.transport}: use weight_sync.transport auto")
        if self.transport == "disk" and self.relay == "on":
            raise ValueError("weight_sync.relay republishes the trainer's ring: it needs one (weight_sync.transport "
                             "auto, shm or rdma)")
        if self.transport == "disk" and self.verify:
            raise ValueError("weight_sync.verify checks the ring's loads against the disk path: it needs a ring "
                             "(weight_sync.transport auto, shm or rdma)")


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in bytes, into the flat buffer

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * (torch.Size(self.shape).numel())


@dataclass(frozen=True)
class WeightLayout:
    specs: tuple[TensorSpec, ...]

    @staticmethod
    def of(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> "WeightLayout":
        """Lay tensors out back to back, each aligned to 64 bytes, in name order."""
        specs, offset = [], 0
        for name in sorted(shapes):
            shape, dtype = shapes[name]
            spec = TensorSpec(name, dtype, tuple(shape), offset)
            specs.append(spec)
            offset += -(-spec.nbytes // 64) * 64
        return WeightLayout(tuple(specs))

    @staticmethod
    def of_tensors(weights: dict[str, torch.Tensor]) -> "WeightLayout":
        return WeightLayout.of({name: (tuple(t.shape), t.dtype) for name, t in weights.items()})

    @property
    def nbytes(self) -> int:
        last = self.specs[-1]
        return last.offset + last.nbytes

    def check_matches(self, expected: "WeightLayout") -> None:
        """Raise LayoutError naming the first tensor whose name, shape or dtype differs."""
        mine = {s.name: s for s in self.specs}
        theirs = {s.name: s for s in expected.specs}
        for name in sorted(mine.keys() | theirs.keys()):
            if name not in mine:
                raise LayoutError(f"weight layout mismatch: {name} is missing from the published weights")
            if name not in theirs:
                raise LayoutError(f"weight layout mismatch: {name} is not a weight of the receiving model")
            a, b = mine[name], theirs[name]
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                raise LayoutError(f"weight layout mismatch: {name} is {a.dtype}{list(a.shape)}, "
                                  f"expected {b.dtype}{list(b.shape)}")

    def pack(self, weights: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        """Copy `weights` into the flat uint8 buffer `out`, cast to the layout's dtypes."""
        dtypes = {s.name: s.dtype for s in self.specs}
        cast = {k: (tuple(v.shape), dtypes.get(k, v.dtype)) for k, v in weights.items()}
        WeightLayout.of(cast).check_matches(self)
        for spec in self.specs:
            self.view(out, spec).copy_(weights[spec.name])

    def unpack(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Zero-copy (name, tensor) views into a flat uint8 buffer."""
        return [(spec.name, self.view(buffer, spec)) for spec in self.specs]

    @staticmethod
    def view(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
        return buffer[spec.offset:spec.offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def published_weights(checkpoint: Path, dtype: str = "auto", lora: LoraConfig | None = None):
    """What the trainer publishes (torchtitan's names and full shapes, in `dtype`: the one the generators
    serve, "auto" for the checkpoint's; a tied LM head once, as the embedding) and the function that maps
    those tensors to the names the generators load (HF's). With `lora`, the adapter's tensors only, to
    PEFT's names. The model is built on the meta device: shapes only, no memory."""
    hf_config = read_hf_config(checkpoint)
    with torch.device("meta"):
        model, adapter = build_policy(hf_config, lora)
    if dtype == "auto":
        dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    dtype = getattr(torch, dtype)
    state = model.state_dict(keep_vars=True)
    if lora is not None and lora.rank:
        names = [name for name in state if is_adapter(name)]
        to_hf = PeftNames(names, {base_of(n): tuple(state[base_of(n)].shape) for n in names}, adapter)
        return WeightLayout.of({name: (tuple(state[name].shape), dtype) for name in names}), to_hf
    shapes, seen = {}, set()
    for name, t in state.items():
        if id(t) not in seen:  # a tied LM head is the embedding: published once, under the first name
            seen.add(id(t))
            shapes[name] = (tuple(t.shape), dtype)
    return WeightLayout.of(shapes), adapter.to_hf
