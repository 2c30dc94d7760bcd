"""Section `publish` of `meshrl check gpu`: how fast a publish gets the trainer's weights off the GPU,
and how much of it hides behind the next forward and backward.

- rates (CUDA only): device-to-host GB/s into pageable memory (today's CPU route: the copy thread
  copies straight into the ring) and into pinned staging on a side stream, and each route's overlap
  with a forward and backward on the default stream, timed with CUDA events. Measured by
  meshrl.weight_sync.staging.measure_publish (the trainer's own routes) where this checkout has it,
  else by plain torch (`plain_torch`: `.to("cpu")` against `copy_(non_blocking=True)` into pinned memory
  on a side stream).
- the trainer's own publish_weights run beside its forward_backward (wall clock, on the CPU as well):
  overlap = (alone + alone - together) / the shorter; 1 is full overlap, 0 none (clamped to [0, 1]: a
  publish much shorter than the step, as the tiny model's, is within the step's own noise).
The weights are the ~1B model's (the mfu section's trainer), at 8k tokens a micro-batch.
"""

import threading
import time

from meshrl.tools.checks import standins, workloads

REPEATS = 3


def run(check) -> dict:
    import asyncio

    from meshrl.actors.distributed import local
    from meshrl.models.model import read_hf_config

    checkpoint = workloads.big_model(check)
    trainer = check.cache.pop("big_trainer", None)
    if trainer is None:
        trainer = workloads.trainer(checkpoint, workloads.trainer_config(check.device, True)[0])
    tokens = 256 if check.dry else 8192
    batch = workloads.batch(tokens, read_hf_config(checkpoint)["vocab_size"], seed=5,
                            sequence=tokens // 4 if check.dry else workloads.SEQUENCE)
    out = {"published_dtype": str(trainer.dtype).removeprefix("torch."), "tokens": tokens}
    if check.device.type == "cuda":
        state = trainer.model.state_dict()
        weights = {name: local(state[name]).detach() for name in trainer.published}
        step = lambda: check.run(workloads.on_batch(trainer, "forward_backward", batch))  # noqa: E731
        try:
            from meshrl.weight_sync.staging import measure_publish
        except ImportError:
            out["rates"], out["measured_by"] = plain_torch(weights, step, trainer.dtype), "plain torch"
        else:
            out["rates"] = measure_publish(weights, step, trainer.dtype, REPEATS)
            out["measured_by"] = "meshrl.weight_sync.staging.measure_publish"
        check.run(standins.call(trainer, "drop_gradients"))
    else:
        out["rates"] = None
        out["reason"] = "device-to-host rates: no CUDA (the trainer's publish beside its step still runs)"
    repeats = 2 if check.dry else REPEATS
    fb = min(check.timed(workloads.on_batch(trainer, "forward_backward", batch))[1] for _ in range(repeats))
    publish = min(check.timed(standins.call(trainer, "publish_weights"))[1] for _ in range(repeats))

    async def both():  # a publish, and the next forward_backward while it copies, as Monarch runs them
        await asyncio.gather(standins.call(trainer, "publish_weights"),
                             workloads.on_batch(trainer, "forward_backward", batch))

    together = [check.timed(both())[1] for _ in range(repeats)]
    check.run(standins.call(trainer, "drop_gradients"))
    out["trainer"] = {"forward_backward_s": fb, "publish_weights_s": publish, "together_s": min(together),
                      "overlap": overlap(fb, publish, min(together))}
    out["status"] = "ran"
    del trainer
    workloads.free(check.device)
    return out


def overlap(a: float, b: float, together: float) -> float:
    """How much of the shorter of two pieces of work hid behind the other: 1 all, 0 none."""
    return min(1.0, max(0.0, (a + b - together) / min(a, b)))


def plain_torch(weights: dict, step, dtype, repeats: int = REPEATS) -> dict:
    """Device-to-host rates and overlaps with plain torch (the figures measure_publish gives, where the
    trainer's staging is not in this checkout)."""
    import torch

    cast = {name: t.to(dtype) for name, t in weights.items()}
    nbytes = sum(t.numel() * t.element_size() for t in cast.values())
    pinned = {name: torch.empty(t.shape, dtype=dtype, pin_memory=True) for name, t in cast.items()}
    side = torch.cuda.Stream()

    def pageable():
        return {name: t.to("cpu") for name, t in cast.items()}

    def to_pinned():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for name, t in cast.items():
                pinned[name].copy_(t, non_blocking=True)

    def wall(work) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def events(work, stream) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record(stream)
        work()
        end.record(stream)
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    pageable_s = min(wall(pageable) for _ in range(repeats + 1))
    pinned_s = min(events(to_pinned, side) for _ in range(repeats + 1))
    step_s = min(events(step, torch.cuda.current_stream()) for _ in range(repeats + 1))

    def beside_pageable():
        copier = threading.Thread(target=pageable)
        copier.start()
        step()
        copier.join()

    def beside_pinned():
        to_pinned()
        step()

    out = {"bytes": nbytes, "pageable_gbps": nbytes / pageable_s / 1e9, "pinned_d2h_gbps": nbytes / pinned_s / 1e9,
           "step_s": step_s}
    for name, work, alone in (("pageable", beside_pageable, pageable_s), ("pinned", beside_pinned, pinned_s)):
        both = min(wall(work) for _ in range(repeats))
        out[f"overlap_{name}"] = overlap(step_s, alone, both)
    return out


def report(section: dict) -> list[str]:
    lines = []
    r = section["rates"]
    if r:
        lines.append(f"{r['bytes'] / 1e9:.2f} GB {section['published_dtype']} ({section['measured_by']}): pageable "
                     f"{r['pageable_gbps']:.1f} GB/s, pinned D2H {r['pinned_d2h_gbps']:.1f} GB/s"
                     + (f", pinned publish {r['pinned_gbps']:.1f} GB/s" if "pinned_gbps" in r else ""))
        lines.append(f"beside a forward+backward of {r.get('step_s', 0):.3f} s: overlap pageable "
                     f"{r.get('overlap_pageable', float('nan')):.2f}, pinned {r.get('overlap_pinned', float('nan')):.2f}")
    t = section["trainer"]
    lines.append(f"trainer: forward_backward {t['forward_backward_s']:.3f} s, publish_weights {t['publish_weights_s']:.3f} s, "
                 f"both at once {t['together_s']:.3f} s: overlap {t['overlap']:.2f}")
    return lines
