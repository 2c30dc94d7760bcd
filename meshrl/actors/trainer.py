"""The trainer: the policy as its family's torchtitan model, trained with the loss its config names.

It trains only: advantages arrive in the batch, computed by the controller. A step may take several
optimizer updates (`optim_step`); `policy_version` counts published versions, one per step.

With `trainer.ranks` > 1 the actor mesh has that many processes, the ranks of one torch.distributed
group (gloo on the CPU, NCCL on CUDA), and the model is sharded with its family's FSDP2 plan, each
rank reading only its own shards of the checkpoint. Each rank computes its micro-batches' loss with
the normalisers of the whole update, so the ranks' gradients are summed, not averaged; one optimizer
step follows. Each rank publishes its own rows into its host's weight ring (meshrl/weight_sync/shards.py).

A publish copies the weights into the ring in a thread of its own. Monarch runs an actor's plain
endpoints one at a time, in the order their messages came; `publish_weights` is one of them that
answers later, from a task of its own (an explicit response port): its first part (the version, the
weights it copies, the disk path's gather) runs in its message's turn, so the next call finds the
version taken on every rank and, with several ranks, every rank runs the gather's collectives before
the next call's; then the next step's `logprobs` and `forward_backward` calls (they leave the weights
as they are) run on the actor while the copy goes on. What changes or reads the weights as a whole
waits for the copy: an optimizer update, a checkpoint, a restore. From CUDA the copy is device-to-host
into pinned staging on a side stream, ordered after the update that made the weights
(`weight_sync.staging`, meshrl/weight_sync/staging.py), so the passes queued on the default stream
meanwhile run alongside it.
Each endpoint times itself (`spans`, meshrl/actors/trace.py), so the trace shows what overlapped on the
actor.
"""

import asyncio
import contextlib
import math
import time
import warnings
from pathlib import Path

import torch
from monarch.actor import Actor, ActorError, endpoint
from torch.distributed.tensor import DTensor

from meshrl.actors import resident_gb, return_free_memory
from meshrl.actors.distributed import (all_gather, each_micro_batch, head_kept_gathered, join, load_on_ranks, local,
                                      memory_of, to_buffer)
from meshrl.actors.trace import ActorClock
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.checkpoint import SafeReader, load_safely
from meshrl.exact import per_sequence_terms
from meshrl.losses import check, policy_logprobs, policy_loss, policy_terms
from meshrl.lr_schedule import lr_scheduler
from meshrl.models.lora import adapter_config, adapter_off, is_adapter, save_adapter
from meshrl.models.model import save_checkpoint
from meshrl.types import BatchRef, TrainBatch
from meshrl.weight_sync import WeightSyncConfig, published_weights
from meshrl.weight_sync.disk import DiskHandle, write_version
from meshrl.weight_sync.device_ring import DeviceMark, DeviceRingHandle, device_ring_for
from meshrl.weight_sync.ring import RingHandle
from meshrl.weight_sync.shards import host_ring, shard_layout
from meshrl.weight_sync.staging import staging_for


class TitanTrainer(Actor):
    def __init__(self, config: TrainerConfig, weight_sync: WeightSyncConfig, checkpoint: str):
        me = join(config.device, config.cpus, config.num_threads)
        self.rank, self.world, self.device = me.rank, me.world, me.device
        torch.manual_seed(config.seed)
        self.config = config
        self.checkpoint = Path(checkpoint)
        check(config.loss)
        self.memory = memory_of(config, self.device)  # activation checkpointing, all-gather dtype (meshrl/models/memory.py)
        self.model, self.adapter = load_on_ranks(self.checkpoint, me, config.lora, self.memory)
        self.model.train()
        self.lora = config.lora if config.lora.rank else None  # an adapter on the frozen base (meshrl/models/lora.py)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = lr_scheduler(self.optimizer, config.lr_schedule)  # None: a constant lr
        # This rank's rows of each tensor the generators load (with LoRA, the adapter's only), in torchtitan's
        # names and the dtype they serve, written into the ring its host's ranks share.
        full, self.to_hf = published_weights(self.checkpoint, weight_sync.dtype, config.lora)
        self.published = [spec.name for spec in full.specs]
        self.dtype = full.specs[0].dtype
        # In the host's memory, or in its GPUs' (weight_sync.memory device: meshrl/weight_sync/device_ring.py).
        gather = lambda x: all_gather(x, self.world)  # noqa: E731
        self.ring = self.staging = None
        if weight_sync.transport != "disk" and weight_sync.memory == "device":
            self.ring = device_ring_for(full, self.rank, self.world, gather, weight_sync.slots, weight_sync.checksums,
                                        self.device, weight_sync.chunk_mb)
            self.staging = DeviceMark(self.ring)  # a side stream, ordered after the step
        elif weight_sync.transport != "disk":
            self.ring = host_ring(full, self.rank, self.world, gather, weight_sync.slots, weight_sync.chunk_mb,
                                  weight_sync.checksums)
            # how this rank's rows reach the ring: from CUDA, pinned staging and a side stream (weight_sync/staging.py)
            self.staging = staging_for(weight_sync.staging, shard_layout(full, self.rank, self.world), self.device)
        # the plain path (meshrl/weight_sync/disk.py): the policy gathered and saved per version, instead or as a check
        self.disk = Path(weight_sync.disk_dir) if weight_sync.transport == "disk" or weight_sync.verify else None
        self.keep = weight_sync.slots
        self.policy_version = 0  # versions published
        self.updates = 0  # optimizer updates taken
        self.publishing: asyncio.Future | None = None  # the copy into the ring of the newest version
        self.copied: float | None = None  # seconds the last copy into the ring took, until an update reports it
        self.answering: set[asyncio.Task] = set()  # publishes answering once their copy ends
        self.clock = ActorClock()  # when each endpoint ran, here
        self.buffer = None  # the replay buffer BatchRefs name micro-batches of

    @endpoint
    async def attach_buffer(self, buffer) -> None:
        """Take micro-batches from this replay buffer (meshrl/actors/replay_buffer.py) from now on."""
        self.buffer = buffer

    @endpoint
    async def ping(self) -> None:
        """Answer, changing nothing: whether this actor is still there (a restart's probe, meshrl/restarts.py)."""

    @endpoint
    async def forward_backward(self, refs: list[BatchRef]) -> list[dict]:
        """Accumulate the loss's gradient over each micro-batch `refs` names, in order (taken from the replay
        buffer, the next while this one trains); returns each one's loss metric sums. Logprobs are taken from
        logits / the batch's sampling temperature: the distribution its tokens came from,
        `trainer.logprob_chunk_tokens` positions at a time."""
        async def train(ref: BatchRef, batch: TrainBatch) -> dict:
            return self._train_on(batch)
        return await each_micro_batch(self.buffer, refs, train, self.clock, self.policy_version)

    def _train_on(self, batch: TrainBatch) -> dict:
        """forward_backward's work on the micro-batch it took (a test's trainer may spoil it first)."""
        with self.clock.span("train", self.policy_version):
            batch = batch.to(self.device)
            bonus = self.config.loss.entropy_coef > 0  # else the entropy is a metric only
            chunk = self.config.logprob_chunk_tokens
            with head_kept_gathered(self.model, 0 < chunk < int(batch.loss_mask.sum())):
                entropy = "bonus" if bonus else "metric"
                if self.config.per_sequence:  # each sequence alone: its logprobs as generator.exact computes them
                    logprobs, entropy = per_sequence_terms(self.model, batch, self.config.bf16_autocast, entropy)
                else:
                    logprobs, entropy = policy_terms(self.model, batch, self.config.bf16_autocast, chunk, entropy)
                loss, metrics = policy_loss(logprobs, batch, self.config.loss, entropy)
                loss.backward()
        return metrics

    @endpoint
    async def logprobs(self, refs: list[BatchRef]) -> None:
        """The current policy's logprob of every target token [B, T] of each micro-batch `refs` names, without
        training: put back into the replay buffer as its field `ref.into`."""
        await self._logprobs(refs, "logprobs", contextlib.nullcontext)

    @endpoint
    async def base_logprobs(self, refs: list[BatchRef]) -> None:
        """With LoRA, the KL penalty's reference for free: as `logprobs`, of the frozen base with the adapter
        switched off (the initial policy, exactly)."""
        if not self.lora:
            raise ValueError("base_logprobs is the reference of a LoRA trainer: this one trains full weights")
        await self._logprobs(refs, "reference", lambda: adapter_off(self.model))

    async def _logprobs(self, refs: list[BatchRef], span: str, switch) -> None:
        """Each micro-batch's logprobs (under `switch()`), timed as `span`, put back into the replay buffer."""
        async def compute(ref: BatchRef, micro: TrainBatch) -> None:
            with self.clock.span(span, self.policy_version), switch():
                micro = micro.to(self.device)
                if self.config.per_sequence:
                    with torch.no_grad():
                        values = per_sequence_terms(self.model, micro, self.config.bf16_autocast)[0].cpu()
                else:
                    values = policy_logprobs(self.model, micro, self.config.bf16_autocast,
                                             self.config.logprob_chunk_tokens).cpu()
            await to_buffer(self.buffer, ref, values)
        await each_micro_batch(self.buffer, refs, compute, self.clock, self.policy_version)

    @endpoint
    async def optim_step(self, skip: bool = False) -> dict:
        """One optimizer update from the accumulated gradients (it publishes nothing). Not applied when
        the gradient norm is NaN or infinite, or when the caller says the loss was (`skip`): the
        gradients are dropped and `skipped` is true (every rank decides alike: the norm is global). With
        no gradient accumulated (no forward_backward since the last update) nothing is applied, not
        counted in `updates`, and the lr schedule does not advance."""
        with self.clock.span("optim_step", self.policy_version):
            return await self._optim_step(skip)

    @endpoint
    async def drop_gradients(self) -> None:
        """Forget the gradients accumulated since the last optim_step: a step that failed part-way (its
        replay buffer died) is trained again from its start."""
        self.optimizer.zero_grad(set_to_none=True)

    async def _optim_step(self, skip: bool) -> dict:
        waited = time.perf_counter()
        await self._published()  # the ring's copy of the weights this update changes
        # the copy's seconds, and those of them this update waited for (the rest hid behind the passes since)
        publish = {} if self.copied is None else {"publish_s": self.copied,
                                                   "publish_blocked_s": time.perf_counter() - waited}
        self.copied = None
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:  # no micro-batch since the last update: nothing to apply, the schedule stays
            return {"updates": self.updates, "grad_norm": math.nan, "skipped": False,
                    "lr": self.optimizer.param_groups[0]["lr"], "memory_gb": resident_gb()}
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(grad_norm, DTensor):  # each rank holds its shards' part: the norm of them all
            grad_norm = grad_norm.full_tensor()
        skipped = skip or not torch.isfinite(grad_norm).item()
        lr = self.optimizer.param_groups[0]["lr"]
        if not skipped:
            torch.nn.utils.clip_grads_with_norm_(params, self.config.max_grad_norm, grad_norm)
            self.optimizer.step()
            self.updates += 1
            if self.scheduler is not None:
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return_free_memory()  # the step's activations and gradients, freed, go back to the system
        return {"updates": self.updates, "grad_norm": float(grad_norm), "skipped": skipped, "lr": lr,
                "memory_gb": resident_gb(), **publish}

    @endpoint
    async def weight_ring(self) -> RingHandle | DeviceRingHandle | DiskHandle | None:
        """Where generators pull this rank's rows of each published version from: its host's ring (None
        from the host's other ranks, whose rows are in the first's); with transport disk, rank 0's
        directory of versions."""
        if self.ring is None:
            return DiskHandle(str(self.disk)) if self.rank == 0 else None
        return self.ring.handle()

    @endpoint(explicit_response_port=True)
    async def publish_weights(self, port) -> None:
        """Put this rank's shard of the current policy into its weight ring as the next version (no
        waiting for readers, nothing gathered); answer that version once it is readable. Its first part
        runs here, in its message's turn among the plain endpoints (the order the next call's collectives
        rely on); the answer waits for the copy in a task of its own, so the calls that come meanwhile and
        leave the weights unchanged (forward_backward, logprobs) run while it copies."""
        try:
            version = await self._start_publish()
        except Exception as e:  # the caller gets the error, as from any endpoint; the actor goes on
            port.exception(ActorError(e, "Actor call publish_weights failed."))
            return
        answer = asyncio.ensure_future(self._answer(port, version))
        self.answering.add(answer)
        answer.add_done_callback(self.answering.discard)

    async def _answer(self, port, version: int) -> None:
        try:
            await self._published()
        except BaseException as e:  # noqa: BLE001 - the copy failed or was cancelled: the caller gets why, never waits on
            port.exception(ActorError(e, "Actor call publish_weights failed."))
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        port.send(version)

    async def _publish(self) -> int:
        """A whole publish, for an endpoint that publishes as its last act (load_state): the version, once
        readable."""
        version = await self._start_publish()
        await self._published()
        return version

    async def _start_publish(self) -> int:
        """The publish's first part: the next version, the disk path's gather and save (every rank, its
        collectives before the next call's), the copy into the ring started. Awaited in publish_weights's
        turn, so a start that waits (a test's) still comes before the next call."""
        self.policy_version = version = self.policy_version + 1
        if self.disk is not None:
            self._write_version(version)
        if self.ring is not None:
            state = self.model.state_dict()
            weights = {name: local(state[name]).detach() for name in self.published}
            # on CUDA: marks the weights this step made on the current stream, before the next pass is queued
            staged = self.staging.start(weights)
            self.publishing = self._copy(staged, version, self.publishing)
        return version

    def _copy(self, weights, version: int, previous: asyncio.Future | None) -> asyncio.Future:
        """The copy into the ring (of what `staging.start` returned), in a thread: started now (the next calls'
        passes run while it goes on, the event loop busy with them or not), or once the copy of the version
        before has ended (the ring takes versions in order, and the pinned staging is reused)."""
        if previous is not None and not previous.done():
            async def after_previous():
                await previous
                await self._copy(weights, version, None)
            return asyncio.ensure_future(after_previous())
        start = time.time()
        copying = asyncio.get_running_loop().run_in_executor(None, self._write_ring, weights, version)
        copying.add_done_callback(lambda _: self._copy_done(start, version))
        return copying

    def _copy_done(self, start: float, version: int) -> None:
        end = time.time()
        self.clock.add("publish", start, end, version)
        self.copied = end - start

    def _write_ring(self, weights, version: int) -> None:
        """In the copy thread: device-to-host into the staging, if any (a side stream), then into the ring."""
        self.ring.publish(self.staging.finish(weights), version)

    def _write_version(self, version: int) -> None:
        """The plain path: the whole policy gathered, rank 0 saves it (HF names, the served dtype) as the
        version's file; it is complete when this returns."""
        state = self._gathered()
        if self.rank == 0:
            with torch.no_grad():
                hf = self.to_hf({name: state[name].detach().to(self.dtype).cpu() for name in self.published})
            write_version(self.disk, version, hf, self.keep)

    def _gathered(self) -> dict:
        """The whole policy's state dict on rank 0 (every rank takes part in the gather; with several ranks
        it is gathered into host memory, and the other ranks get none)."""
        if self.world == 1:
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    async def _published(self) -> None:
        """Wait for the publish in progress, if any (shielded: a cancelled caller leaves it to finish)."""
        if self.publishing is not None:
            await asyncio.shield(self.publishing)

    @endpoint
    async def save_state(self, path: str) -> None:
        """The policy and optimizer state into `path` with torch.distributed.checkpoint (every rank
        writes its shards), and this rank's counters and RNG state beside them."""
        with self.clock.span("save_state", self.policy_version):
            await self._save_state(path)

    async def _save_state(self, path: str) -> None:
        await self._published()
        import torch.distributed.checkpoint as dcp

        model, optim = self._state_dicts()
        with warnings.catch_warnings():  # one rank: DCP says it saves in one process, as asked (no_dist)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": model, "optim": optim}, checkpoint_id=path, no_dist=self.world == 1)
        from meshrl.checkpoint import rng_states

        torch.save({"policy_version": self.policy_version, "updates": self.updates, **rng_states(self.device)},
                   Path(path) / f"rank{self.rank}.pt")

    @endpoint
    async def load_state(self, path: str) -> int:
        """Restore what `save_state` wrote (on as many ranks as it was written from, or others), then
        publish the restored policy under its own version for the generators; returns that version."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from meshrl.checkpoint import set_rng_states

        await self._published()  # not under a copy of the weights it replaces
        model, optim = self._state_dicts()
        state = {"model": model, "optim": optim}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeReader(path), no_dist=self.world == 1)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self._state_options())
        mine = Path(path) / f"rank{self.rank}.pt"
        extra = load_safely(mine if mine.exists() else Path(path) / "rank0.pt")
        self.updates = extra["updates"]
        if self.scheduler is not None:  # the schedule's place; the lr itself came back with the optimizer's state
            self.scheduler.load_state_dict({"last_epoch": self.updates})
        set_rng_states(extra, self.device)
        self.policy_version = extra["policy_version"] - 1
        return await self._publish()

    def _state_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=True, strict=False) if self.lora else None

    def _state_dicts(self) -> tuple[dict, dict]:
        """The model's and the optimizer's state as a checkpoint holds them; with LoRA the adapter's only (and
        its optimizer state): the base never changes. (A tied LM head is the frozen embedding, which
        `ignore_frozen_params` keeps under the head's name.)"""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer, options=self._state_options())
        return ({k: v for k, v in model.items() if is_adapter(k)} if self.lora else model), optim

    @endpoint
    async def spans(self) -> list[dict]:
        """What this rank did since the last call, timed here: [{"what", "start", "end" (wall clock),
        "policy_version"}]; a publish's span ends when its version is readable."""
        return self.clock.take()

    @endpoint
    async def save(self, path: str) -> None:
        """Write the current policy as an HF checkpoint (loadable by vLLM and transformers), with LoRA as
        an adapter in PEFT's layout on the base (vLLM and `peft` load it); with several ranks every rank
        takes part in the gather and rank 0 writes."""
        state = self._gathered()
        if self.rank == 0:
            with torch.no_grad():
                if self.lora:
                    adapter = self.to_hf({name: state[name] for name in self.published})
                    save_adapter(adapter, adapter_config(self.lora, self.to_hf.target_modules(), str(self.checkpoint)),
                                 Path(path), torch.bfloat16)
                else:
                    save_checkpoint(self.adapter.to_hf(state), self.checkpoint, Path(path))

