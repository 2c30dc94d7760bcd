"""What every generator replica does whatever engine samples for it: the Generator contract
(meshrl/actors/roles.py) on top of an engine that takes requests and is stepped. vLLM's
(meshrl/actors/generator.py) and the trainer's own torchtitan model (meshrl/actors/torch_generator.py) are
the two engines; each subclass adds its requests, steps its engine, loads a version into it and resets its
prefix cache. Everything else is here, once:

- `generate` is a concurrent endpoint: every call adds its requests to the one engine, and a single driver
  task steps the engine while any request is unfinished (continuous batching), so the controller can send
  one prompt's group at a time without losing throughput.
- The Completions stay here (`held`, by a key unique to the run) until the replay buffer takes them
  (`completions(keys, forget=True)`) or the controller lets them go (`forget`); the controller gets a
  `Generated` of each, no token list. A later turn of a conversation names the earlier one (`Prompt.prefix`)
  and sends only its new tokens; the earlier turn is taken from the generator holding it if not this one.
- New weights are loaded by the replica itself, between two engine steps, as `generator.weight_update`
  says:
  - `drain`: a call that needs a newer version than the one served (`min_version`) stops new requests,
    waits for the running ones to finish, loads, and goes on. No sequence spans two versions.
  - `in_flight`: the driver checks the trainer's ring between engine steps (every `weight_sync.poll_s`)
    and loads a newer version at once; running requests go on under the new weights, keeping the KV
    cache of their prefix as the older weights computed it. Their later tokens carry the new version.
  - `recompute`: the same, but the swap preempts the running requests and the engine recomputes their
    prefixes under the new weights before they go on.
  New requests never share prefix-cache entries with requests of another version. A load reads the version
  whole into the reader's own memory off the event loop, then swaps it into the engine between two steps; a
  read that does not finish within `weight_sync.timeout_s` breaks the replica (ReplicaBroken) before any of
  it reaches the engine: the controller replaces it. So does a call asking for a version the replica cannot
  load (`min_version` newer than its rings hold): a call is served from `min_version` or newer, or fails.
  A ring in device memory (meshrl/weight_sync/device_ring.py) is loaded from in place.
- The reader's copy of the version served stays whole until the next load: `save_policy` writes it as the
  policy, for a run whose trainer cannot (it is being brought back after a restart: meshrl/runtime/final.py).
"""

import asyncio
import itertools
import time
import zlib
from pathlib import Path

import torch
from monarch.actor import Actor, concurrent_endpoint, endpoint

from meshrl.actors import for_throughput
from meshrl.actors.generator_config import WEIGHT_UPDATES, GeneratorConfig
from meshrl.actors.held import HeldCompletions, PartialCompletion, Request, graded, take_held
from meshrl.actors.roles import ReplicaBroken
from meshrl.actors.weight_updates import WeightUpdates
from meshrl.models.model import save_checkpoint
from meshrl.types import Completion, Generation, Grading, Prompt, Sampling
from meshrl.weight_sync import WeightSyncConfig
from meshrl.weight_sync.device_ring import DeviceRingHandle, DeviceRingReader
from meshrl.weight_sync.disk import DiskHandle
from meshrl.weight_sync.relay import RelayHandle, open_reader
from meshrl.weight_sync.ring import RingHandle


class GeneratorActor(Actor):
    """A generator replica; a subclass sets `layout` and `to_hf` (what it reads from the rings) and implements
    `_add`, `_unfinished`, `_step`, `reload` and `_reset_cache` (and `_sleep` / `_wake_engine` for sleep mode)."""

    ENGINE = "the"  # the engine's name in a broken replica's message

    def __init__(self, config: GeneratorConfig, weight_sync: WeightSyncConfig):
        self.config = config
        for_throughput()  # the replay buffer takes its completions a thousand at a time
        self.transport, self.pull_timeout, self.poll_s = weight_sync.transport, weight_sync.timeout_s, weight_sync.poll_s
        self.update = config.weight_update
        if self.update not in WEIGHT_UPDATES:  # `auto` is the run's to choose (meshrl.configs.resolve)
            raise ValueError(f"generator.weight_update {self.update!r} is not resolved: a replica is given one of "
                             f"{', '.join(WEIGHT_UPDATES)}")
        self.ring = None  # a reader of the trainer's rings, once attached (meshrl/weight_sync/relay.py's open_reader)
        self.swapped = asyncio.Event()  # cleared while a swap loads the workers: the engine takes no step
        self.swapped.set()
        self.loading = asyncio.Lock()  # one load at a time: they share the reader's buffer
        self.book = WeightUpdates()
        self.policy_version = 0
        self.request_ids = itertools.count()
        self.held = HeldCompletions()  # the Completions made and not yet taken
        self.running: dict[str, Request] = {}
        self.driver: asyncio.Task | None = None
        self.poller: asyncio.Task | None = None
        self.next_poll = 0.0
        self.broken: ReplicaBroken | None = None  # the engine or a pull failed: every call raises it
        self.prompt_tokens = self.cached_prompt_tokens = 0  # of the requests finished since the last report
        self.asleep = False  # sleep mode: the KV cache freed (`sleep`)
        self.verifier = None
        self.checkpoint = None  # the model's directory: its config and tokenizer files go beside a saved policy
        self.served = None  # the version served, as the reader's copy holds it (None: loaded in place, or none yet)

    # --- what an engine implements
    def _add(self, request_id: str, prompt: Prompt, sampling: Sampling, seed: int | None) -> None:
        raise NotImplementedError

    def _unfinished(self) -> bool:
        raise NotImplementedError

    def _step(self) -> None:
        """One engine step, its new tokens `_took` by their requests."""
        raise NotImplementedError

    def reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def _reset_cache(self, running: bool) -> bool:
        """After a load: the prefix cache of the older version dropped (and with `running`, recompute mode,
        the running requests' prefixes recomputed); whether the engine did it."""
        raise NotImplementedError

    def _loads_here(self) -> bool:
        """Whether `reload` runs in this process's event loop (else in a thread, the engine held meanwhile)."""
        return True

    def _policy(self, served: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
        """The version served as HF-named tensors of the whole policy, from what the rings gave (`served`); None
        where they are not the whole policy (a LoRA adapter alone)."""
        raise NotImplementedError

    async def _finished(self, made: list[Completion]) -> list[Completion]:
        """The completions of a call, once all are made (the torch engine's exact mode re-scores them)."""
        return made

    # --- the contract
    @concurrent_endpoint
    async def generate(self, prompts: list[Prompt], *, sampling: Sampling | None = None,
                       min_version: int = 0, text: bool = False, grading: Grading | None = None) -> Generation:
        """`sampling.n` completions per prompt, their first tokens from version `min_version` or newer, each
        held here and answered as a Generated (with its text if `text`), with the report since the last;
        with `grading`, scored by its grader first (meshrl/actors/held.py's `graded`)."""
        prompts = [await self._whole(p) for p in prompts]
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
        for prompt in prompts:  # the engine refusing one (too long, say) raises here: this call's group fails
            # request_seeds: seeded from the engine's seed, its prompt and the version, the same samples whatever
            # else the engine batches with it
            seed = zlib.crc32(f"{self.config.seed}/{prompt.index}/{len(prompt.token_ids)}/{self.policy_version}/{s}"
                              .encode()) if self.config.request_seeds else None
            request_id = str(next(self.request_ids))
            self._add(request_id, prompt, s, seed)
            self.running[request_id] = request = Request(prompt, [PartialCompletion() for _ in range(s.n)],
                                                         loop.create_future())
            requests.append(request)
        self.book.running()
        if self.driver is None or self.driver.done():
            self.driver = asyncio.create_task(self._drive())
        await asyncio.gather(*(r.done for r in requests))
        made = await self._finished([self._completion(r.prompt, seq) for r in requests for seq in r.sequences])
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
            while self._unfinished():
                await self.swapped.wait()  # not while the workers load a version (`_swap`)
                self._step()
                if self.update != "drain" and self.ring and time.monotonic() >= self.next_poll and (
                        self.poller is None or self.poller.done()):
                    self.next_poll = time.monotonic() + self.poll_s
                    self.poller = asyncio.create_task(self._poll())
                await asyncio.sleep(0)
            self.book.done()
        except Exception as e:  # the engine is broken: every caller learns why, and the replica is replaced
            self._fail(ReplicaBroken(f"{self.ENGINE}'s engine failed: {e!r}"))
            raise

    def _took(self, request_id: str, index: int, token_ids: list[int], logprobs: list[float], text: str,
              finish_reason: str | None) -> None:
        """Sequence `index` of request `request_id` got `token_ids` (each with its logprob) and `text` in a step,
        under the version served now."""
        request = self.running.get(request_id)
        if request is not None:
            seq = request.sequences[index]
            seq.add(token_ids, logprobs, text, self.policy_version)
            seq.finish_reason = finish_reason or seq.finish_reason

    def _ended(self, request_id: str, cached_tokens: int) -> None:
        """Request `request_id` is done (`cached_tokens` of its prompt were served from the prefix cache)."""
        request = self.running.pop(request_id, None)
        if request is not None:
            self.prompt_tokens += len(request.prompt.token_ids)
            self.cached_prompt_tokens += cached_tokens
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
        and within `weight_sync.timeout_s`, then swap it into the engine between two engine steps. A read that
        times out breaks the replica before anything of it reaches the engine, and stops at its next chunk: it
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
                self.policy_version, self.served = version, None if in_place else staged[-1]
                if in_flight and self.update == "in_flight":
                    reset = True  # running requests keep their prefixes' KV; new ones get a new cache salt
                else:
                    reset = self._reset_cache(in_flight)
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
        """`reload` the version: right here, between two engine steps, or (`_loads_here` false: vLLM's workers
        in processes of their own) in a thread, the event loop free for the replica's other calls meanwhile,
        while the driver takes no engine step and no request is admitted (the caller's `book.loading` admits
        again once the version is served)."""
        if self._loads_here():
            return self.reload(weights)
        self.swapped.clear()
        self.book.admitting.clear()
        swap = asyncio.ensure_future(asyncio.to_thread(self.reload, weights))
        try:
            await asyncio.shield(swap)
        finally:  # the engine steps again once the workers are done, even if this wait was cancelled
            swap.add_done_callback(lambda _: self.swapped.set())

    async def _swap_in_place(self) -> int | None:
        """A ring in device memory (meshrl/weight_sync/device_ring.py): the engine loads straight from the
        ring's slot, and a load the trainer overtook is done again with a newer version; the engine takes no
        step until one version is loaded whole (the workers' last load may outlive a cancelled wait: the engine
        waits for it)."""
        self.swapped.clear()
        swaps = []

        async def load(version: int, weights: list[tuple[str, torch.Tensor]]) -> None:
            if self._loads_here():
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
        """While a synchronous step trains on the GPU this replica shares (generator.engine.sleep on): the
        engine frees its KV cache (vLLM: sleep mode level 1, the weights moved to host memory), unless requests
        run or a load does; the next call or load wakes it. Whether it sleeps now."""
        if self.config.engine.sleep == "on" and not (self.asleep or self.running or self.loading.locked()):
            self._sleep()
            self.asleep = True
        return self.asleep

    def _sleep(self) -> None:
        raise NotImplementedError

    def _wake_engine(self) -> None:
        raise NotImplementedError

    def _wake(self) -> None:
        if self.asleep:
            self._wake_engine()
            self.asleep = False

    @endpoint
    async def attach_weights(self, rings: list[RingHandle | DeviceRingHandle | DiskHandle | RelayHandle | None]) -> str:
        """Pull weights from the trainer's rings (one per rank, in rank order) from now on, or from its host's
        relay of them (meshrl/weight_sync/relay.py), or from its directory of versions (transport disk);
        returns the transport chosen."""
        self.ring = open_reader(rings, self.layout, self.to_hf, self.transport)
        self._attached()
        return self.ring.transport

    def _attached(self) -> None:
        """After `attach_weights` (vLLM warns of a dtype it serves other than the published one)."""

    @endpoint
    async def served_copy(self) -> int | None:
        """The version `save_policy` would write, or None where it would write nothing."""
        async with self.loading:
            return self._served_policy() and self.policy_version

    @endpoint
    async def save_policy(self, path: str) -> int | None:
        """The version this replica serves written to `path` as the trainer's `save` writes a policy (an HF
        checkpoint, bf16); its version, or None and nothing written where the replica holds no whole copy of
        it: none loaded yet, a ring in device memory (loaded in place), a LoRA adapter, a broken replica."""
        async with self.loading:  # no load writes the reader's copy meanwhile
            if not (weights := self._served_policy()):
                return None
            await asyncio.to_thread(save_checkpoint, weights, Path(self.checkpoint), Path(path))
            return self.policy_version

    def _served_policy(self) -> dict[str, torch.Tensor] | None:
        return None if self.broken or self.served is None else self._policy(self.served)

    @endpoint
    async def pull_weights(self) -> int:
        """Load the ring's newest version now (as `weight_update` says), if newer than ours; return the
        version now served."""
        await self._load_or_break()
        return self.policy_version

    @endpoint
    async def weight_updates(self) -> dict:
        """What happened since the last call: the loads (`pulls`: wall-clock start and end, version, whether
        requests were running, seconds reading the rings), swaps with requests running, prefix-cache resets the
        engine refused, the seconds the engine had requests to run (`busy_s`), and the finished requests' prompt
        tokens and those the prefix cache served (`prompt_tokens`, `cached_prompt_tokens`), and the bytes it read
        from the trainer's rings itself (`trainer_bytes`; 0 when it reads its host's relay)."""
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
