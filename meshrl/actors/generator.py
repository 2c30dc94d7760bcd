"""The generator: vLLM in process, producing Completions with per-token logprobs and their policy version.
The logprobs are those of the distribution each token was sampled from (vLLM's processed logprobs:
after the temperature), which is what the trainer scores the same tokens under.

`generate` is a concurrent endpoint: every call adds its requests to the one vLLM engine, and a
single driver task steps the engine while any request is unfinished (continuous batching), so the
controller can send one prompt's group at a time without losing throughput. Weights are reloaded
between two engine steps; requests in flight finish under the new weights and keep the version they
started from (the oldest policy they sampled from).
"""

import asyncio
import itertools
import logging
import os

from monarch.actor import Actor, concurrent_endpoint, endpoint

from meshrl.actors import has_bf16_math, pin_cpus, resolve_device
from meshrl.actors.roles import ReplicaBroken
from meshrl.configs import GeneratorConfig, WeightSyncConfig
from meshrl.model import published_weights
from meshrl.types import Completion, Prompt, Sampling
from meshrl.weight_sync.ring import RingHandle
from meshrl.weight_sync.shards import ShardedReader

logger = logging.getLogger(__name__)


class VLLMGenerator(Actor):
    def __init__(self, config: GeneratorConfig, weight_sync: WeightSyncConfig, checkpoint: str):
        # vLLM reads these at import: keep the engine in this process, size its CPU KV cache,
        # and keep the thread count we pin instead of lowering it to 1.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
        os.environ["OMP_NUM_THREADS"] = str(config.num_threads)
        if config.cpus:  # vLLM binds its OpenMP threads itself: to our cores, not to all of them
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.cpus
        # vLLM's per-call CPU notices would drown the progress bar; VLLM_LOGGING_LEVEL=INFO brings them back.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        pin_cpus(config.cpus, config.num_threads)
        from vllm import LLM

        self.config = config
        # processed logprobs: those of the distribution each token was sampled from (after the temperature),
        # which the trainer's logprobs of logits / temperature are compared with
        self.llm = LLM(checkpoint, dtype=vllm_dtype(config.dtype), max_model_len=config.max_model_len,
                       gpu_memory_utilization=config.memory_fraction, seed=config.seed, enforce_eager=True,
                       logprobs_mode="processed_logprobs")
        # what the trainer's ranks publish, together
        self.layout, self.adapter = published_weights(checkpoint, weight_sync.dtype)
        self.transport = weight_sync.transport
        self.ring: ShardedReader | None = None
        self.pulling = asyncio.Lock()  # one pull at a time: they share the reader's buffer
        self.policy_version = 0
        self.engine = self.llm.llm_engine
        self.request_ids = itertools.count()
        self.waiting: dict[str, asyncio.Future] = {}  # request id -> its final RequestOutput
        self.driver: asyncio.Task | None = None
        self.broken: ReplicaBroken | None = None  # the engine failed: every call raises it

    @concurrent_endpoint
    async def generate(self, prompts: list[Prompt], *, sampling: Sampling | None = None) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self.broken:
            raise self.broken
        s = sampling or Sampling(temperature=self.config.temperature, top_p=self.config.top_p,
                                 max_tokens=self.config.max_tokens)
        params = SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens,
                                logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY, stop=s.stop or None,
                                include_stop_str_in_output=True)
        version = self.policy_version
        loop = asyncio.get_running_loop()
        futures = []
        for prompt in prompts:  # vLLM refusing one (too long, say) raises here: this call's group fails
            request_id = str(next(self.request_ids))
            self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt.token_ids), params)
            self.waiting[request_id] = future = loop.create_future()
            futures.append(future)
        if self.driver is None or self.driver.done():
            self.driver = asyncio.create_task(self._drive())
        outputs = await asyncio.gather(*futures)
        return [
            Completion(
                prompt_index=prompt.index,
                prompt_token_ids=prompt.token_ids,
                token_ids=list(out.token_ids),
                logprobs=[step[token].logprob for step, token in zip(out.logprobs, out.token_ids)],
                text=out.text,
                policy_version=version,
                finish_reason=out.finish_reason,
            )
            for prompt, request in zip(prompts, outputs)
            for out in request.outputs
        ]

    async def _drive(self) -> None:
        """Step the engine until no request is left, handing each finished request to its caller.
        Yields to the actor's loop between steps so that new requests and weight pulls get in."""
        try:
            await asyncio.sleep(0)  # let calls already queued add their requests before the first step
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and (future := self.waiting.pop(output.request_id, None)):
                        future.set_result(output)
                await asyncio.sleep(0)
        except Exception as e:  # the engine is broken: every caller learns why, and the replica is replaced
            self.broken = ReplicaBroken(f"vLLM's engine failed: {e!r}")
            for future in self.waiting.values():
                future.set_exception(self.broken)
            self.waiting.clear()
            raise

    @endpoint
    async def attach_weights(self, rings: list[RingHandle]) -> str:
        """Pull weights from the trainer's rings (one per rank, in rank order) from now on; returns the
        transport chosen."""
        self.ring = ShardedReader(rings, self.layout, self.adapter.to_hf, self.transport)
        served, published = self.engine.model_config.dtype, self.layout.specs[0].dtype
        if served != published:
            logger.warning("versions are published in %s but vLLM serves %s here: the served policy is a rounded "
                           "copy of the trained one (weight_sync.dtype)", published, served)
        return self.ring.transport

    @endpoint
    async def pull_weights(self) -> int:
        """Load the ring's newest version in place, if newer than ours; return the version now served."""
        if self.ring is None:
            raise RuntimeError("pull_weights before attach_weights: no weight ring to pull from")
        async with self.pulling:
            latest = await self.ring.pull_latest(newer_than=self.policy_version)
            if latest is not None:
                version, weights = latest
                self.llm.llm_engine.model_executor.driver_worker.worker.reload_weights(weights_iterator=iter(weights))
                self.llm.llm_engine.reset_prefix_cache()
                self.policy_version = version
            return self.policy_version

    @endpoint
    async def weight_sync_stats(self) -> dict:
        return {"transport": self.ring.transport, "torn_reads": self.ring.torn_reads,
                "corrupt_reads": self.ring.corrupt_reads}


def vllm_dtype(dtype: str) -> str:
    """`auto`: bfloat16 where vLLM's device (a GPU if there is one, else the CPU) has bf16 math, else
    float32; any other value goes to vLLM as it is."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if has_bf16_math(resolve_device("auto")) else "float32"
