"""The flat weight layout both sides of the transfer agree on (pure logic, no transport)."""

import pytest
import torch

from meshrl.weight_sync import LayoutError, WeightLayout


def weights():
    return {"b.weight": torch.randn(3, 5, dtype=torch.bfloat16), "a.weight": torch.randn(7, dtype=torch.bfloat16)}


def test_pack_unpack_round_trip_with_aligned_offsets():
    w = weights()
    layout = WeightLayout.of_tensors(w)
    assert [s.name for s in layout.specs] == ["a.weight", "b.weight"]
    assert all(s.offset % 64 == 0 for s in layout.specs)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack(w, buffer)
    out = dict(layout.unpack(buffer))
    assert out.keys() == w.keys()
    assert all(torch.equal(out[k], w[k]) for k in w)


def test_pack_casts_fp32_master_weights_to_the_layout_dtype():
    w = weights()
    layout = WeightLayout.of_tensors(w)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack({k: v.float() for k, v in w.items()}, buffer)
    assert all(torch.equal(v, w[k]) for k, v in layout.unpack(buffer))


@pytest.mark.parametrize("change, message", [
    (lambda w: w.pop("a.weight"), "a.weight is missing"),
    (lambda w: w.update(extra=torch.zeros(1, dtype=torch.bfloat16)), "extra is not a weight"),
    (lambda w: w.update({"b.weight": torch.zeros(5, 3, dtype=torch.bfloat16)}), r"b.weight is torch.bfloat16\[5, 3\]"),
])
def test_layout_mismatch_names_the_tensor(change, message):
    expected = WeightLayout.of_tensors(weights())
    w = weights()
    change(w)
    with pytest.raises(LayoutError, match=message):
        WeightLayout.of_tensors(w).check_matches(expected)
    with pytest.raises(LayoutError, match=message):
        expected.pack(w, torch.zeros(expected.nbytes, dtype=torch.uint8))


def test_dtype_mismatch_is_an_error_for_the_receiver():
    w = weights()
    with pytest.raises(LayoutError, match=r"a.weight is torch.float32\[7\], expected torch.bfloat16\[7\]"):
        WeightLayout.of_tensors({k: v.float() for k, v in w.items()}).check_matches(WeightLayout.of_tensors(w))
