"""Tolerances from the numerics, in one place: how far a loss or gradient computed in fp32 (or partly bf16) may
lie from the same computation in float64, and the norm-wise check against such a reference. A bound from
the dtypes' unit roundoffs holds on every CPU (AMD EPYC, Intel Xeon with or without AMX), where a tolerance
read off one CPU's results did not."""

import torch

FP32_U, BF16_U = 2.0 ** -24, 2.0 ** -8  # unit roundoffs
VOCAB = 49152  # SmolLM2's tokenizer: every tiny model's


def rounding_bound(source: str) -> float:
    """Norm-wise relative distance allowed between an fp32 computation and its float64 reference. In fp32 the
    longest sum is the log-softmax over the vocabulary (N terms); its rounding error grows as sqrt(N)·u with
    high probability (Higham and Mary, 2019), every shorter sum's less. torchtitan's MoE experts cast their
    grouped products to bf16 whatever the model's dtype (fp32 accumulation): each product's two inputs
    rounded to bf16 adds 2·u_bf16."""
    fp32 = VOCAB ** 0.5 * FP32_U
    return fp32 + 2 * BF16_U if source.endswith("_moe") else fp32


def assert_within(got, reference, bound: float):
    """`got` and `reference` are (loss, {name: gradient}): the loss and each gradient of `got` within `bound`
    of `reference`'s, norm-wise relative per tensor (an element-wise comparison would hold entries that are
    sums cancelling to near 0 to their own size)."""
    (loss, grads), (ref_loss, ref_grads) = got, reference
    assert grads.keys() == ref_grads.keys() and grads
    for name, value, ref in [("loss", loss, ref_loss), *((n, grads[n], ref_grads[n]) for n in grads)]:
        value, ref = torch.as_tensor(value).double(), torch.as_tensor(ref).double()
        error = float((value - ref).norm() / ref.norm().clamp_min(1e-300))
        assert error <= bound, f"{name}: {error:.3g} from the reference (bound {bound:.3g})"
