"""What the trainer and the reference model do to fit in memory, resolved per device in one place.

Four switches (trainer.activation_checkpointing, trainer.bf16_all_gather, trainer.logprob_chunk_tokens,
reference.dtype) each default to `auto`, which `resolve` turns into a choice from the device alone: a pure
function, so the choice per device is tested here and printed by whoever asks. On CUDA memory is what
limits the model and the tokens per micro-batch, so every saving is on; on the CPU the faster choice is
taken (measured on 2 cores of an AMD EPYC with AVX512-BF16, docs/performance.md "Trainer memory"):
activation checkpointing recomputes each layer's forward (a third more work) for memory a CPU host has
plenty of, so it is off there.

A bf16 reference follows the compute dtype: with bf16 autocast on a device with bf16 math, the matrix
products already run on bf16 copies of the fp32 weights, so the frozen reference can hold those copies
themselves (its linear layers' and experts' weights: its logprobs are bit-identical to the fp32
reference's under autocast); in fp32 compute it would lose precision, and stays off.
bf16 parameter all-gathers (FSDP2's MixedPrecisionPolicy) are on only on CUDA with bf16 compute: they
cast every parameter for the forward, the embedding and the norms too, so the residual stream runs in
bf16, not only the matrix products as under autocast. That is FSDP2's usual recipe where memory and
bandwidth bind, but it moves the policy's logprobs away from an autocast forward's: on 2 CPU ranks of
the tiny Qwen3 the KL to the (autocast) reference was 0.014 a token before any update with them, 0.0
without. The CPU, with memory to spare, keeps fp32 gathers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshrl.checks import AUTO_ON_OFF

if TYPE_CHECKING:  # torch is imported where it is used: the configs read this module's names
    import torch

CHECKPOINTING = ("auto", "off", "full", "selective")  # torchtitan's FullAC and SelectiveAC, or none
REFERENCE_DTYPES = ("auto", "bfloat16", "float32")
DEFAULT_CHUNK_TOKENS = 1024  # positions whose [positions, vocabulary] logits exist at once (0: all of them)


@dataclass(frozen=True)
class MemoryChoice:
    activation_checkpointing: str  # off | full | selective
    all_gather_dtype: str  # FSDP2's param_dtype, bfloat16 | float32 (gradients are always reduced in float32)
    reference_dtype: str  # the frozen reference's weights, bfloat16 | float32

    def torch_dtype(self, which: str) -> torch.dtype:
        """`all_gather_dtype` or `reference_dtype` as a torch dtype."""
        import torch

        return getattr(torch, getattr(self, which))


NO_SAVINGS = MemoryChoice("off", "float32", "float32")  # every switch off: the model as it was loaded


def resolve(device_type: str, bf16_compute: bool, activation_checkpointing: str = "auto",
            bf16_all_gather: str = "auto", reference_dtype: str = "auto") -> MemoryChoice:
    """The switches' values on a device of `device_type` ("cuda", "cpu"), where the forward runs in bf16
    autocast or not (`bf16_compute`: asked for, and the device has bf16 math); "auto" chosen per device."""
    for name, value, known in (("activation_checkpointing", activation_checkpointing, CHECKPOINTING),
                               ("bf16_all_gather", bf16_all_gather, AUTO_ON_OFF),
                               ("dtype", reference_dtype, REFERENCE_DTYPES)):
        if value not in known:
            raise ValueError(f"unknown {name} {value!r}; known: {', '.join(known)}")
    if activation_checkpointing == "auto":
        activation_checkpointing = "full" if device_type == "cuda" else "off"
    gather = bf16_compute and device_type == "cuda" if bf16_all_gather == "auto" else bf16_all_gather == "on"
    reference = bf16_compute if reference_dtype == "auto" else reference_dtype == "bfloat16"
    if reference and not bf16_compute:
        raise ValueError("reference.dtype bfloat16 holds the weights bf16 autocast multiplies with: it needs "
                         "reference.bf16_autocast on a device with bf16 math")
    return MemoryChoice(activation_checkpointing, "bfloat16" if gather else "float32",
                        "bfloat16" if reference else "float32")


def apply_checkpointing(model: torch.nn.Module, mode: str) -> None:
    """torchtitan's activation checkpointing on each of the model's layers (`model.layers`): `full`
    recomputes a layer's whole forward in the backward, `selective` keeps the matrix products'
    outputs (every second one) and recomputes the rest; `off` leaves the model as it is. Before FSDP2,
    as torchtitan applies them; the state dict keeps its names."""
    if mode == "off":
        return
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    policy = {"full": FullAC, "selective": SelectiveAC}[mode]
    # no randomness in a layer's forward (no dropout): no RNG state to save and restore per layer
    policy(policy.Config(preserve_rng_state=False)).apply(model)
