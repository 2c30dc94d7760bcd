"""How a trainer rank's shard reaches its ring (meshrl/weight_sync/staging.py): the route each device gets,
the CPU's route being today's straight copy, and (on a GPU only) the pinned staging's ordering after the
work that made the weights."""

import pytest
import torch

from meshrl.weight_sync import WeightLayout
from meshrl.weight_sync.ring import WeightRing
from meshrl.weight_sync.staging import PageableCopy, PinnedStaging, measure_publish, resolve_staging, staging_for


@pytest.mark.parametrize("staging, device, route", [
    ("auto", "cuda", "pinned"), ("auto", "cuda:3", "pinned"), ("auto", "cpu", "pageable"),
    ("pageable", "cuda", "pageable"), ("pinned", "cuda:1", "pinned"), ("pageable", "cpu", "pageable")])
def test_staging_is_pinned_on_cuda_and_pageable_on_the_cpu(staging, device, route):
    assert resolve_staging(staging, device) == route


def test_pinned_staging_on_the_cpu_or_an_unknown_staging_is_one_clear_error():
    with pytest.raises(ValueError, match="pinned stages a CUDA trainer's weights; this trainer is on cpu"):
        resolve_staging("pinned", "cpu")
    with pytest.raises(ValueError, match="unknown weight_sync.staging 'paged'; known: auto, pinned, pageable"):
        resolve_staging("paged", "cpu")


def test_a_cpu_trainer_copies_its_weights_straight_into_the_ring():
    """On the CPU the copy thread gets the weights themselves (no staging copy) and the ring holds them."""
    weights = {"a": torch.arange(12, dtype=torch.float32).view(3, 4), "b": torch.ones(5)}
    layout = WeightLayout.of({name: (tuple(t.shape), torch.bfloat16) for name, t in weights.items()})
    route = staging_for("auto", layout, torch.device("cpu"))
    assert isinstance(route, PageableCopy)
    handed = route.finish(route.start(weights))
    assert all(handed[name] is weights[name] for name in weights)
    ring = WeightRing(layout, register=False)
    ring.publish(handed, 1)
    payload = dict(layout.unpack(ring.payloads[1]))
    assert torch.equal(payload["a"], weights["a"].bfloat16()) and torch.equal(payload["b"], weights["b"].bfloat16())


def test_measuring_a_publish_needs_cuda_weights():
    with pytest.raises(ValueError, match="measure_publish times CUDA copies; these weights are on cpu"):
        measure_publish({"w": torch.ones(4)})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pinned_staging_copies_the_weights_the_queued_update_makes_and_the_ring_gets_them():
    """The side stream waits for the work queued before `start` (a long product, then the update writing
    the weights), not for what is queued after it; the staging then holds the updated weights exactly,
    and so does the ring a reader reads."""
    device = torch.device("cuda")
    weights = {"w": torch.zeros(4096, 1024, device=device), "v": torch.zeros(333, device=device)}
    layout = WeightLayout.of({name: (tuple(t.shape), torch.bfloat16) for name, t in weights.items()})
    staging = staging_for("auto", layout, device)
    assert isinstance(staging, PinnedStaging) and staging.buffer.is_pinned()
    ring = WeightRing(layout, slots=2, register=False)  # no Monarch needed on a GPU machine
    x = torch.randn(4096, 4096, device=device)
    for version in (1, 2):
        for _ in range(20):  # the update's inputs take a while on the default stream
            x = torch.tanh(x @ x) / 64
        weights["w"].copy_(x[:, :1024] + version)  # the update, queued last before the publish
        weights["v"].fill_(version)
        started = staging.start(weights)
        later = x @ x  # the next forward, queued after the publish: the copy need not wait for it
        ring.publish(staging.finish(started), version)
        expected = {name: t.to(torch.bfloat16).cpu() for name, t in weights.items()}
        assert all(torch.equal(staging.views[name], expected[name]) for name in weights)
        in_ring = dict(layout.unpack(ring.payloads[version % 2]))
        assert ring.header[version % 2, 0].tolist()[2] == version
        assert all(torch.equal(in_ring[name], expected[name]) for name in weights)
        del later
