"""Checkpoints for exact resume: everything that decides what a run does next, in
`RUN_DIR/checkpoints/step-N/`.

- `trainer/`: the policy and the optimizer state, written by every trainer rank with
  `torch.distributed.checkpoint` (sharded, so it loads unchanged on any number of ranks), and each
  rank's counters and torch RNG state.
- `state.pt`: the controller's side: the step and policy version, the work buffer's position (the
  next prompt, prompts to start again, the batch being filled, complete batches not yet trained), the
  metrics so far and the eval before training.
- `checkpoint.json`: the same position in words, for people and tests.

A checkpoint is written into `.step-N.partial/` and renamed into place once complete, so a run
killed while writing leaves no `step-N/` that looks complete but is not; `latest` ignores the rest.
"""

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshrl.actors import first, in_rank_order

DIR = "checkpoints"
_STEP = re.compile(r"^step-(\d+)$")


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
    """Writes a run's checkpoints (the trainer's state by its ranks, the controller's beside it) and
    reads the trainer's back."""

    def __init__(self, run_dir: Path, keep: int, trainer, tracer, timeouts):
        self.run_dir, self.keep, self.trainer, self.tracer, self.timeouts = Path(run_dir), keep, trainer, tracer, timeouts

    async def write(self, state: RunState) -> Path:
        """Checkpoint `state` (taken at a step's end, while the trainer is idle) as step-N."""
        final = self.run_dir / DIR / f"step-{state.step}"
        if final.exists():
            return final
        partial = begin(self.run_dir, state.step)
        async with self.tracer.span("trainer", "save_state", state.trainer_version, timeout=self.timeouts.trainer):
            await in_rank_order(self.trainer.save_state.call(str(partial / "trainer")))
        return commit(partial, state, self.keep)

    async def restore_trainer(self, checkpoint: Path) -> int:
        """The trainer's policy, optimizer and counters from `checkpoint`, published again under its
        version (the generators load it before they sample); returns that version."""
        async with self.tracer.span("trainer", "load_state", timeout=self.timeouts.trainer):
            return await first(self.trainer.load_state.call(str(checkpoint / "trainer")))


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
    untrained = {*w["filling"].kept, *(r["prompt_index"] for b in w["ready"].values() for r in b.records)}
    (partial / "checkpoint.json").write_text(json.dumps({
        "step": state.step, "policy_version": state.trainer_version, "next_prompt": w["next_prompt"],
        "batches_complete": w["filling"].index, "prompts_to_redo": w["redo"],
        "prompts_generated_not_trained": sorted(untrained), **w["totals"]}, indent=2))
    final = partial.parent / f"step-{state.step}"
    os.rename(partial, final)
    done = checkpoints(partial.parent.parent)
    for _, old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(checkpoint: Path) -> RunState:
    return torch.load(checkpoint / "state.pt", weights_only=False)
