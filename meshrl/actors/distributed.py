"""Ranks of one torch.distributed job inside an actor mesh: what the trainer and the reference model
(and the trainer benchmark's plain loop) do alike to take their place among their mesh's processes.

`spawn_ranks` (meshrl/actors/__init__.py) sets RANK, WORLD_SIZE, MASTER_ADDR... in every process of
the mesh before the actors start; `join` reads them, pins the rank to its cores, picks its device and
initialises the process group (gloo on the CPU, NCCL on CUDA); `shard` applies the model family's
FSDP2 plan. Both take their micro-batches from the replay buffer by BatchRef (`from_buffer`) and put
back what they compute for them (`to_buffer`).
"""

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshrl.actors import pin_cpus, placement, resolve_device
from meshrl.models.families import family_of
from meshrl.models.memory import NO_SAVINGS, MemoryChoice, apply_checkpointing, resolve
from meshrl.models.model import build_policy, load_policy, load_weights, read_hf_config
from meshrl.types import BatchRef, TrainBatch
from meshrl.weight_sync.shards import shard_rows

T = TypeVar("T")


@dataclass(frozen=True)
class Rank:
    rank: int
    world: int
    device: torch.device


def join(device: str, cpus: str, num_threads: int) -> Rank:
    """This process's rank: pinned to its cores (`cpus` as "0;1", one set per rank, or one set for all),
    on its device (one for all, or one per local rank: "cuda:4;cuda:5", as meshrl/runtime/gpu_plan.py plans them;
    `auto`: CUDA if there is a GPU, rank r of a host taking cuda:LOCAL_RANK), and in the process group
    when there are several ranks."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    pin_cpus(placement(cpus, rank), num_threads)
    where = resolve_device(placement(device, local_rank))
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", local_rank)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if world > 1 and not dist.is_initialized():  # a second actor in the same processes joins the first's group
        dist.init_process_group("nccl" if where.type == "cuda" else "gloo")
    return Rank(rank, world, where)


def memory_of(config, device: torch.device) -> MemoryChoice:
    """The memory switches of a trainer's or the reference's config (the fields it has; the others off)
    on `device`, "auto" resolved for it (meshrl/models/memory.py)."""
    from meshrl.losses import bf16_compute

    return resolve(device.type, bf16_compute(device, config.bf16_autocast),
                   getattr(config, "activation_checkpointing", "off"), getattr(config, "bf16_all_gather", "off"),
                   getattr(config, "dtype", "float32"))


def all_gather(value, world: int) -> list:
    """Every rank's `value`, in rank order (small picklable values only)."""
    if world == 1:
        return [value]
    values = [None] * world
    dist.all_gather_object(values, value)
    return values


def load_on_ranks(checkpoint, rank: Rank, lora=None, memory: MemoryChoice | None = None, frozen: bool = False,
                  whole_experts: bool = False):
    """The policy from the HF checkpoint on this rank's device, and its state-dict adapter. On one rank
    it is loaded whole; on several it is built on the meta device, sharded with the family's FSDP2
    plan, and each rank reads only its own rows from the safetensors files (torch.distributed
    .checkpoint's Hugging Face reader), so the full model is never in one rank's memory: MoE experts too,
    each rank reading only its own experts' tensors (`expert_rows`). `whole_experts`: every rank reads
    every expert whole and keeps its rows, as before 2026-11-28 (the bench and the test that compare the two).

    `memory` (meshrl/models/memory.py): torchtitan's activation checkpointing on its layers, and FSDP2's
    all-gathers in its dtype; a `frozen` model (the reference) with reference dtype bfloat16 holds its
    matrix products' weights in bf16 instead (`bf16_matmul_weights`)."""
    memory = memory or NO_SAVINGS
    bf16_weights = frozen and memory.reference_dtype == "bfloat16"
    # a frozen model's shards are gathered as fp32 (its bf16 weights exactly), and cast to bf16 by autocast
    gather = torch.float32 if frozen else memory.torch_dtype("all_gather_dtype")
    if not sharded(rank):
        model, adapter = load_policy(checkpoint, lora=lora)
        if bf16_weights:
            bf16_matmul_weights(model)
        apply_checkpointing(model, memory.activation_checkpointing)
        return model.to(rank.device), adapter
    from torch.distributed.tensor import distribute_tensor

    hf_config = read_hf_config(checkpoint)
    with torch.device("meta"):
        model, adapter = build_policy(hf_config, lora)
    if bf16_weights:
        bf16_matmul_weights(model)
    apply_checkpointing(model, memory.activation_checkpointing)  # inside FSDP2's units, as torchtitan applies it
    family = family_of(hf_config)
    shard(model, rank, family.shard, gather)
    model.to_empty(device=rank.device)
    family.init_buffers(model, rank.device)  # RoPE tables; the weights come next
    state = model.state_dict()
    hf, experts = read_hf_shards(checkpoint, state, adapter, whole_experts)
    titan = adapter.from_hf(hf) | {name: state[name] for name in experts}  # experts: read into the shards
    for name, value in titan.items():  # what else the adapter transformed was read whole: keep this rank's rows
        if isinstance(state[name], DTensor) and not isinstance(value, DTensor):
            titan[name] = distribute_tensor(value.to(rank.device, state[name].dtype), state[name].device_mesh,
                                            state[name].placements, src_data_rank=None)
    load_weights(model, titan)
    model._skip_lm_head = True
    return model, adapter


def bf16_matmul_weights(model: torch.nn.Module) -> None:
    """The weights of the matrix products bf16 autocast runs in bf16 (linear layers, MoE experts) held in
    bf16: exactly the values autocast would multiply with, so the model's outputs under autocast are
    bit-identical to the fp32 model's. The embedding (and an LM head tied to it), the norms and the MoE
    router (whose gate runs in fp32) stay fp32: the residual stream stays fp32, as the policy's."""
    embedding = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    for name, module in model.named_modules():
        if "router" in name or not (isinstance(module, torch.nn.Linear) or name.endswith("experts")):
            continue
        for param in module.parameters(recurse=False):
            if param.dim() >= 2 and id(param) not in embedding:
                param.data = param.data.to(torch.bfloat16)


def read_hf_shards(checkpoint, state: dict, adapter, whole_experts: bool = False) -> tuple[dict, list[str]]:
    """The checkpoint's tensors under HF names, for the adapter's `from_hf`, and the names of the grouped
    expert parameters read straight into this rank's shards (`expert_rows`; none with `whole_experts`).
    A tensor the adapter only renames is read straight into this rank's shard of the model's own (DTensor)
    parameter; one it transforms otherwise (Llama's q and k rows are permuted by head, which a row shard
    cannot be) is read whole into a plain tensor. torchtitan hands the adapter the DTensors themselves:
    that reads wrong rows for a permuted k with one KV head, and fails where the heads (or experts) do not
    split evenly over the ranks (SmolLM2's 3 KV heads on 2 ranks)."""
    import torch.distributed.checkpoint as dcp

    meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in state.items()}
    experts = {} if whole_experts else {name: rows for name, t in state.items()
                                        if (rows := expert_rows(name, t, meta[name], adapter))}
    owner = {id(t): name for name, t in meta.items()}
    hf = {}
    for hf_name, t in adapter.to_hf({k: v for k, v in meta.items() if k not in experts}).items():
        name = owner.get(id(t))  # the very tensor passed in: renamed only
        hf[hf_name] = state[name] if name is not None else torch.empty(t.shape, dtype=t.dtype)
    rows = {hf_name: row for name in experts for hf_name, row in experts[name].items()}
    dcp.load(hf | rows, storage_reader=adapter.get_hf_storage_reader(str(checkpoint)))
    return hf, list(experts)


def expert_rows(name: str, param: torch.Tensor, meta: torch.Tensor, adapter) -> dict[str, torch.Tensor]:
    """For a grouped experts parameter ([experts, ...], which the adapter splits into one HF tensor per
    expert: Qwen3-MoE's `experts.E.gate_proj.weight`... into `w1_EFD`...) that FSDP2 shards on its expert
    dim: the HF tensors of this rank's experts (FSDP2's rows: `shard_rows`), each the view of its row in this
    rank's shard to read it into. Anything else: {}."""
    from torch.distributed.tensor import Shard

    if not isinstance(param, DTensor) or param.placements != (Shard(0),) or param.dim() < 2:
        return {}
    split = adapter.to_hf({name: meta})  # in expert order, as the adapter splits
    if len(split) != param.shape[0] or any(t.shape != param.shape[1:] for t in split.values()):
        return {}
    rows = range(*shard_rows(len(split), param.device_mesh.get_local_rank(), param.device_mesh.size()))
    mine = param.to_local().detach()
    if mine.shape[0] != len(rows):
        raise ValueError(f"{name}: {mine.shape[0]} local rows, not {len(rows)} of {len(split)} as FSDP2 splits")
    return {hf_name: mine[i] for i, hf_name in enumerate(list(split)[rows.start:rows.stop])}


def sharded(rank: Rank) -> bool:
    """Whether the model is sharded with FSDP2: on several ranks, or on one in a process group that its
    process already has (`meshrl check gpu` runs FSDP2 over NCCL at world 1 so; a trainer of one rank
    has none and loads its model whole)."""
    return rank.world > 1 or dist.is_initialized()


def shard(model: torch.nn.Module, rank: Rank, plan: Callable, param_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 over all ranks with the model family's plan (`Family.shard`), parameters all-gathered in
    `param_dtype`, gradients reduced in float32 and summed over ranks, not averaged (each rank's loss
    carries the whole update's normalisers); nothing on one rank.
    Gloo has no PREMUL_SUM, which a divide factor of 1 asks for: forcing plain sums gives the same
    result on gloo and NCCL."""
    if not sharded(rank):
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    plan(model, init_device_mesh(rank.device.type, (rank.world,), mesh_dim_names=("fsdp",)), param_dtype)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


@contextlib.contextmanager
def head_kept_gathered(model: torch.nn.Module, chunked: bool):
    """Around a forward and its backward whose LM head runs once per chunk of positions, each chunk
    recomputed in the backward (meshrl/losses.py `head_terms`): FSDP2 would reshard the head's unit after
    the first chunk's backward, and the next chunk's recompute would meet sharded weights (on CUDA:
    "aten.mm.default got mixed torch.Tensor and DTensor", found by `meshrl check gpu` on an H200). The
    unit stays gathered until the backward ends, as torchtitan's ChunkedLossWrapper keeps it; FSDP2
    reduce-scatters each chunk's gradient and sums the shards. Nothing to do unsharded or unchunked."""
    from torch.distributed.fsdp import FSDPModule

    head = getattr(model, "lm_head", None)
    if not chunked or not isinstance(head, FSDPModule):
        yield
        return
    head.set_reshard_after_backward(False)
    try:
        yield
    finally:
        head.set_reshard_after_backward(True)
        head.reshard()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a (possibly sharded) tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


async def from_buffer(buffer, ref: BatchRef, clock=None, version: int | None = None) -> TrainBatch:
    """The micro-batch `ref` names, taken from the replay buffer (an actor mesh), actor to actor (timed as a
    `from_buffer` span of `clock`, an ActorClock, if given)."""
    if clock is None:
        return await buffer.micro_batch.call_one(ref)
    with clock.span("from_buffer", version):
        return await buffer.micro_batch.call_one(ref)


async def each_micro_batch(buffer, refs: list[BatchRef], work: Callable[[BatchRef, TrainBatch], Awaitable[T]],
                           clock=None, version: int | None = None) -> list[T]:
    """`await work(ref, batch)` on each micro-batch `refs` names, in order (a rank's share of a mini-batch: one call
    for all of them, not one each), the next taken from the replay buffer while `work` runs on this one."""
    out, upcoming = [], None
    try:
        for i, ref in enumerate(refs):
            batch = await (upcoming if upcoming is not None else from_buffer(buffer, ref, clock, version))
            upcoming = (asyncio.ensure_future(from_buffer(buffer, refs[i + 1], clock, version))
                        if i + 1 < len(refs) else None)
            out.append(await work(ref, batch))
    finally:
        if upcoming is not None:
            upcoming.cancel()
    return out


async def to_buffer(buffer, ref: BatchRef, values: torch.Tensor) -> None:
    """`values` computed for `ref`'s micro-batch, put into the replay buffer as its field `ref.into`."""
    await buffer.attach.call_one(ref, values)
