"""Trainer -> generator weight transfer.

Both sides agree on a `WeightLayout`: the policy's HF-named tensors packed back to back in one
flat byte buffer, in the dtype the generator loads. A mismatch is an error naming the tensor,
never a silent misread. `ring.py` moves such buffers from the trainer to the generators.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from meshrl.models.lora import LoraConfig, PeftNames, base_of, is_adapter
from meshrl.models.model import build_policy, read_hf_config


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
