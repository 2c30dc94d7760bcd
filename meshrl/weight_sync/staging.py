"""How a trainer rank's shard of the weights gets into its weight ring, per device (`weight_sync.staging`).

A publish's copy runs in a thread of its own while the actor goes on with the next forward and
backward (meshrl/actors/trainer.py). On the CPU that thread copies the weights straight into the
ring's memory (`pageable`). From CUDA the same copy would be a device-to-host copy into pageable
memory on the default stream, which serialises with the forward and backward queued there. So on
CUDA (`pinned`) the copy goes in two parts:

1. on the thread that ran the optimizer step, right after it: an event on the device's current
   stream marks the weights that step made (`start`);
2. in the copy thread: a side `torch.cuda.Stream` waits for that event (not for later work on the
   default stream), copies the shard device-to-host into pinned staging memory (allocated once,
   sized to this rank's shard; a cast to the served dtype happens on the GPU first), records an
   event and waits for it; then a CPU memcpy from the staging into the ring (`finish`).

The next optimizer update waits for the whole copy (the trainer's `_published`), so nothing writes
the weights while the side stream reads them; the source tensors are also `record_stream`ed on the
side stream, so memory the caching allocator hands back is not reused before the copy ends.

`measure_publish` times both routes and their overlap with a forward and backward on a GPU: it is
what `meshrl check gpu` reports for the publish.
"""

import threading
import time
from typing import Callable

import torch

from meshrl.weight_sync import STAGINGS, WeightLayout



def resolve_staging(staging: str, device: torch.device | str) -> str:
    """`weight_sync.staging` on a trainer on `device`: auto is pinned on CUDA and pageable elsewhere;
    pinned needs a CUDA trainer (pinned memory and streams are CUDA's)."""
    if staging not in STAGINGS:
        raise ValueError(f"unknown weight_sync.staging {staging!r}; known: {', '.join(STAGINGS)}")
    on_cuda = torch.device(device).type == "cuda"
    if staging == "auto":
        return "pinned" if on_cuda else "pageable"
    if staging == "pinned" and not on_cuda:
        raise ValueError(f"weight_sync.staging pinned stages a CUDA trainer's weights; this trainer is on {device}: "
                         "use auto or pageable")
    return staging


class PageableCopy:
    """The weights themselves go to the ring: the copy thread reads them as they are."""

    def start(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return weights

    def finish(self, started: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return started


class PinnedStaging:
    """A CUDA rank's shard staged in pinned host memory by a side stream (see the module's docstring)."""

    def __init__(self, layout: WeightLayout, device: torch.device):
        """`layout`: this rank's rows of every published tensor, in the dtype the ring holds."""
        self.device = torch.device(device)
        self.buffer = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8, pin_memory=True)
        self.views = dict(layout.unpack(self.buffer))
        self.stream = torch.cuda.Stream(self.device)

    def start(self, weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
        """On the thread that made the weights, before anything else is queued: mark them as made."""
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(self.device))
        return weights, made

    def finish(self, started: tuple[dict[str, torch.Tensor], torch.cuda.Event]) -> dict[str, torch.Tensor]:
        """In the copy thread: the weights marked by `start`, in the pinned staging once this returns (views of
        it, valid until the next `finish`)."""
        weights, made = started
        with torch.no_grad(), torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(made)  # the optimizer step that made them, not the forward queued since
            for name, view in self.views.items():
                source = weights[name]
                view.copy_(source, non_blocking=True)
                source.record_stream(self.stream)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        copied.synchronize()  # this thread only: the default stream goes on
        return self.views


def staging_for(staging: str, layout: WeightLayout, device: torch.device) -> PageableCopy | PinnedStaging:
    """The copy route `weight_sync.staging` names for a rank on `device` with this shard `layout`."""
    if resolve_staging(staging, device) == "pinned":
        return PinnedStaging(layout, device)
    return PageableCopy()


def measure_publish(weights: dict[str, torch.Tensor], step: Callable[[], object] | None = None,
                    dtype: torch.dtype = torch.bfloat16, repeats: int = 3) -> dict:
    """For `meshrl check gpu`: a publish of `weights` (CUDA tensors: one rank's shard, e.g. a model's
    `state_dict()`) into a real shared-memory weight ring holding `dtype`, by each route, timed warm
    (best of `repeats`), and alongside `step` (a forward and backward on the default stream, as the
    trainer runs while a publish copies). Needs CUDA; no Monarch (the ring is not registered for RDMA).

    Returns a dict: `bytes` (the ring's payload); `pageable_gbps` (the copy thread's device-to-host
    copy straight into the ring, today's CPU route) and `pinned_d2h_gbps` (the side stream's copy
    into pinned staging, CUDA events) and `pinned_gbps` (the whole pinned publish: D2H, then the memcpy
    into the ring, wall clock); with `step`: `step_s` (alone, CUDA events), and per route
    `step_with_{route}_s` (the step while that publish runs in a thread) and `overlap_{route}`
    ((step + publish - both together) / the shorter of the two, within [0, 1]: 1 is full overlap, 0 serial)."""
    from meshrl.weight_sync.ring import WeightRing

    device = next(iter(weights.values())).device
    if device.type != "cuda":
        raise ValueError(f"measure_publish times CUDA copies; these weights are on {device}")
    layout = WeightLayout.of({name: (tuple(t.shape), dtype) for name, t in weights.items()})
    ring = WeightRing(layout, slots=2, register=False)
    routes = {"pageable": PageableCopy(), "pinned": PinnedStaging(layout, device)}
    version = 0

    def publish(route) -> float:
        nonlocal version
        version += 1
        started = route.start(weights)
        begin = time.perf_counter()
        ring.publish(route.finish(started), version)
        return time.perf_counter() - begin

    out = {"bytes": layout.nbytes}
    torch.cuda.synchronize(device)
    for name, route in routes.items():
        publish(route)  # warm: staging pages, the ring's pages, the allocator
        seconds = min(publish(route) for _ in range(repeats))
        out[f"{name}_gbps"] = layout.nbytes / seconds / 1e9
    pinned = routes["pinned"]
    d2h = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        with torch.no_grad(), torch.cuda.stream(pinned.stream):
            begin.record()
            for name, view in pinned.views.items():
                view.copy_(weights[name], non_blocking=True)
            end.record()
        end.synchronize()
        d2h.append(begin.elapsed_time(end) / 1e3)
    out["pinned_d2h_gbps"] = layout.nbytes / min(d2h) / 1e9
    if step is None:
        return out

    def timed_step() -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    timed_step()  # warm
    out["step_s"] = step_s = min(timed_step() for _ in range(repeats))
    for name, route in routes.items():
        publish_s = layout.nbytes / out[f"{name}_gbps"] / 1e9
        together, alongside = [], []
        for _ in range(repeats):
            version += 1
            torch.cuda.synchronize(device)
            started = route.start(weights)
            begin = time.perf_counter()
            copier = threading.Thread(target=lambda s=started, v=version: ring.publish(route.finish(s), v))
            copier.start()
            alongside.append(timed_step())
            copier.join()
            torch.cuda.synchronize(device)
            together.append(time.perf_counter() - begin)
        out[f"step_with_{name}_s"] = min(alongside)
        both = min(together)
        out[f"overlap_{name}"] = min(1.0, max(0.0, (step_s + publish_s - both) / min(step_s, publish_s)))
    return out
