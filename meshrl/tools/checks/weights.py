"""Section `weights` of `meshrl check gpu`: the weight ring in device memory (meshrl/weight_sync/device_ring.py)
between two processes on one GPU, at real model sizes, as a run on one host moves each version.

Why: the device ring replaces the host ring's six host copies with one device-to-device copy into the ring
and one out of it, through CUDA IPC, and the CPU's tests run it only on the memfd standing in for GPU memory.
Here a writer process (a trainer rank: its weights, the ring's slots, `DeviceMark` and `publish` in a copy
thread, as meshrl/actors/trainer.py) and a reader process (a vLLM replica: the ring opened by CUDA IPC,
`load_latest` handing it views of the ring that it copies into its preallocated "engine weights", as vLLM's
weight loaders do) are spawned fresh, driven from the check's process over a socket, and killed if anything
fails or stalls.

What it measures, per shape (random bf16 weights of Qwen3-1.7B's, Qwen3-4B's and Qwen3-8B's tensors, the
151,936-token vocabulary), averaged over the versions after a warm-up:
- publish: the writer's copy into the slot; load: the reader's copy out of the ring into its engine
  weights; end to end: from the publish's start to the reader holding the version (it polls the header
  meanwhile, as a generator does), over processes (CLOCK_MONOTONIC is the host's); each as GB/s;
- bit-equal read-back: a digest of every engine tensor after each load equals the writer's of its source
  tensors (`digest`: each 16-bit word times a weight from its position, so any changed or moved bits
  show), and the version read is the one published; torn reads (0 expected) and checksum failures;
- overlap: in the writer, a forward and backward of a plain bf16 MLP (repeated to take about as long as
  the publish) alone, the publish alone, and both at once (the publish on the ring's side stream, ordered
  by DeviceMark, the MLP on the default stream): (alone + alone - together) / the shorter, as publish.py;
- the ring's GPU memory: slots x bytes, and what the writer's allocator took for it.
A shape the GPU has too little free memory for is skipped with a line saying so. In the dry mode (no
CUDA) the same two processes run the same code on the memfd stand-in at tiny sizes (`tiny`); its figures
are the CPU's, not a GPU's.
"""

import gc
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from meshrl.models.shapes import PUBLISHED
SHAPES = {name.lower(): PUBLISHED[name] for name in ("Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B")}  # their config.json's
SLOTS = 2
VERSIONS, DRY_VERSIONS = 5, 3  # the first of them a warm-up, left out of the averages
REPEATS = 3  # the overlap's timings: the shortest of these
MARGIN_BYTES = 4 << 30  # beyond the tensors: two CUDA contexts, digests' chunks, the MLP
CHUNK = 1 << 24  # words a digest takes at once
SPIN_S = 1e-4  # the reader's pause between looks at the header
TIMEOUT_S = 120.0  # the longest a process may take to answer (its start included) before both are killed


def tiny(config: dict) -> dict:
    """`config` scaled down for the dry mode: 2 layers, a 32nd of the width, 1,000 tokens of vocabulary."""
    return config | {"hidden_size": config["hidden_size"] // 32, "num_hidden_layers": 2, "head_dim": 16,
                     "num_attention_heads": config["num_attention_heads"] // 4,
                     "num_key_value_heads": config["num_key_value_heads"] // 4,
                     "intermediate_size": config["intermediate_size"] // 32, "vocab_size": 1000}


def hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """A Qwen3 model's tensors under HF names, as the trainer publishes them (a tied LM head once, as the
    embedding)."""
    h, i, v, d = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    return shapes


def layout_of(config: dict):
    from meshrl.weight_sync import WeightLayout

    return WeightLayout.of({name: (shape, torch.bfloat16) for name, shape in hf_shapes(config).items()})


def digest(t: torch.Tensor) -> int:
    """A bit-exact, position-sensitive digest of a 2-byte tensor, computed where it lies: the sum of each
    16-bit word (unsigned) times (its position mod 65521) + 1. A changed word or two words swapped change it."""
    words = t.reshape(-1).view(torch.int16)
    total = 0
    for start in range(0, words.numel(), CHUNK):
        part = words[start:start + CHUNK].to(torch.int64) & 0xFFFF
        weight = torch.arange(start, start + part.numel(), device=t.device) % 65521 + 1
        total += int((part * weight).sum())
    return total


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: digest(t) for name, t in tensors.items()}


# -- the check's side: the two processes driven, the figures gathered

def run(check) -> dict:
    shapes = {name: tiny(config) for name, config in SHAPES.items()} if check.dry else SHAPES
    versions, timeout = DRY_VERSIONS if check.dry else VERSIONS, TIMEOUT_S
    out = {"slots": SLOTS, "versions": versions, "warm_up": 1, "shapes": {}}
    if check.dry:
        out["figures"] = "the CPU's memfd stand-in for GPU memory: not a GPU's figures"
    children = []
    try:
        for role in ("writer", "reader"):
            children.append(Child(role, check))
        writer, reader = children
        out["processes"] = {"writer": writer.process.pid, "reader": reader.process.pid}
        for name, config in shapes.items():
            layout = layout_of(config)
            shape = {"config": config, "tensors": len(layout.specs), "bytes": layout.nbytes,
                     "ring_bytes": SLOTS * layout.nbytes}
            if check.device.type == "cuda":
                free = torch.cuda.mem_get_info(check.device)[0]
                need = (SLOTS + 2) * layout.nbytes + MARGIN_BYTES
                if free < need:
                    out["shapes"][name] = shape | {"skipped": f"needs ~{need / 2**30:.0f} GiB of the GPU (the ring, "
                                                              f"the weights, the engine's), {free / 2**30:.0f} free"}
                    continue
            out["shapes"][name] = shape | one_shape(writer, reader, config, versions, timeout)
            out["transport"] = out["shapes"][name].pop("transport")
    finally:
        for child in reversed(children):  # the reader first: it holds the writer's memory open
            child.stop()
    ran = [s for s in out["shapes"].values() if "skipped" not in s]
    out["status"] = "pass" if all(s["bit_equal"] and s["torn_reads"] == 0 for s in ran) else "fail"
    if not ran:
        out["status"], out["reason"] = "skipped", "no shape fits this GPU's free memory"
    return out


def one_shape(writer, reader, config: dict, versions: int, timeout: float) -> dict:
    """The ring of `config`'s shape opened on both sides, `versions` versions through it, the overlap; closed."""
    from meshrl.tools.checks.publish import overlap

    handle, ring_allocated = writer.ask("open", config, timeout=timeout)
    out = {"ring_allocated": ring_allocated, "transport": reader.ask("open", config, handle, timeout=timeout)}
    rows = [one_version(writer, reader, v, timeout) for v in range(1, versions + 1)]
    nbytes = layout_of(config).nbytes
    for key in ("publish_s", "load_s", "end_to_end_s"):
        out[key] = sum(r[key] for r in rows[1:]) / len(rows[1:])  # the first a warm-up
        out[key.replace("_s", "_gbps")] = nbytes / out[key] / 1e9
    out["bit_equal"] = all(r["equal"] and r["read"] == r["version"] for r in rows)
    out["unequal_tensors"] = sorted({n for r in rows for n in r["unequal"]})
    out["per_version"] = rows
    out |= reader.ask("counts", timeout=timeout)
    times = writer.ask("overlap", timeout=timeout)
    out["overlap"] = times | {"overlap": overlap(times["forward_backward_s"], times["publish_s"], times["together_s"])}
    reader.ask("close", timeout=timeout)
    writer.ask("close", timeout=timeout)
    return out


def one_version(writer, reader, version: int, timeout: float) -> dict:
    """Version `version` made (random weights) in the writer, published while the reader polls for it, loaded;
    both sides' digests compared."""
    written = writer.ask("fill", version, timeout=timeout)
    reader.ask("load", version, timeout, timeout=timeout)  # "waiting": it polls the header from now on
    start, publish_s = writer.ask("publish", version, timeout=timeout)
    got = reader.answer(timeout)
    unequal = sorted(n for n in written if got["digests"].get(n) != written[n])
    return {"version": version, "read": got["version"], "publish_s": publish_s, "load_s": got["load_s"],
            "end_to_end_s": got["done"] - start, "equal": not unequal and got["digests"].keys() == written.keys(),
            "unequal": unequal, "writer_digest": sum(written.values()), "reader_digest": sum(got["digests"].values())}


class Child:
    """A writer or reader process, spawned fresh (`python -m meshrl.tools.checks.weights ROLE FD DEVICE`), asked
    over a socket: each answer ("ok", value) or ("error", its traceback); its stderr in the check's scratch."""

    def __init__(self, role: str, check):
        from multiprocessing.connection import Connection

        self.role, self.log = role, Path(check.tmp) / f"weights-{role}.log"
        mine, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[3])
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "meshrl.tools.checks.weights", role, str(theirs.fileno()), str(check.device)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
        theirs.close()
        self.conn = Connection(mine.detach())

    def ask(self, *message, timeout: float):
        self.conn.send(message)
        return self.answer(timeout)

    def answer(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the {self.role} process did not answer in {timeout:g} s{self.tail()}")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the {self.role} process ended (exit {self.process.poll()}){self.tail()}") from None
        if kind == "error":
            raise RuntimeError(f"the {self.role} process failed:\n{value}")
        return value

    def tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines()[-20:] if self.log.exists() else []
        return ("; its last lines:\n" + "\n".join(lines)) if lines else ""

    def stop(self) -> None:
        """Asked to exit; killed if it has not within a few seconds (or cannot be asked)."""
        try:
            self.conn.send(("exit",))
            self.process.wait(timeout=10)
        except Exception:  # noqa: BLE001 - any failure to end it politely ends it by force
            self.process.kill()
            self.process.wait()
        finally:
            self.conn.close()


# -- the two processes

class Side:
    """What both processes share: their device and its synchronisation."""

    def __init__(self, conn, device: str):
        self.conn, self.device = conn, torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the streams and events the ring makes are this GPU's

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, work) -> float:
        self.sync()
        start = time.monotonic()
        work()
        self.sync()
        return time.monotonic() - start

    def close(self) -> None:
        for name in [n for n in vars(self) if n not in ("conn", "device")]:
            delattr(self, name)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.ipc_collect()


class Writer(Side):
    """A trainer rank: its weights, its ring's slots on its device, a publish as the trainer makes it."""

    def open(self, config: dict):
        from concurrent.futures import ThreadPoolExecutor

        from meshrl.weight_sync.device_ring import DeviceMark, DeviceRing

        layout = layout_of(config)
        self.sources = {s.name: torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in layout.specs}
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
        self.ring = DeviceRing(layout, SLOTS, False, None, (0, 1), 1, 0, self.device, lambda x: [x],
                               register=False)  # read on this host only: no Monarch RDMA
        taken = None if before is None else torch.cuda.memory_allocated(self.device) - before
        self.mark, self.copier, self.version = DeviceMark(self.ring), ThreadPoolExecutor(1), 0
        return self.ring.handle(), taken

    def fill(self, version: int) -> dict[str, int]:
        """The version's weights: random, from its own seed (as an optimizer step changes every tensor)."""
        generator = torch.Generator(self.device).manual_seed(version)
        for t in self.sources.values():
            t.normal_(generator=generator)
        return digests(self.sources)

    def copy(self, version: int, steps: int = 0) -> float:
        """A publish as the trainer makes it: marked on this thread, copied in the copy thread (its seconds
        there returned); `steps` forward and backward passes of the MLP run here meanwhile."""
        started = self.mark.start(self.sources)

        def publish():
            start = time.monotonic()
            self.ring.publish(self.mark.finish(started), version)  # waits for its side stream's copies
            return time.monotonic() - start

        done = self.copier.submit(publish)
        self.train(steps)
        self.version = version
        return done.result()

    def publish(self, version: int) -> tuple[float, float]:
        """(when it started, CLOCK_MONOTONIC; the copy thread's seconds) of version `version`'s publish."""
        self.sync()
        return time.monotonic(), self.copy(version)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.mlp(self.batch).float().square().mean().backward()

    def overlap(self) -> dict:
        """A forward and backward of a plain MLP, repeated to take about as long as a publish, alone; a publish
        alone; both at once (each the shortest of REPEATS)."""
        cuda = self.device.type == "cuda"
        width, tokens = (4096, 2048) if cuda else (64, 64)
        torch.manual_seed(0)
        dtype = torch.bfloat16 if cuda else torch.float32
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width)).to(self.device, dtype)
        self.batch = torch.randn(tokens, width, device=self.device, dtype=dtype)
        step = min(self.timed(lambda: self.train(1)) for _ in range(REPEATS))
        publish = min(self.timed(lambda: self.copy(self.version + 1)) for _ in range(REPEATS))
        steps = max(1, min(1000, round(publish / step)))
        alone = min(self.timed(lambda: self.train(steps)) for _ in range(REPEATS))
        together = min(self.timed(lambda: self.copy(self.version + 1, steps)) for _ in range(REPEATS))
        return {"steps": steps, "forward_backward_s": alone, "publish_s": publish, "together_s": together}

    def close(self) -> None:
        self.copier.shutdown()
        super().close()


class Reader(Side):
    """A vLLM replica on the ring's host: its engine weights, loaded from views of the ring."""

    def open(self, config: dict, handle) -> str:
        import asyncio

        from meshrl.weight_sync.device_ring import DeviceRingReader

        layout = layout_of(config)
        self.reader = DeviceRingReader(handle, layout, lambda named: named)
        self.engine = {s.name: torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in layout.specs}
        self.loop = asyncio.new_event_loop()
        return self.reader.transport

    def load(self, version: int, timeout: float) -> dict:
        """Waiting for `version` (said at once; TimeoutError past `timeout`), then loading it: when it holds it
        (CLOCK_MONOTONIC), the last load's seconds (the copy out of the ring), the engine's digests."""
        self.conn.send(("ok", "waiting"))
        deadline = time.monotonic() + timeout
        copies = []

        async def load(_, tensors):
            self.sync()
            start = time.monotonic()
            for name, view in tensors:
                self.engine[name].copy_(view)
            self.sync()
            copies.append(time.monotonic() - start)

        while (got := self.loop.run_until_complete(self.reader.load_latest(load, version - 1))) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"version {version} did not appear in the ring in {timeout:g} s")
            time.sleep(SPIN_S)
        done = time.monotonic()
        return {"version": got, "done": done, "load_s": copies[-1], "digests": digests(self.engine)}

    def counts(self) -> dict:
        return {"torn_reads": self.reader.torn_reads, "corrupt_reads": self.reader.corrupt_reads}

    def close(self) -> None:
        self.loop.close()
        super().close()


def serve(role: str, fd: int, device: str) -> None:
    """A child's life: each message (method, *args) answered, until ("exit",) or the check's end."""
    import traceback
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    side = {"writer": Writer, "reader": Reader}[role](conn, device)
    while True:
        try:
            name, *args = conn.recv()
        except EOFError:
            return
        if name == "exit":
            return
        try:
            conn.send(("ok", getattr(side, name)(*args)))
        except Exception:  # noqa: BLE001 - sent to the check, which stops both processes
            conn.send(("error", traceback.format_exc()))


def report(section: dict) -> list[str]:
    lines = [f"ring in device memory between 2 processes ({section.get('transport', '-')}), {section['slots']} slots, "
             f"{section['versions'] - 1} versions after a warm-up"
             + (f"; {section['figures']}" if "figures" in section else "")]
    for name, s in section["shapes"].items():
        if "skipped" in s:
            lines.append(f"{name:11s} {s['bytes'] / 1e9:.3g} GB: skipped: {s['skipped']}")
            continue
        o = s["overlap"]
        lines.append(f"{name:11s} {s['bytes'] / 1e9:.3g} GB, ring {s['ring_bytes'] / 1e9:.3g} GB: publish "
                     f"{s['publish_s']:.4f} s ({s['publish_gbps']:.1f} GB/s), load {s['load_s']:.4f} s "
                     f"({s['load_gbps']:.1f} GB/s), end to end {s['end_to_end_s']:.4f} s ({s['end_to_end_gbps']:.1f} "
                     f"GB/s); bit-equal {'yes' if s['bit_equal'] else 'NO'}, torn {s['torn_reads']}; overlap "
                     f"{o['overlap']:.2f} (forward+backward x{o['steps']} {o['forward_backward_s']:.4f} s)")
    return lines


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3])
