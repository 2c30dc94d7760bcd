"""The plain weight path that the ring replaces, kept as a baseline and as a check of the ring:
the trainer gathers the whole policy, rank 0 saves it as one safetensors file per version (HF
names, the dtype the generators serve), and a generator loads the newest file from disk into vLLM.

`weight_sync.transport disk` trains with it; `weight_sync.verify` writes the files beside the ring
and has every generator load each version a second time from its file and compare every tensor vLLM
holds after the two loads (`meshrl study weight-sync-equivalence`). The directory must be one that
the trainer and the generators share.
"""

import asyncio
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

Weights = list[tuple[str, torch.Tensor]]
_NAME = re.compile(r"^v(\d+)\.safetensors$")


@dataclass(frozen=True)
class DiskHandle:
    """Where a trainer writes its versions (what `weight_ring()` returns with transport disk)."""

    directory: str


def write_version(directory: Path, version: int, weights: dict[str, torch.Tensor], keep: int) -> Path:
    """`weights` as v{version}.safetensors, complete before it has its name (written under another, then
    renamed); only the newest `keep` versions up to this one are left. Versions above it are a run's
    discarded future (left by the run that a resume goes on from): removed, so that no generator loads them."""
    directory.mkdir(parents=True, exist_ok=True)
    path, partial = directory / f"v{version}.safetensors", directory / f".v{version}.safetensors.partial"
    save_file({name: t.contiguous() for name, t in weights.items()}, str(partial))
    os.replace(partial, path)
    found = versions(directory)
    for old in [v for v in found if v > version] + [v for v in found if v <= version][:-keep]:
        (directory / f"v{old}.safetensors").unlink(missing_ok=True)
    return path


def versions(directory: Path) -> list[int]:
    """The versions whose files are complete in `directory`, oldest first."""
    found = (_NAME.match(p.name) for p in directory.iterdir()) if directory.is_dir() else ()
    return sorted(int(m.group(1)) for m in found if m)


def read_version(directory: Path, version: int) -> Weights:
    return list(load_file(str(Path(directory) / f"v{version}.safetensors")).items())


class DiskReader:
    """Generator side, as `ShardedReader`: the newest version, loaded from its file."""

    transport = "disk"
    torn_reads = corrupt_reads = 0  # a file is renamed into place once written: never read half-written

    def __init__(self, handle: DiskHandle):
        self.directory = Path(handle.directory)

    def memory(self) -> list:
        """None of what it reads lies in shared memory (as `ShardedReader.memory`): a tensor-parallel
        handoff copies it all."""
        return []

    def take_trainer_bytes(self) -> int:
        """No ring is read: 0 (as `ShardedReader.take_trainer_bytes`)."""
        return 0

    async def newest(self) -> int:
        found = versions(self.directory)
        return found[-1] if found else -1

    async def load_latest(self, load: Callable[[int, Weights], None], newer_than: int = -1) -> int | None:
        """Call `load(version, weights)` with the newest version newer than `newer_than`; None if none."""
        version = await self.newest()
        if version <= newer_than:
            return None
        try:
            weights = await asyncio.to_thread(read_version, self.directory, version)  # off the event loop
        except FileNotFoundError:  # a newer one replaced it meanwhile: take that
            return await self.load_latest(load, newer_than)
        load(version, weights)
        return version
