"""The generator: vLLM in process, producing Completions with per-token logprobs and, for every token,
the policy version it was sampled from. The logprobs are those of the distribution each token was
sampled from (vLLM's processed logprobs: after the temperature), which is what the trainer scores
the same tokens under.

`generate` is a concurrent endpoint: every call adds its requests to the one vLLM engine, and a
single driver task steps the engine while any request is unfinished (continuous batching), so the
controller can send one prompt's group at a time without losing throughput.

The Completions stay here (`held`, by a key unique to the run) until the replay buffer takes them
(`completions(keys, forget=True)`) or the controller lets them go (`forget`); the controller gets a
`Generated` of each, no token list. A later turn of a conversation names the earlier one (`Prompt.prefix`)
and sends only its new tokens; the earlier turn is taken from the generator holding it if not this one.

The generator loads new weights itself, between two engine steps, as `generator.weight_update` says:
- `drain`: a call that needs a newer version than the one served (`min_version`) stops new requests,
  waits for the running ones to finish, loads, and goes on. No sequence spans two versions.
- `in_flight`: the driver checks the trainer's ring between engine steps (every `weight_sync.poll_s`)
  and loads a newer version at once; running requests go on under the new weights, keeping the KV
  cache of their prefix as the older weights computed it. Their later tokens carry the new version.
- `recompute`: the same, but the swap preempts the running requests and vLLM recomputes their
  prefixes under the new weights before they go on.
New requests never share prefix-cache blocks with requests of another version (a per-version
`cache_salt`), whatever the mode. A load reads the version whole into the reader's own memory off the
event loop, then swaps it into vLLM between two engine steps; a read that does not finish within
`weight_sync.timeout_s` breaks the replica (ReplicaBroken) before any of it reaches vLLM: the
controller replaces it. So does a call asking for a version the replica cannot load (`min_version`
newer than its rings hold): a call is served from `min_version` or newer, or fails.

With `generator.tensor_parallel_size` > 1 vLLM runs a worker process per GPU of the replica (its GPUs
come from meshrl/runtime/gpu_plan.py): each worker then maps the shared memory the version was read into
and loads its own part of every tensor (meshrl/weight_sync/handoff.py; no file), the swap running in a
thread while the engine takes no step and admits no request, so the replica's other calls are answered
meanwhile.
"""

import asyncio
import itertools
import logging
import time
import zlib

import torch
from monarch.actor import Actor, concurrent_endpoint, endpoint

from meshrl.actors import for_throughput
from meshrl.actors.adapters import MergedAdapter, ServedAdapter, lora_options, serves_adapters
from meshrl.actors.engine import start_vllm
from meshrl.actors.generator_config import WEIGHT_UPDATES, GeneratorConfig
from meshrl.actors.held import HeldCompletions, PartialCompletion, Request, graded, take_held
from meshrl.actors.roles import ReplicaBroken
from meshrl.actors.weight_updates import WeightUpdates
from meshrl.models.lora import LoraConfig
from meshrl.types import Completion, Generation, Grading, Prompt, Sampling
from meshrl.weight_sync import WeightSyncConfig, published_weights
from meshrl.weight_sync.device_ring import DeviceRingHandle, DeviceRingReader
from meshrl.weight_sync.disk import DiskHandle, DiskReader
from meshrl.weight_sync.handoff import Handoff
from meshrl.weight_sync.relay import RelayHandle, RelayedReader, open_reader
from meshrl.weight_sync.ring import RingHandle
from meshrl.weight_sync.shards import ShardedReader
from meshrl.weight_sync.verify import Verifier

logger = logging.getLogger(__name__)
HANDOFF_WORKER = "meshrl.weight_sync.handoff.SharedWeightsWorker"  # mixed into vLLM's workers: `hand_to_workers`


class VLLMGenerator(Actor):
    def __init__(self, config: GeneratorConfig, weight_sync: WeightSyncConfig, checkpoint: str,
                 lora: LoraConfig | None = None):
        """`lora` (the trainer's, when it trains an adapter): vLLM serves the base with the trainer's adapter,
        loaded in place at each version (meshrl/actors/adapters.py)."""
        self.config = config
        for_throughput()  # the replay buffer takes its completions a thousand at a time
        # processed logprobs: those of the distribution each token was sampled from (after the temperature),
        # which the trainer's logprobs of logits / temperature are compared with
        # the run plans each replica's GPUs (meshrl/runtime/gpu_plan.py): none on a CPU-only host
        served = bool(lora and lora.rank and serves_adapters(lora, on_gpu=bool(config.devices)))
        self.llm = start_vllm(checkpoint, dtype=config.dtype, max_model_len=config.max_model_len,
                              memory_fraction=config.memory_fraction, seed=config.seed, num_threads=config.num_threads,
                              cpus=config.cpus, kv_cache_gib=config.kv_cache_gib, devices=config.devices,
                              tensor_parallel_size=config.tensor_parallel_size, engine=config.engine,
                              logprobs_mode="processed_logprobs", worker_extension_cls=HANDOFF_WORKER,
                              **(lora_options(lora) if served else {}))
        # what the trainer's ranks publish, together
        self.layout, self.to_hf = published_weights(checkpoint, weight_sync.dtype, lora)
        self.adapter: ServedAdapter | MergedAdapter | None = None
        if served:
            self.adapter = ServedAdapter(self.llm.llm_engine, lora, self.to_hf, checkpoint, self.layout)
        elif lora and lora.rank:
            self.adapter = MergedAdapter(lora, self.to_hf, checkpoint, self.layout.specs[0].dtype)
        self.transport, self.pull_timeout, self.poll_s = weight_sync.transport, weight_sync.timeout_s, weight_sync.poll_s
        self.update = config.weight_update
        if self.update not in WEIGHT_UPDATES:  # `auto` is the run's to choose (meshrl.configs.resolve)
            raise ValueError(f"generator.weight_update {self.update!r} is not resolved: a replica is given one of "
                             f"{', '.join(WEIGHT_UPDATES)}")
        self.ring: ShardedReader | RelayedReader | DiskReader | DeviceRingReader | None = None
        # versions reach vLLM's workers in processes of their own through shared memory (tensor parallelism)
        self.through_workers = config.tensor_parallel_size > 1
        self.handoff = Handoff()
        self.swapped = asyncio.Event()  # cleared while a swap loads the workers: the engine takes no step
        self.swapped.set()
        self.verifier = Verifier(weight_sync.disk_dir, self.reload, self._vllm_model) if weight_sync.verify else None
        self.loading = asyncio.Lock()  # one load at a time: they share the reader's buffer
        self.book = WeightUpdates()
        self.policy_version = 0
        self.engine = self.llm.llm_engine
        self.request_ids = itertools.count()
        self.held = HeldCompletions()  # the Completions made and not yet taken
        self.running: dict[str, Request] = {}
        self.driver: asyncio.Task | None = None
        self.poller: asyncio.Task | None = None
        self.next_poll = 0.0
        self.broken: ReplicaBroken | None = None  # the engine or a pull failed: every call raises it
        self.prompt_tokens = self.cached_prompt_tokens = 0  # of the requests finished since the last report
        self.asleep = False  # vLLM's sleep mode: its KV cache freed and weights in host memory (`sleep`)

    @concurrent_endpoint
    async def generate(self, prompts: list[Prompt], *, sampling: Sampling | None = None,
                       min_version: int = 0, text: bool = False, grading: Grading | None = None) -> Generation:
        """`sampling.n` completions per prompt, their first tokens from version `min_version` or newer, each
        held here and answered as a Generated (with its text if `text`), with the report since the last;
        with `grading`, scored by its grader first (meshrl/actors/held.py's `graded`)."""
        prompts = [await self._whole(p) for p in prompts]
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self.policy_version < min_version:
            await self._load_or_break()
        await self.book.admitting.wait()
        if self.broken:
            raise self.broken
        if self.policy_version < min_version:  # published, yet not in the rings this replica reads: a replica fault
            self._fail(ReplicaBroken(f"it was asked for policy version {min_version} or newer but its weight rings "
                                     f"hold {self.policy_version} at newest"))
            raise self.broken
        s = sampling or self.config.sampling()
        loop = asyncio.get_running_loop()
        requests = []
        self._wake()
        for prompt in prompts:  # vLLM refusing one (too long, say) raises here: this call's group fails
            # request_seeds: seeded from the engine's seed, its prompt and the version, the same samples whatever
            # else the engine batches with it
            seed = zlib.crc32(f"{self.config.seed}/{prompt.index}/{len(prompt.token_ids)}/{self.policy_version}/{s}"
                              .encode()) if self.config.request_seeds else None
            params = SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens,
                                    logprobs=0, output_kind=RequestOutputKind.DELTA, stop=s.stop or None,
                                    include_stop_str_in_output=True, seed=seed)
            request_id = str(next(self.request_ids))
            self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt.token_ids,
                                                             cache_salt=f"v{self.policy_version}"), params,
                                    lora_request=self.adapter.request if isinstance(self.adapter, ServedAdapter) else None)
            self.running[request_id] = request = Request(prompt, [PartialCompletion() for _ in range(s.n)], loop.create_future())
            requests.append(request)
        self.book.running()
        if self.driver is None or self.driver.done():
            self.driver = asyncio.create_task(self._drive())
        await asyncio.gather(*(r.done for r in requests))
        made = [self._completion(r.prompt, seq) for r in requests for seq in r.sequences]
        return await graded(Generation([self.held.keep(c, text) for c in made], self._report()), made, grading)

    async def _whole(self, prompt: Prompt) -> Prompt:
        """`prompt` with its prefix's tokens in front (the held turn it names, here or on its holder)."""
        if prompt.prefix is None:
            return prompt
        if prompt.prefix_holder is None:
            [before] = self.held.take([prompt.prefix])
        else:
            [before] = await take_held(prompt.prefix_holder, [prompt.prefix])
        return Prompt(prompt.index, (before.prompt_token_ids + before.token_ids).tolist() + prompt.token_ids)

    @concurrent_endpoint
    async def completions(self, keys: list[int], forget: bool = False) -> list[Completion]:
        """The held Completions `keys` name, let go here with `forget` (the replay buffer took them)."""
        return self.held.take(keys, forget)

    @concurrent_endpoint
    async def forget(self, keys: list[int]) -> None:
        """Let the held Completions `keys` go (a group dropped, failed or evaluated)."""
        self.held.forget(keys)

    def _completion(self, prompt: Prompt, seq: PartialCompletion) -> Completion:
        first = seq.versions[0][1] if seq.versions else self.policy_version
        return Completion(prompt.index, prompt.token_ids, seq.token_ids, seq.logprobs, seq.text, first,
                          seq.finish_reason, seq.versions if len(seq.versions) > 1 else [], sum(seq.logprobs))

    async def _drive(self) -> None:
        """Step the engine until no request is left, handing each finished request to its caller; between
        steps, let new requests in and (in_flight, recompute) look for a newer version now and then."""
        try:
            await asyncio.sleep(0)  # let calls already queued add their requests before the first step
            while self.engine.has_unfinished_requests():
                await self.swapped.wait()  # not while the workers load a version (`_swap`)
                self._take(self.engine.step())
                if self.update != "drain" and self.ring and time.monotonic() >= self.next_poll and (
                        self.poller is None or self.poller.done()):
                    self.next_poll = time.monotonic() + self.poll_s
                    self.poller = asyncio.create_task(self._poll())
                await asyncio.sleep(0)
            self.book.done()
        except Exception as e:  # the engine is broken: every caller learns why, and the replica is replaced
            self._fail(ReplicaBroken(f"vLLM's engine failed: {e!r}"))
            raise

    def _take(self, outputs) -> None:
        """One step's new tokens, each sampled under the version served now."""
        for output in outputs:
            request = self.running.get(output.request_id)
            if request is None:
                continue
            for out in output.outputs:
                seq = request.sequences[out.index]
                seq.add(out.token_ids, out.logprobs or [], out.text, self.policy_version)
                seq.finish_reason = out.finish_reason or seq.finish_reason
            if output.finished or all(seq.finish_reason for seq in request.sequences):
                self.prompt_tokens += len(request.prompt.token_ids)  # vLLM's prefix cache served what it could
                self.cached_prompt_tokens += output.num_cached_tokens or 0
                del self.running[output.request_id]
                request.done.set_result(None)

    async def _poll(self) -> None:
        try:
            await self._load_or_break()
        except ReplicaBroken:
            pass  # every call learns it

    async def _load_or_break(self) -> None:
        """A load whose failure (a pull that hangs, a ring that cannot be read) breaks the replica."""
        try:
            await self._load()
        except ReplicaBroken as e:
            self._fail(e)
            raise
        except Exception as e:
            broken = ReplicaBroken(f"its weight pull failed: {e!r}")
            self._fail(broken)
            raise broken from e

    async def _load(self) -> None:
        """Load the rings' newest version if newer than the one served, as `weight_update` says: read it whole
        into the reader's own memory, off the event loop (the engine steps on meanwhile, unless draining)
        and within `weight_sync.timeout_s`, then swap it into vLLM between two engine steps. A read that
        times out breaks the replica before anything of it reaches vLLM, and stops at its next chunk: it
        only ever writes the reader's memory."""
        if self.ring is None:
            raise RuntimeError("no weight ring to load from: attach_weights first")
        async with self.loading:
            if self.broken:  # an earlier load broke it: nothing more is loaded
                raise self.broken
            if await self._within_timeout(self.ring.newest()) <= self.policy_version:  # headers only
                return
            async with self.book.loading(drain=self.update == "drain"):
                start, staged, read_s = time.time(), [], 0.0
                in_place = isinstance(self.ring, DeviceRingReader)
                if not in_place:
                    version = await self._within_timeout(self.ring.load_latest(
                        lambda v, weights: staged.append(weights), newer_than=self.policy_version))
                    if version is None:
                        return
                    read_s = time.time() - start
                # no engine step and no new request between the reload, the version's change and the cache
                # reset: no await below but the swap's own (`_swap`, `_swap_in_place`)
                in_flight = bool(self.running)
                self._wake()
                if in_place:
                    version = await self._within_timeout(self._swap_in_place())
                    if version is None:
                        return
                else:
                    await self._swap(staged[-1])
                self.policy_version = version
                if in_flight and self.update == "in_flight":
                    reset = True  # running requests keep their prefixes' KV; new ones get a new cache salt
                else:
                    reset = self.engine.reset_prefix_cache(reset_running_requests=in_flight)
                self.book.loaded(start, version, in_flight, reset, read_s=read_s)
                if self.verifier:  # after the load's timing: the check is not part of it
                    self.verifier.check(version)

    async def _within_timeout(self, read):
        """A read of the rings, bounded by `weight_sync.timeout_s` (past it, the replica is broken)."""
        try:
            return await asyncio.wait_for(read, self.pull_timeout or None)
        except TimeoutError:
            raise ReplicaBroken(f"its weight pull did not finish within {self.pull_timeout:g} s "
                                "(weight_sync.timeout_s)") from None

    async def _swap(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """`reload` the version: into the one worker in this process right here, between two engine steps; into
        workers of their own (tensor parallelism) in a thread, the event loop free for the replica's other
        calls meanwhile, while the driver takes no engine step and no request is admitted (the caller's
        `book.loading` admits again once the version is served)."""
        if not self.through_workers or isinstance(self.adapter, ServedAdapter):
            return self.reload(weights)
        self.swapped.clear()
        self.book.admitting.clear()
        swap = asyncio.ensure_future(asyncio.to_thread(self.reload, weights))
        try:
            await asyncio.shield(swap)
        finally:  # the engine steps again once the workers are done, even if this wait was cancelled
            swap.add_done_callback(lambda _: self.swapped.set())

    async def _swap_in_place(self) -> int | None:
        """A ring in device memory (meshrl/weight_sync/device_ring.py): vLLM loads straight from the ring's slot,
        and a load the trainer overtook is done again with a newer version; the engine takes no step until one
        version is loaded whole (the workers' last load may outlive a cancelled wait: the engine waits for it)."""
        self.swapped.clear()
        swaps = []

        async def load(version: int, weights: list[tuple[str, torch.Tensor]]) -> None:
            if not self.through_workers or isinstance(self.adapter, ServedAdapter):
                return self.reload(weights)
            self.book.admitting.clear()  # as `_swap`: no request added while the workers load in a thread
            swaps.append(asyncio.ensure_future(asyncio.to_thread(self.reload, weights)))
            await asyncio.shield(swaps[-1])

        try:
            return await self.ring.load_latest(load, newer_than=self.policy_version)
        finally:
            if swaps and not swaps[-1].done():
                swaps[-1].add_done_callback(lambda _: self.swapped.set())
            else:
                self.swapped.set()

    def reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors into vLLM in place: handed to its one worker in this process, or with
        tensor parallelism (workers in processes of their own) through the shared memory they lie in, which
        each worker maps, loading its own part of every tensor (`hand_to_workers`)."""
        if isinstance(self.adapter, ServedAdapter):
            return self.adapter.load(weights)
        if self.adapter:  # merged: the adapted layers' full weights
            weights = self.adapter.merge(weights)
        if self.through_workers:
            self.hand_to_workers(weights)
        else:
            self.engine.model_executor.driver_worker.worker.reload_weights(weights_iterator=iter(weights))

    def _vllm_model(self) -> torch.nn.Module:
        return self.engine.model_executor.driver_worker.worker.model_runner.get_model()

    def hand_to_workers(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Every worker loads `weights` from this process's shared memory (the reader's copy; tensors the
        adapter made anew, copied once into a spill buffer), through vLLM's `collective_rpc`: it returns
        once all have loaded."""
        message = self.handoff.message(weights, self.ring.memory())
        self.llm.collective_rpc("meshrl_load_shared", kwargs=message)

    def _fail(self, error: ReplicaBroken) -> None:
        """The replica can serve no more: every call, running or to come, raises `error`."""
        self.broken = error
        for request in self.running.values():
            if not request.done.done():
                request.done.set_exception(error)
        self.running.clear()
        self.book.admitting.set()
        self.book.done()

    @endpoint
    async def sleep(self) -> bool:
        """While a synchronous step trains on the GPU this replica shares (generator.engine.sleep on): vLLM's
        sleep mode, level 1 (the KV cache freed, the weights moved to host memory), unless requests run or a
        load does; the next call or load wakes it. Whether it sleeps now."""
        if self.config.engine.sleep == "on" and not (self.asleep or self.running or self.loading.locked()):
            self.llm.sleep(level=1)
            self.asleep = True
        return self.asleep

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    @endpoint
    async def attach_weights(self, rings: list[RingHandle | DeviceRingHandle | DiskHandle | RelayHandle | None]) -> str:
        """Pull weights from the trainer's rings (one per rank, in rank order) from now on, or from its host's
        relay of them (meshrl/weight_sync/relay.py), or from its directory of versions (transport disk);
        returns the transport chosen."""
        self.ring = open_reader(rings, self.layout, self.to_hf, self.transport)
        served, published = self.engine.model_config.dtype, self.layout.specs[0].dtype
        if served != published:
            logger.warning("versions are published in %s but vLLM serves %s here: the served policy is a rounded "
                           "copy of the trained one (weight_sync.dtype)", published, served)
        return self.ring.transport

    @endpoint
    async def pull_weights(self) -> int:
        """Load the ring's newest version now (as `weight_update` says), if newer than ours; return the
        version now served."""
        await self._load_or_break()
        return self.policy_version

    @endpoint
    async def weight_updates(self) -> dict:
        """What happened since the last call: the loads (`pulls`: wall-clock start and end, version, whether
        requests were running, seconds reading the rings), swaps with requests running, prefix-cache resets vLLM refused, the
        seconds the engine had requests to run (`busy_s`), and the finished requests' prompt tokens and
        those vLLM's prefix cache served (`prompt_tokens`, `cached_prompt_tokens`), and the bytes it read from
        the trainer's rings itself (`trainer_bytes`; 0 when it reads its host's relay)."""
        return self._report()

    def _report(self) -> dict:
        """`weight_updates`' dict since the last report (this one's or a generate answer's)."""
        cache = {"prompt_tokens": self.prompt_tokens, "cached_prompt_tokens": self.cached_prompt_tokens}
        self.prompt_tokens = self.cached_prompt_tokens = 0
        return {**self.book.report(), **cache, "trainer_bytes": self.ring.take_trainer_bytes() if self.ring else 0}

    @endpoint
    async def weight_sync_stats(self) -> dict:
        return {"transport": self.ring.transport, "torn_reads": self.ring.torn_reads,
                "corrupt_reads": self.ring.corrupt_reads}
