"""`meshrl check gpu --json OUT`: the trainer's GPU paths run on this machine, with what it has, and every
figure written to OUT (and a table on stdout). Issue 53 item 5; what it has run on, docs/gpu.md.

Sections, in the order they run (each its own module here, each `run(check) -> dict`, `report(result)`):
parity (loss and gradients CPU vs the device, fp32 and bf16 autocast, four model kinds), endpoints (the
trainer actor on 1 rank in a process group of world 1, FSDP2: load, logprobs, forward_backward,
optim_step, publish_weights into a real ring read back), memory (peak memory at 4k, 8k, 16k tokens a
micro-batch, the memory switches off and on), mfu (a ~1B model at 8k tokens), publish (device-to-host
rates and the overlap with a forward and backward), weights (the weight ring in device memory between a
writer and a reader process, CUDA IPC, at Qwen3-1.7B's, 4B's and 8B's shapes), smoke (`meshrl train --config
smoke` where vLLM and Monarch are installed; elsewhere, and in the dry mode, a few asynchronous RL steps in this
process with the torch generator over the stand-ins: torch_loop.py).

Without CUDA (or with --dry) it runs in a dry mode: the same code on the CPU at tiny sizes, the sections
that need CUDA said skipped, in well under a minute (tests/test_check_gpu.py runs it). What the machine
lacks (Monarch, or a torch name torchtitan imports) is stood in for (standins.py) and the output says so.
A section that fails or raises is recorded and the next one runs; the exit code is 1 if any did.
"""

import asyncio
import json
import os
import platform
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

SECTIONS = ("parity", "endpoints", "memory", "mfu", "publish", "weights", "smoke")


def add_parser(sub) -> None:
    """`meshrl check gpu` on the command line's subcommands `sub`."""
    check = sub.add_parser("check", help="check a machine for meshrl").add_subparsers(dest="check", required=True)
    gpu = check.add_parser("gpu", help="the trainer's GPU paths on this machine, every figure to --json (docs/gpu.md)")
    gpu.add_argument("--json", type=Path, required=True, help="where to write the figures")
    gpu.add_argument("--dry", action="store_true", help="the dry mode: tiny sizes on the CPU, CUDA-only parts "
                                                        "skipped (the default without CUDA)")
    gpu.add_argument("--sections", default=",".join(SECTIONS), help="which sections, comma separated, of: "
                                                                   + ", ".join(SECTIONS))
    gpu.add_argument("--stand-ins", action="store_true", help="stand in for Monarch even where it is installed "
                                                              "(as on a machine without it)")
    gpu.add_argument("--smoke-timeout", type=float, default=240.0, help="seconds the smoke section's `meshrl train` "
                                                                        "subprocess may take")


@dataclass
class Check:
    """What every section is given: where it runs, at which sizes, and what the sections share."""

    device: object  # torch.device: cuda, or cpu in the dry mode
    dry: bool
    tmp: Path  # scratch: checkpoints the check builds, the smoke run's directory
    smoke_timeout: float = 240.0
    cache: dict = field(default_factory=dict)  # what one section built that a later one reuses
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)

    def run(self, coroutine):
        """An endpoint's coroutine (standins.call) run to its end on the check's event loop."""
        return self.loop.run_until_complete(coroutine)

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, coroutine) -> tuple[object, float]:
        """(result, seconds) of an endpoint's coroutine, the device's queued work included."""
        self.sync()
        start = time.perf_counter()
        result = self.run(coroutine)
        self.sync()
        return result, time.perf_counter() - start


def command(args) -> int:
    """The `meshrl check gpu` command: 0 when no section failed."""
    from meshrl.tools.checks import standins

    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise ValueError(f"--sections: unknown {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    stood_in = standins.install(force_monarch=args.stand_ins)  # before anything imports meshrl.actors or torchtitan
    import tempfile

    with tempfile.TemporaryDirectory(prefix="meshrl-check-gpu-") as tmp:
        result = run(chosen, args.dry, Path(tmp), stood_in, args.smoke_timeout)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(report(result))
    print(f"figures: {args.json}")
    return 0 if result["passed"] else 1


def run(chosen: list[str], dry: bool, tmp: Path, stood_in: list[str], smoke_timeout: float = 240.0) -> dict:
    import importlib

    import torch

    from meshrl.tools.checks import standins

    dry = dry or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda", None if dry else torch.cuda.current_device())
    check = Check(device, dry, tmp, smoke_timeout)
    start = time.perf_counter()
    out = {"check": "gpu", "dry": dry, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": machine(device), "stood_in": stood_in,
           "installed": {m: standins.available(m) for m in ("vllm", "monarch", "torchtitan")}, "sections": {}}
    try:
        for name in SECTIONS:
            if name not in chosen:
                continue
            if name != "parity":  # after parity (one rank, no group): a process group of world 1, FSDP2 applies
                init_group(device)
            module = importlib.import_module(f"meshrl.tools.checks.{name}")
            began = time.perf_counter()
            try:
                section = module.run(check)
            except Exception as e:  # noqa: BLE001 - recorded as the section's error; the next section runs
                section = {"status": "error", "error": f"{type(e).__name__}: {e}",
                           "traceback": traceback.format_exc().splitlines()}
            section["seconds"] = round(time.perf_counter() - began, 2)
            out["sections"][name] = section
            print(f"check gpu: {name}: {section['status']} ({section['seconds']} s)", flush=True)
    finally:
        check.loop.close()
        end_group()
    out["seconds"] = round(time.perf_counter() - start, 2)
    out["passed"] = all(s["status"] not in ("fail", "error") for s in out["sections"].values())
    return out


def machine(device) -> dict:
    import torch

    from meshrl.actors import cpu_name

    info = {"host": platform.node(), "cpu": cpu_name(), "cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                 "cuda": torch.version.cuda, "sm": f"{props.major}.{props.minor}"}
    return info


def init_group(device) -> None:
    """A torch.distributed group of one rank (NCCL on CUDA, gloo on the CPU), as a trainer of several
    ranks joins: with it the trainer shards its model with FSDP2 even on one rank."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)


def end_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def report(result: dict) -> str:
    """The figures as a table to read."""
    import importlib

    m = result["machine"]
    where = m.get("gpu") or f"{m['cpu']} ({m['cpus']} cores, no CUDA)"
    lines = [f"meshrl check gpu{' (dry mode)' if result['dry'] else ''} on {where}: torch {m['torch']}, "
             f"{result['seconds']} s, {'passed' if result['passed'] else 'FAILED'}"]
    for part in result["stood_in"]:
        lines.append(f"  stand-in: {part}")
    for name, section in result["sections"].items():
        lines.append(f"{name:10s} {section['status']:8s} {section['seconds']:7.1f} s  {section.get('reason', '')}")
        if section["status"] == "error":
            lines.append(f"    {section['error']}")
        elif section["status"] != "skipped":
            lines += ["    " + row for row in importlib.import_module(f"meshrl.tools.checks.{name}").report(section)]
    return "\n".join(lines)
