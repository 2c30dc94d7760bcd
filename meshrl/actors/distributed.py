"""Ranks of one torch.distributed job inside an actor mesh: what the trainer and the reference model
(and the trainer benchmark's plain loop) do alike to take their place among their mesh's processes.

`spawn_ranks` (meshrl/actors/__init__.py) sets RANK, WORLD_SIZE, MASTER_ADDR... in every process of
the mesh before the actors start; `join` reads them, pins the rank to its cores, picks its device and
initialises the process group (gloo on the CPU, NCCL on CUDA); `shard` applies torchtitan's FSDP2.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshrl.actors import pin_cpus, placement, resolve_device


@dataclass(frozen=True)
class Rank:
    rank: int
    world: int
    device: torch.device


def join(device: str, cpus: str, num_threads: int) -> Rank:
    """This process's rank: pinned to its cores (`cpus` as "0;1", one set per rank, or one set for all),
    on its device (`auto`: CUDA if there is a GPU; rank r of a host takes cuda:LOCAL_RANK), and in the
    process group when there are several ranks."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    pin_cpus(placement(cpus, rank), num_threads)
    where = resolve_device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if world > 1:
        dist.init_process_group("nccl" if where.type == "cuda" else "gloo")
    return Rank(rank, world, where)


def shard(model: torch.nn.Module, rank: Rank) -> None:
    """FSDP2 over all ranks, as torchtitan applies it to a decoder, with gradients summed over ranks
    (each rank's loss already carries the whole update's normalisers). Gloo has no PREMUL_SUM, which
    torchtitan's divide factor of 1 asks for: forcing plain sums gives the same result on both."""
    if rank.world == 1:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    mesh = init_device_mesh(rank.device.type, (rank.world,), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(model, mesh, torch.float32, torch.float32, pp_enabled=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a (possibly sharded) tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
