"""`meshrl bench generation`: what the generator actor costs against its engine itself, and what a second
replica buys, all in one run on the same prompts; `--impl vllm` (the default) or `--impl torch` (the torch
generator on the trainer's own model, meshrl/actors/torch_generator.py), the same prompts either way.

- raw: the engine alone on every prompt at once, timed inside the actor process (the same placement as the
  next figure: one process on all the cores given): `vllm.LLM.generate` in one call, or the torch engine's
  requests all added and stepped to the end;
- one replica: the same actor, sent one call per prompt's group concurrently, as the controller
  sends them (continuous batching inside the replica), timed by the caller;
- N replicas: N actors, each pinned to its own share of the cores, groups routed to the least loaded.

Each figure is generated tokens per second, the best of `repeats` warm runs.
"""

import asyncio
import time

from monarch.actor import endpoint

from meshrl.actors import cpu_name, parse_cpus
from meshrl.actors.generator import VLLMGenerator
from meshrl.actors.generator_config import GeneratorConfig
from meshrl.actors.torch_generator import TorchGenerator
from meshrl.actors.replicas import ReplicaPool, monarch_replicas
from meshrl.models.model import ChatTokenizer, resolve_checkpoint
from meshrl.tasks.sum_digits import SumDigits, SumDigitsConfig
from meshrl.types import Prompt, Sampling
from meshrl.weight_sync import WeightSyncConfig


class TimedVLLMGenerator(VLLMGenerator):
    """The generator, plus its engine's plain `LLM.generate` for the raw figure."""

    @endpoint
    async def raw_generate(self, prompts: list[Prompt], sampling: Sampling) -> tuple[int, float]:
        """(tokens generated, seconds) of one `LLM.generate` call on every prompt."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(n=sampling.n, temperature=sampling.temperature, max_tokens=sampling.max_tokens,
                                logprobs=0)
        start = time.perf_counter()
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts], params,
                                    use_tqdm=False)
        seconds = time.perf_counter() - start
        return sum(len(o.token_ids) for request in outputs for o in request.outputs), seconds


class TimedTorchGenerator(TorchGenerator):
    """The torch generator, plus its engine stepped alone for the raw figure."""

    @endpoint
    async def raw_generate(self, prompts: list[Prompt], sampling: Sampling) -> tuple[int, float]:
        """(tokens generated, seconds) of every prompt's requests added to the engine and stepped to the end."""
        start, tokens = time.perf_counter(), 0
        for i, prompt in enumerate(prompts):
            self.engine.add(f"raw{i}", prompt.token_ids, n=sampling.n, temperature=sampling.temperature,
                            max_tokens=sampling.max_tokens)
        while self.engine.has_unfinished():
            tokens += sum(len(out.token_ids) for out in self.engine.step())
        return tokens, time.perf_counter() - start


TIMED = {"vllm": TimedVLLMGenerator, "torch": TimedTorchGenerator}


def run(model: str, prompts: int, group_size: int, max_tokens: int, replicas: int, repeats: int,
        impl: str = "vllm", exact: bool = False) -> dict:
    return asyncio.run(_run(model, prompts, group_size, max_tokens, replicas, repeats, impl, exact))


async def _run(model: str, num_prompts: int, group_size: int, max_tokens: int, replicas: int, repeats: int,
               impl: str = "vllm", exact: bool = False) -> dict:
    """`exact` (impl torch): generator.exact, its re-scoring in the replicas' figures (float32 weights)."""
    checkpoint = resolve_checkpoint(model)
    tokenizer = ChatTokenizer(checkpoint)
    task = SumDigits(SumDigitsConfig())
    prompts = [Prompt(i, tokenizer.encode_chat(task.train_sample(i).prompt)) for i in range(num_prompts)]
    sampling = GeneratorConfig(max_tokens=max_tokens).sampling(n=group_size)  # as training rollouts sample
    cores = sorted(parse_cpus(""))
    timed = TIMED[impl]
    options = {"exact": True, "dtype": "float32"} if exact else {}
    result = {"impl": impl, "exact": exact, "cpu": cpu_name(), "model": model, "prompts": num_prompts, "group_size": group_size, "max_tokens": max_tokens,
              "cores": len(cores), "repeats": repeats}

    one = ReplicaPool("generator", monarch_replicas(lambda i: f"generator{i}", timed, lambda i: (
        GeneratorConfig(impl=impl, weight_update="drain", num_threads=len(cores), cpus=",".join(map(str, cores)),
                        **options), WeightSyncConfig(), str(checkpoint))),
        count=1, max_restarts=0)
    await one.start()
    try:
        actor = one.replicas[0].actor
        await actor.raw_generate.call_one(prompts[:4], sampling)  # warm up
        raw = [await actor.raw_generate.call_one(prompts, sampling) for _ in range(repeats)]
        result["raw"] = _best([tokens / seconds for tokens, seconds in raw])
        result["one_replica"] = _best([await _per_group(one, prompts, sampling) for _ in range(repeats)])
    finally:
        await one.stop()

    shares = [cores[i::replicas] for i in range(replicas)]  # cores dealt out in turn
    many = ReplicaPool("generator", monarch_replicas(lambda i: f"generator{i}", timed, lambda i: (
        GeneratorConfig(impl=impl, weight_update="drain", num_threads=len(shares[i]), cpus=",".join(map(str, shares[i])),
                        seed=i, **options), WeightSyncConfig(),
        str(checkpoint))), count=replicas, max_restarts=0)
    await many.start()
    try:
        await _per_group(many, prompts[:4 * replicas], sampling)  # warm up
        result[f"{replicas}_replicas"] = _best([await _per_group(many, prompts, sampling) for _ in range(repeats)])
    finally:
        await many.stop()
    result["one_replica_vs_raw"] = result["one_replica"]["tokens_per_s"] / result["raw"]["tokens_per_s"]
    result[f"{replicas}_replicas_vs_one"] = (result[f"{replicas}_replicas"]["tokens_per_s"]
                                              / result["one_replica"]["tokens_per_s"])
    return result


async def _per_group(pool: ReplicaPool, prompts: list[Prompt], sampling: Sampling) -> float:
    """Tokens per second of every prompt's group sent as its own call, all at once, as the controller does."""
    async def one(replica, prompt: Prompt):
        return replica, (await replica.actor.generate.call_one([prompt], sampling=sampling)).completions

    start = time.perf_counter()
    groups = await asyncio.gather(*(pool.call(lambda r, p=p: one(r, p)) for p in prompts))
    seconds = time.perf_counter() - start
    # the replicas keep what they generated until told (as the controller lets a group go): untimed
    await asyncio.gather(*(replica.actor.forget.call_one([g.key for g in group]) for replica, group in groups))
    return sum(g.num_tokens for _, group in groups for g in group) / seconds


def _best(tokens_per_s: list[float]) -> dict:
    return {"tokens_per_s": max(tokens_per_s), "runs": tokens_per_s}


def report(result: dict) -> str:
    n = next(k for k in result if k.endswith("_replicas"))
    return "\n".join([
        f"generation ({result.get('impl', 'vllm')}{', exact' if result.get('exact') else ''}), {result['model']}: {result['prompts']} prompts x "
        f"{result['group_size']} completions, up to {result['max_tokens']} tokens, {result['cores']} cores "
        f"(best of {result['repeats']})",
        f"  raw engine                    {result['raw']['tokens_per_s']:8.1f} tokens/s",
        f"  one replica, a call per group {result['one_replica']['tokens_per_s']:8.1f} tokens/s"
        f"  ({result['one_replica_vs_raw']:.2f} x raw)",
        f"  {n.replace('_', ' '):29s} {result[n]['tokens_per_s']:8.1f} tokens/s  ({result[n + '_vs_one']:.2f} x one)",
    ])
