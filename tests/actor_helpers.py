"""Shared by the tests that run real actors."""

import subprocess
import sys
import textwrap

from meshrl.episodes import episode as flat_episode
from meshrl.types import Completion, Episode, TrainBatch


def episode(completion: Completion, advantage: float, temperature: float = 1.0) -> Episode:
    return flat_episode([completion], advantage, group_id=0, temperature=temperature)


async def generate_whole(generator, prompts, **kwargs) -> list[Completion]:
    """A real generator's whole Completions: `generate` answers each one's key (a Generated), `completions`
    takes them (and the generator forgets them, as when the replay buffer takes a group's)."""
    made = await generator.generate.call_one(prompts, **kwargs)
    return await generator.completions.call_one([g.key for g in made], forget=True)


async def mismatch(trainer, completion: Completion, temperature: float = 1.0) -> float:
    """Mean |trainer logprob - generator logprob| over the completion's tokens (zero advantage: no update),
    the trainer's taken at `temperature`."""
    e = episode(completion, 0.0, temperature)
    metrics = await trainer.forward_backward.call_one(TrainBatch.collate([e], e.num_response_tokens, 1))
    return metrics["logprob_mismatch"] / metrics["tokens"]


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
