"""Checkpoints for exact resume: everything that decides what a run does next, in
`RUN_DIR/checkpoints/step-N/`.

- `trainer/`: the policy and the optimizer state, written by every trainer rank with
  `torch.distributed.checkpoint` (sharded, so it loads unchanged on any number of ranks), and each
  rank's counters and torch RNG state.
- `state.pt`: the controller's side: the step and policy version, the data position (the next prompt,
  the batch being filled, the prompts whose groups were still generating), full batches not yet
  trained and the replay buffer's episodes, the metrics so far and the eval before training.
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

DIR = "checkpoints"
_STEP = re.compile(r"^step-(\d+)$")


@dataclass
class RunState:
    """The controller's part of a checkpoint (state.pt)."""

    step: int  # steps done
    trainer_version: int  # the policy version published after it
    collector: dict  # RolloutCollector.snapshot(): next prompt, batches done, the batch being filled, prompts to redo
    queued: list  # full batches (Rollouts) not yet trained; their episodes are in `buffer`
    buffer: dict  # the replay buffer's state
    rows: list[dict]  # metrics.jsonl so far
    initial: dict  # the eval before training
    counters: dict = field(default_factory=dict)  # replica restarts and requeued groups so far


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
    c = state.collector
    (partial / "checkpoint.json").write_text(json.dumps({
        "step": state.step, "policy_version": state.trainer_version, "next_prompt": c["next_prompt"],
        "batches_done": c["batches_done"], "prompts_to_redo": c["relaunch"],
        "prompts_generated_not_trained": sorted({*c["filling"].kept,
                                                 *(rec["prompt_index"] for r in state.queued for rec in r.records)}),
        "buffered_episodes": len(state.buffer["episodes"])}, indent=2))
    final = partial.parent / f"step-{state.step}"
    os.rename(partial, final)
    done = checkpoints(partial.parent.parent)
    for _, old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(checkpoint: Path) -> RunState:
    return torch.load(checkpoint / "state.pt", weights_only=False)
