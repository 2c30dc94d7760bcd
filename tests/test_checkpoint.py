"""Checkpoints and exact resume with real actors, vLLM and torchtitan (tiny model): the trainer's
restored state and its next step equal the uninterrupted ones bit for bit; a run killed with SIGKILL
after a checkpoint goes on from it (sync and async) without losing, repeating or skipping a step or a
prompt; and steps whose loss turns NaN are not applied, counted, and stop the run."""

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict

import psutil
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from meshrl.actors import spawn
from meshrl.actors.trainer import TitanTrainer
from meshrl.configs import TrainerConfig, WeightSyncConfig
from meshrl.train_step import train_step
from meshrl.types import Episode


def batch_of_episodes(seed: int, vocab: int = 1000) -> list[Episode]:
    """Six episodes of random tokens with advantages that are not all equal (so the step trains)."""
    rng = random.Random(seed)
    episodes = []
    for i in range(6):
        prompt, response = rng.randint(3, 6), rng.randint(4, 9)
        episodes.append(Episode(tokens=[rng.randrange(vocab) for _ in range(prompt + response)],
                                loss_mask=[False] * prompt + [True] * response,
                                behaviour_logprobs=[0.0] * prompt + [-rng.uniform(4, 8) for _ in range(response)],
                                advantage=rng.uniform(-1, 1), policy_version=0, group_id=i // 3))
    return episodes


def flat_state(path, out) -> dict:
    """A DCP checkpoint's tensors as one flat {name: tensor}."""
    dcp_to_torch_save(path, out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_restored_trainer_and_its_next_step_equal_the_uninterrupted_trainer_bit_for_bit(tiny_checkpoint, tmp_path):
    config = TrainerConfig(lr=1e-2, num_threads=1, mini_batches=2, micro_batch_size=2)
    batches = [batch_of_episodes(seed) for seed in range(3)]

    async def step(trainer, episodes) -> dict:
        metrics = await train_step(trainer, None, episodes, config, pad_id=0)
        await trainer.publish_weights.call_one()
        return metrics

    async def run():
        spawned = [spawn(name, TitanTrainer, config, WeightSyncConfig(), str(tiny_checkpoint)) for name in "ab"]
        try:
            (_, a), (_, b) = spawned
            for episodes in batches[:2]:
                assert (await step(a, episodes))["updates_skipped"] == 0
            await a.save_state.call_one(str(tmp_path / "a2"))
            a3 = await step(a, batches[2])
            await a.save_state.call_one(str(tmp_path / "a3"))
            assert await b.load_state.call_one(str(tmp_path / "a2")) == 2  # restored, and published as version 2
            await b.save_state.call_one(str(tmp_path / "b2"))
            b3 = await step(b, batches[2])
            await b.save_state.call_one(str(tmp_path / "b3"))
            return a3, b3
        finally:
            for procs, _ in spawned:
                await procs.stop()

    a3, b3 = asyncio.run(run())
    a2_state, b2_state = flat_state(tmp_path / "a2", tmp_path / "a2.pt"), flat_state(tmp_path / "b2", tmp_path / "b2.pt")
    assert any(".optim.state." in k for k in a2_state) and any(".model." in k for k in a2_state)
    assert_identical(a2_state, b2_state)  # the model and all of AdamW's state, as saved
    assert a3["loss"] != 0 and a3["loss"] == b3["loss"] and a3["grad_norm"] == b3["grad_norm"]
    assert_identical(flat_state(tmp_path / "a3", tmp_path / "a3.pt"), flat_state(tmp_path / "b3", tmp_path / "b3.pt"))
    assert torch.load(tmp_path / "b3" / "rank0.pt")["policy_version"] == 3


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train(run_dir, *args) -> list[str]:
    return [sys.executable, "-m", "meshrl", "train", *(["--config", "smoke", "--run-dir", str(run_dir)]
                                                       if "--resume" not in args else []), *args]


def prompts_by_step(run_dir) -> dict[int, list[int]]:
    steps = defaultdict(list)
    for r in read_jsonl(run_dir / "rollouts.jsonl"):
        steps[r["step"]].append(r["prompt_index"])
    return {step: sorted(set(p)) for step, p in sorted(steps.items())}


def kill_after_checkpoint(run_dir, args, step: int) -> None:
    """Start a run, SIGKILL it and every process it started as soon as checkpoint `step` is complete."""
    run = subprocess.Popen(train(run_dir, *args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    family = []
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / f"step-{step}").is_dir():
            assert run.poll() is None, run.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint was written"
            family = psutil.Process(run.pid).children(recursive=True) or family
            time.sleep(0.05)
        for p in [psutil.Process(run.pid), *family]:
            p.send_signal(signal.SIGKILL)
    finally:
        if run.poll() is None:
            run.kill()
        run.wait()
    psutil.wait_procs(family, timeout=10)


def test_a_run_killed_after_a_checkpoint_resumes_where_it_stopped(tmp_path):
    """SIGKILL, real processes, synchronous training. What a checkpoint holds when groups are in flight,
    at every await point and for max_policy_age 0 to 2, is tested with fake actors (test_controller.py)."""
    args = ["--controller.steps", "4", "--checkpoint.every", "2", "--checkpoint.keep", "0"]
    killed = tmp_path / "killed"
    kill_after_checkpoint(killed, args, step=2)
    at_checkpoint = json.loads((killed / "checkpoints" / "step-2" / "checkpoint.json").read_text())
    assert at_checkpoint["step"] == 2 and at_checkpoint["policy_version"] == 2
    # synchronous: written before step 3's groups start; whatever was started is to be redone
    assert at_checkpoint["prompts_generated_not_trained"] == []
    assert at_checkpoint["next_prompt"] - len(at_checkpoint["prompts_to_redo"]) == 4

    resumed = subprocess.run(train(killed, "--resume", str(killed)), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {killed / 'checkpoints' / 'step-2'} (step 2, policy version 2)" in resumed.stdout
    rows = read_jsonl(killed / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    trained = prompts_by_step(killed)
    every = [p for step in trained.values() for p in step]
    assert len(every) == len(set(every)) == 8  # no prompt lost, none trained twice
    versions = {(r["step"], r["prompt_index"]): r["policy_version"] for r in read_jsonl(killed / "rollouts.jsonl")}
    assert all(versions[(step, p)] == step - 1 for step, prompts in trained.items() for p in prompts)
    assert json.loads((killed / "summary.json").read_text())["steps"] == 4
    # the same prompts in the same steps as a run never interrupted
    whole = tmp_path / "whole"
    result = subprocess.run(train(whole, *args), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert prompts_by_step(whole) == trained == {1: [0, 1], 2: [2, 3], 3: [4, 5], 4: [6, 7]}


def test_nan_losses_are_not_applied_counted_and_stop_the_run_with_the_last_good_checkpoint_kept(tmp_path):
    result = subprocess.run(train(tmp_path, "--controller.steps", "6", "--checkpoint.every", "1",
                                  "--trainer.impl", "faulty_actors:NaNTrainer", "--trainer.max_bad_steps", "2"),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("meshrl: error: 2 steps in a row had a NaN or infinite loss or gradient norm "
                           "(trainer.max_bad_steps 2); the newest checkpoint, ") and "step-1, is from before" in last
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["updates_skipped"], r["steps_skipped"]) for r in rows] == [(1, 0, 0), (2, 1, 1), (3, 1, 2)]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]  # the versions go on (unchanged weights)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-1"]
    # the policy saved is the last good one: bad updates never touched the weights
    assert (tmp_path / "final" / "model.safetensors").is_file()
