"""`weight_sync.verify`: is what vLLM serves after a ring load exactly what the plain path gives?

After each version a generator loaded from the ring, it keeps a copy of every tensor vLLM holds,
loads the same version again from the file the trainer wrote (meshrl/weight_sync/disk.py), and
compares the two bit for bit. One line per version goes to verified.jsonl beside the files: how many
tensors, which differ, and by how much at most. A check, not a transport: it doubles a load's cost.
"""

import json
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from meshrl.weight_sync.disk import read_version

logger = logging.getLogger(__name__)


def bitwise_differences(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    """The tensors whose bytes differ, each with its largest absolute difference (inf where a shape or
    dtype differs)."""
    out = {}
    for name in sorted(before.keys() | after.keys()):
        a, b = before.get(name), after.get(name)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            out[name] = float("inf")
        elif not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            out[name] = (a.double() - b.double()).abs().max().item()
    return out


class Verifier:
    def __init__(self, directory: str, reload: Callable[[list], None], model: Callable[[], torch.nn.Module]):
        self.directory, self.reload, self.model = Path(directory), reload, model

    def held(self) -> dict[str, torch.Tensor]:
        model = self.model()
        return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}

    def check(self, version: int) -> dict:
        """Compare what vLLM holds now (version `version`, from the ring) with the same version loaded
        from its file; vLLM serves the file's afterwards (the same, when they agree)."""
        ring = self.held()
        self.reload(read_version(self.directory, version))
        differ = bitwise_differences(ring, self.held())
        line = {"version": version, "pid": os.getpid(), "tensors": len(ring), "identical": not differ,
                "differing": differ}
        with open(self.directory / "verified.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        if differ:
            logger.warning("version %d: %d of %d tensors vLLM holds differ between the ring's load and the file's "
                           "(%s)", version, len(differ), len(ring), ", ".join(list(differ)[:3]))
        return line
