"""What `--resume` reads cannot run code, and a damaged checkpoint is named and skipped: checkpoints
written here as the trainer and the controller write them (DCP, torch.save), then tampered with (a
pickle whose loading would create a marker file) or damaged (a truncated or missing file)."""

import asyncio
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from meshrl.actors.replay_buffer import FifoBuffer
from meshrl.actors.replay_buffer_config import ReplayBufferConfig
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.checkpoint import CheckpointError, RunState, UnsafeCheckpoint, resumable, verify
from meshrl.configs import to_dict
from meshrl.configs.named import load_config
from meshrl.types import Completion, GroupEpisodes
from meshrl.work_buffer import Filling
from support.fake_monarch import endpoint_of


class Payload:
    """Unpickling it opens (creates) `marker`: what a malicious checkpoint would do, harmlessly."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def write_checkpoint(run_dir: Path, step: int) -> Path:
    """A checkpoint as meshrl writes one: the trainer's DCP state and rank file, the replay buffer's state
    (by the real buffer), the controller's state."""
    where = run_dir / "checkpoints" / f"step-{step}"
    (where / "trainer").mkdir(parents=True)
    dcp.save({"model": {"w": torch.arange(6.0).view(2, 3)}, "optim": {"step": torch.tensor(3.0)}},
             checkpoint_id=str(where / "trainer"), no_dist=True)
    torch.save({"policy_version": step, "updates": step, "rng": torch.get_rng_state()}, where / "trainer" / "rank0.pt")
    work = {"next_prompt": 8, "redo": [], "filling": {step: Filling(step)}, "complete_below": step, "ready": {},
            "totals": {}}
    torch.save(RunState(step, step, work, [{"step": step}], {}), where / "state.pt")
    buffer = FifoBuffer(ReplayBufferConfig(), TrainerConfig(), 2, 0, 0)  # one group waiting
    add, save = endpoint_of(buffer, "add")[0], endpoint_of(buffer, "save_state")[0]
    buffer.staged[8] = {0: [[Completion(8, [1], [2], [-1.0], "", step, "stop")]]}  # as `stage` took try 0 from its generator
    asyncio.run(add(step, [GroupEpisodes(8, [(0, 0, 1)], [1.0], [step], [1.0, 0.0], 1.0, records=[{"group": 8}])]))
    asyncio.run(save(str(where / "replay_buffer")))
    return where


def test_a_checkpoint_as_written_passes_and_its_state_loads(tmp_path):
    checkpoint = write_checkpoint(tmp_path, 2)
    verify(checkpoint)
    assert resumable(tmp_path) == checkpoint


@pytest.mark.parametrize("file", ["state.pt", "trainer/rank0.pt", "trainer/.metadata", "replay_buffer/state.pt"])
def test_a_file_that_would_run_code_is_refused_and_runs_nothing(tmp_path, file):
    checkpoint = write_checkpoint(tmp_path, 2)
    marker = tmp_path / "pwned"
    if file == "trainer/.metadata":
        (checkpoint / file).write_bytes(pickle.dumps(Payload(marker)))
    else:
        torch.save(Payload(marker), checkpoint / file)
    with pytest.raises(UnsafeCheckpoint, match=f"{checkpoint / file} would run code if loaded"):
        verify(checkpoint)
    assert not marker.exists()


def test_damaged_files_are_named(tmp_path):
    checkpoint = write_checkpoint(tmp_path, 2)
    shard = next((checkpoint / "trainer").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(CheckpointError, match=f"{shard} is damaged \\(truncated: 20 of"):
        verify(checkpoint)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard} is missing"):
        verify(checkpoint)
    state = checkpoint / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{state} is damaged"):
        verify(checkpoint)


def test_resume_falls_back_past_a_damaged_checkpoint_but_not_past_one_that_would_run_code(tmp_path, capsys):
    older, newer = write_checkpoint(tmp_path, 2), write_checkpoint(tmp_path, 4)
    (newer / "trainer" / "rank0.pt").unlink()
    assert resumable(tmp_path) == older
    assert capsys.readouterr().err.strip() == (f"meshrl: {newer / 'trainer' / 'rank0.pt'} is missing: resuming from "
                                               "the checkpoint before it, step-2")
    torch.save(Payload(tmp_path / "pwned"), newer / "state.pt")
    with pytest.raises(UnsafeCheckpoint):
        resumable(tmp_path)
    (older / "state.pt").write_bytes(b"")
    newer_ok = write_checkpoint(tmp_path / "only", 3)
    (newer_ok / "state.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="state.pt is damaged"):  # nothing older to fall back to
        resumable(tmp_path / "only")


def test_resume_of_a_tampered_run_is_one_line_and_starts_nothing(tmp_path, cli):
    run_dir = tmp_path / "run"
    checkpoint = write_checkpoint(run_dir, 2)
    (run_dir / "config.json").write_text(json.dumps(to_dict(load_config("smoke", []))))
    marker = tmp_path / "pwned"
    (checkpoint / "trainer" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    code, _, err = cli("train", "--resume", run_dir)
    assert code == 2 and not marker.exists()
    assert err.strip().splitlines() == [
        f"meshrl: error: {checkpoint / 'trainer' / '.metadata'} would run code if loaded (Unsupported global "
        "io.open); not resuming from it"]
    assert not (run_dir / "metrics.jsonl").exists()
