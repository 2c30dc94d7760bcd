"""final/ is what the run says it is (meshrl/runtime/final.py): a run that stops while its trainer is being
brought back writes final/ from the version a generator serves, not from the trainer, whose weights are
not the run's; its last line and summary.json name that version, where it came from and why (real Monarch
actors, vLLM, the tiny model). Which source wins, by the rule's order, is checked over fakes that record
the calls they get."""

import asyncio

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from assertions import read_jsonl
from safetensors.torch import load_file

from meshrl.models.model import load_hf_weights, resolve_checkpoint

from meshrl.runtime.final import FinalPolicy, save_final


class FakeEndpoint:
    """An endpoint's `call` / `call_one`: runs `fn`, and records each call in `calls`."""

    def __init__(self, fn, calls: list, name: str):
        self.fn, self.calls, self.name = fn, calls, name

    async def call_one(self, *args):
        self.calls.append(self.name)
        return self.fn(*args)

    call = call_one


def fake_generator(index: int, version, calls: list, healthy: bool = True):
    """A replica serving `version` (None: it holds no whole copy); save_policy writes a marker file."""
    def save(path):
        Path(path).mkdir(parents=True)
        (Path(path) / "from").write_text(f"generator {index}")
        return version

    actor = SimpleNamespace(served_copy=FakeEndpoint(lambda: version, calls, f"served_copy {index}"),
                            save_policy=FakeEndpoint(save, calls, f"save_policy {index}"))
    return SimpleNamespace(index=index, healthy=healthy, actor=actor)


def fake_run(tmp_path, behind: bool, checkpoint_step: int | None, served: list, trainer_dead: bool = False,
             given_up: str | None = None):
    """The controller, trainer and generator pool a run's end sees; the trainer's save writes a marker file."""
    calls = []

    def save(path):
        if trainer_dead:
            raise RuntimeError("trainer's process is gone")
        Path(path).mkdir(parents=True)
        (Path(path) / "from").write_text("trainer")

    def restore(path):
        calls.append(f"restore {path.name}")
        return checkpoint_step

    trainer = SimpleNamespace(save=FakeEndpoint(save, calls, "trainer save"))
    if checkpoint_step is not None:
        (tmp_path / "checkpoints" / f"step-{checkpoint_step}").mkdir(parents=True)

    async def restore_trainer(path):
        return restore(path)

    controller = SimpleNamespace(restarts=SimpleNamespace(trainer_behind=behind, given_up=given_up), training=None,
                                 rows=SimpleNamespace(done=5), trainer_version=5, trainer=trainer,
                                 checkpointer=SimpleNamespace(restore_trainer=restore_trainer))
    pool = SimpleNamespace(replicas=[fake_generator(i, v, calls, h) for i, (v, h) in enumerate(served)])
    return trainer, controller, pool, calls


class FakeTracer:
    @contextlib.asynccontextmanager
    async def span(self, *args, **kwargs):
        yield


def ended(tmp_path, behind, checkpoint_step, served, trainer_dead=False, why=None, given_up=None):
    trainer, controller, pool, calls = fake_run(tmp_path, behind, checkpoint_step, served, trainer_dead, given_up)
    timeouts = SimpleNamespace(trainer=None)
    policy = asyncio.run(save_final(tmp_path, trainer, controller, pool, FakeTracer(), timeouts, why))
    written = (tmp_path / "final" / "from").read_text() if (tmp_path / "final").exists() else None
    return policy, written, calls


def test_a_trainer_at_the_last_version_writes_final_and_nothing_else_is_asked(tmp_path):
    policy, written, calls = ended(tmp_path, False, 4, [(5, True)])
    assert policy == FinalPolicy(5, "the trainer") and written == "trainer" and calls == ["trainer save"]


def test_a_trainer_coming_back_is_not_asked_the_newest_generator_copy_wins_a_tie_with_the_checkpoint(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "from").write_text("an earlier attempt")
    policy, written, calls = ended(tmp_path, True, 4, [(3, True), (4, True), (5, False), (None, True)])
    why = "the trainer was being brought back after a restart when the run stopped"
    assert policy == FinalPolicy(4, "generator 1", why) and written == "generator 1"
    assert "trainer save" not in calls and "served_copy 2" not in calls  # an unhealthy replica is not asked
    assert calls[-1] == "save_policy 1"


def test_a_newer_checkpoint_is_restored_into_the_trainer_and_saved(tmp_path):
    policy, written, calls = ended(tmp_path, True, 4, [(3, True)])
    assert policy.version == 4 and policy.source == "checkpoint step-4" and written == "trainer"
    assert calls[-2:] == ["restore step-4", "trainer save"]


def test_a_dead_trainer_falls_back_and_nothing_held_writes_nothing(tmp_path):
    policy, written, _ = ended(tmp_path, False, None, [(5, True)], trainer_dead=True)
    assert policy.source == "generator 0" and policy.why.startswith("the trainer could not write it (")
    policy, written, _ = ended(tmp_path / "none", False, None, [(None, True)], trainer_dead=True)
    assert policy is None and written is None and not (tmp_path / "none" / ".final.partial").exists()
    # a trainer out of restarts is not asked (a hung one would hold the save for its whole timeout)
    policy, written, calls = ended(tmp_path / "out", False, None, [(5, True)], given_up="trainer")
    assert policy.why.endswith("than trainer.max_restarts allows") and "trainer save" not in calls


REWARDS = "def reward(text, answer):\n    return len(text) % 5 / 4  # varied within a group: the policy moves\n"


@pytest.mark.processes
def test_a_run_stopped_while_its_trainer_comes_back_saves_the_last_published_version(tmp_path):
    """The trainer dies in step 3 (checkpoint.every 0: no checkpoint); the trainer started in its place
    hangs while it trains steps 1 and 2 again, and a second failure in a row stops the run. The generator
    serves version 2, the last published: final/ holds it, bit for bit as published (weight_sync.verify
    writes each version to RUN_DIR/weights)."""
    (tmp_path / "varied_reward.py").write_text(REWARDS)
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(12)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stall = tmp_path / "stall"
    stall.mkdir()
    run_dir = tmp_path / "run"
    env = {**os.environ, "MESHRL_TEST_STALL_DIR": str(stall),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "meshrl", "train", "--config", "smoke", "--run-dir", str(run_dir),
         "--controller.steps", "5", "--checkpoint.every", "0", "--controller.max_policy_age", "0",
         "--task", "dataset", "--dataset.path", str(tmp_path / "d.jsonl"), "--dataset.reward",
         "varied_reward:reward", "--dataset.eval_size", "2", "--dataset.test_size", "0",
         "--trainer.impl", "faulty_actors:DyingTrainer", "--trainer.timeout_s", "20", "--trainer.max_restarts", "1",
         "--controller.restart_window_s", "3600", "--weight_sync.verify", "true"],
        capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 1, run.stderr[-3000:]
    assert (stall / "trainer-died").exists()
    last = run.stderr.strip().splitlines()[-1]
    why = "the trainer was being brought back after a restart when the run stopped"
    assert last.startswith("meshrl: error: the trainer failed 2 times in a row"), run.stderr[-3000:]
    assert f"(after 2 steps; metrics, rollouts, trace and the policy version 2 (final/, from generator 0: {why}) " \
           f"are in {run_dir})" in last, last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_policy"] == {"version": 2, "source": "generator 0", "why": why}
    assert summary["steps"] == 2 and "final_eval_step" not in summary  # no eval after step 0's
    assert [r["policy_version"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    published = load_file(str(run_dir / "weights" / "v2.safetensors"))  # version 2 as the trainer published it
    initial = load_hf_weights(resolve_checkpoint("tiny"))
    assert final.keys() == published.keys()
    assert all(torch.equal(final[k], published[k].to(torch.bfloat16)) for k in final)
    assert any(not torch.equal(final[k], initial[k].to(torch.bfloat16)) for k in final)  # trained, not the start
