"""Checkpoints for exact resume: everything that decides what a run does next, in
`RUN_DIR/checkpoints/step-N/`.

- `trainer/`: the policy and the optimizer state, written by every trainer rank with
  `torch.distributed.checkpoint` (sharded, so it loads unchanged on any number of ranks), and each
  rank's counters and torch RNG states (the CPU generator's, and its CUDA device's where the model is
  on one: `rng_states`).
- `replay_buffer/`: the replay buffer's groups not yet trained (or, replayed, to be trained again)
  and their use counts (meshrl/actors/replay_buffer.py).
- `state.pt`: the controller's side: the step and policy version, the work buffer's position (the
  next prompt, prompts to start again, the batch being filled, complete batches not yet trained), the
  metrics so far and the eval before training.
- `checkpoint.json`: the same position in words, for people and tests.

A checkpoint is written into `.step-N.partial/` and renamed into place once complete, so a run
killed while writing leaves no `step-N/` that looks complete but is not; `latest` ignores the rest.

A run directory is an input too, perhaps written by someone else: nothing `--resume` reads may run
code. `state.pt` and the ranks' files are read with `torch.load(weights_only=True)` allowing only
meshrl's own state classes, and DCP's `.metadata` (a plain pickle, which DCP itself unpickles
whole) with an unpickler that allows only DCP's metadata classes. `resumable` checks all of it, and
that every shard file DCP will read is there and long enough, before anything starts: a checkpoint
that would run code is refused; a damaged one (a missing or truncated file) is named, and the
previous complete one is used if there is one.
"""

import array
import json
import os
import pickle
import re
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from meshrl.actors import first, in_rank_order
from meshrl.actors.timeouts import deadline
from meshrl.checks import at_least

DIR = "checkpoints"
_STEP = re.compile(r"^step-(\d+)$")


@dataclass
class CheckpointConfig:
    """The `checkpoint` section: when checkpoints for exact resume are written and how many are kept
    (`meshrl train --resume RUN_DIR`)."""

    every: int = 10  # steps between checkpoints; one is also written after the last step and on Ctrl-C/SIGTERM (0: only those)
    keep: int = 1  # the newest checkpoints kept (0: all); a new one is complete before an old one goes

    def check(self) -> None:
        at_least(self, "checkpoint", every=0, keep=0)


@dataclass
class RunState:
    """The controller's part of a checkpoint (state.pt)."""

    step: int  # steps done
    trainer_version: int  # the policy version published after it
    work: dict  # WorkBuffer.snapshot(): what to generate next, and what was generated but not trained
    rows: list[dict]  # metrics.jsonl so far
    initial: dict  # the eval before training
    counters: dict = field(default_factory=dict)  # replica restarts and retried calls so far


class Checkpointer:
    """Writes a run's checkpoints (the trainer's state by its ranks, the replay buffer's by it, the
    controller's beside them) and reads the trainer's and the buffer's back."""

    def __init__(self, run_dir: Path, keep: int, trainer, tracer, timeouts, buffer):
        self.run_dir, self.keep, self.trainer, self.tracer, self.timeouts = Path(run_dir), keep, trainer, tracer, timeouts
        self.buffer = buffer

    async def write(self, state: RunState) -> Path:
        """Checkpoint `state` (taken at a step's end, while the trainer is idle) as step-N."""
        final = self.run_dir / DIR / f"step-{state.step}"
        if final.exists():
            return final
        partial = begin(self.run_dir, state.step)
        async with self.tracer.span("trainer", "save_state", state.trainer_version, timeout=self.timeouts.trainer):
            await in_rank_order(self.trainer.save_state.call(str(partial / "trainer")))
        async with self.tracer.span("replay_buffer", "save_state", state.trainer_version, timeout=self.timeouts.buffer):
            await self.buffer.save_state.call_one(str(partial / "replay_buffer"))
        final = commit(partial, state, self.keep)
        async with deadline(self.timeouts.buffer, "replay_buffer", "checkpointed"):
            await self.buffer.checkpointed.call_one(state.step)  # its log of the batches trained up to here goes
        return final

    async def restore_trainer(self, checkpoint: Path) -> int:
        """The trainer's policy, optimizer and counters from `checkpoint`, published again under its
        version (the generators load it before they sample); returns that version."""
        async with self.tracer.span("trainer", "load_state", timeout=self.timeouts.trainer):
            return await first(self.trainer.load_state.call(str(checkpoint / "trainer")))

    async def restore_buffer(self, checkpoint: Path) -> None:
        """The replay buffer's groups and counts from `checkpoint`."""
        async with self.tracer.span("replay_buffer", "load_state", timeout=self.timeouts.buffer):
            await self.buffer.load_state.call_one(str(checkpoint / "replay_buffer"))


def rng_states(device: torch.device) -> dict:
    """This process's torch RNG states, for `set_rng_states`: the CPU generator's (`rng`) and, where the
    model is on a CUDA device, that device's generator's (`cuda_rng`)."""
    states = {"rng": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda_rng"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    """Restore what `rng_states` returned (on a CUDA device: its generator too, if the checkpoint has
    one; a checkpoint written on the CPU leaves the CUDA generator as it is)."""
    torch.set_rng_state(states["rng"])
    if device.type == "cuda" and "cuda_rng" in states:
        torch.cuda.set_rng_state(states["cuda_rng"], device)


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / DIR
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name))] if root.is_dir() else []
    return sorted(found)


def latest(run_dir: Path) -> Path | None:
    done = checkpoints(run_dir)
    return done[-1][1] if done else None


def begin(run_dir: Path, step: int) -> Path:
    """A fresh directory to write step `step`'s checkpoint into (left over from a killed write: emptied)."""
    partial = Path(run_dir) / DIR / f".step-{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def commit(partial: Path, state: RunState, keep: int) -> Path:
    """Write the controller's state into `partial`, rename it into place, and keep only the newest
    `keep` checkpoints (0: all). Returns the checkpoint's directory."""
    torch.save(state, partial / "state.pt")
    w = state.work
    untrained = {*(i for f in w["filling"].values() for i in f.kept),
                 *(i for b in w["ready"].values() for i in b.groups)}
    (partial / "checkpoint.json").write_text(json.dumps({
        "step": state.step, "policy_version": state.trainer_version, "next_prompt": w["next_prompt"],
        "batches_complete": w["complete_below"], "prompts_to_redo": w["redo"],
        "prompts_generated_not_trained": sorted(untrained), **w["totals"]}, indent=2))
    final = partial.parent / f"step-{state.step}"
    os.rename(partial, final)
    done = checkpoints(partial.parent.parent)
    for _, old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: the file and why."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file that would run code if it were loaded."""


def _state_classes() -> list[type]:
    from meshrl.episodes import Kept
    from meshrl.types import Completion, Episode, Generated, ScoredCompletion, Trajectory
    from meshrl.work_buffer import Batch, Filling, Group

    return [RunState, Filling, Group, Batch, Kept, Completion, Generated, Trajectory, ScoredCompletion, Episode]


def _why(error: Exception) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]


@contextmanager
def _reading(path: Path):
    """Turns what reading `path` raised into a CheckpointError naming it: missing, damaged, or (a global
    the unpickler does not allow) UnsafeCheckpoint."""
    try:
        yield
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except pickle.UnpicklingError as e:
        if "Unsupported global" in str(e) or "not an allowed global" in str(e):
            raise UnsafeCheckpoint(f"{path} would run code if loaded ({_why(e)}); not resuming from it") from None
        raise CheckpointError(f"{path} is damaged ({_why(e)})") from None
    except (RuntimeError, EOFError, ValueError, TypeError, AttributeError, OSError) as e:
        raise CheckpointError(f"{path} is damaged ({_why(e)})") from None


def load_safely(path: Path, classes: list[type] = ()):
    """`torch.load` of `path` allowing tensors, plain containers, arrays (meshrl.types' token sequences: built
    from a typecode and bytes, nothing else) and `classes` only."""
    with _reading(path), torch.serialization.safe_globals([array.array, array._array_reconstructor, *classes]):
        return torch.load(path, weights_only=True)


def load(checkpoint: Path) -> RunState:
    return load_safely(checkpoint / "state.pt", _state_classes())


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` and nothing else: its metadata classes, torch dtypes, sizes and
    layouts, and paths."""

    ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
               ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
               ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"Unsupported global {module}.{name}")


def read_metadata(path: Path):
    """DCP's metadata file, unpickled with `_MetadataUnpickler`."""
    with _reading(path), open(path, "rb") as f:
        return _MetadataUnpickler(f).load()


class SafeReader(FileSystemReader):
    """DCP's file reader, its metadata read by `read_metadata` (the tensors it reads are weights_only already)."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata(Path(self.path) / ".metadata")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def verify(checkpoint: Path) -> None:
    """Raise CheckpointError (UnsafeCheckpoint) unless every file `--resume` reads from `checkpoint` is
    there, whole, and loads without running code."""
    load(checkpoint)
    trainer = checkpoint / "trainer"
    metadata = read_metadata(trainer / ".metadata")
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        file = trainer / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        if file.stat().st_size < length:
            raise CheckpointError(f"{file} is damaged (truncated: {file.stat().st_size} of {length} bytes)")
    ranks = sorted(trainer.glob("rank*.pt"))
    if not ranks:
        raise CheckpointError(f"{trainer / 'rank0.pt'} is missing")
    for rank in ranks:
        load_safely(rank)
    buffer = checkpoint / "replay_buffer" / "state.pt"
    if not buffer.is_file():
        raise CheckpointError(f"{buffer} is missing (a checkpoint written before meshrl had a replay buffer "
                              "cannot be resumed by this version)")
    from meshrl.types import Episode

    load_safely(buffer, [Episode])


def resumable(run_dir: Path) -> Path:
    """The newest checkpoint of `run_dir` that `verify` passes. A damaged one is named on stderr and the
    one before it tried; one that would run code stops the search (CheckpointError / UnsafeCheckpoint)."""
    done = checkpoints(run_dir)
    if not done:
        raise CheckpointError(f"{run_dir} has no complete checkpoint to resume from (checkpoints/step-N)")
    for i, (_, path) in enumerate(reversed(done)):
        try:
            verify(path)
            return path
        except UnsafeCheckpoint:
            raise
        except CheckpointError as e:
            if i == len(done) - 1:
                raise
            older = done[len(done) - 2 - i][1]
            print(f"meshrl: {e}: resuming from the checkpoint before it, {older.name}", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")
