"""Sharded loading of an MoE (meshrl/actors/distributed.py `load_on_ranks`, `expert_rows`): each rank reads only
its own experts' tensors into its shard, and the model it loads is bit-identical to the one every rank used to
load by reading every expert whole and keeping its rows (`whole_experts=True`), on gloo ranks of the CPU: 2 ranks
(the tiny Qwen3-MoE's 4 experts split evenly) and 3 (split as torch.chunk splits: 2, 2 and none)."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from meshrl.actors.distributed import Rank, load_on_ranks, local
from meshrl.models.memory import MemoryChoice
from meshrl.models.model import load_policy, resolve_checkpoint

pytestmark = pytest.mark.processes

BF16_REFERENCE = MemoryChoice("off", "float32", "bfloat16")  # the reference's experts held in bf16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, out: dict) -> None:
    """Rank `rank` of `world`: the tiny MoE loaded each way, as the trainer loads it and as the bf16 reference
    does; which parameters' shards differ between the ways, and the experts' shards as loaded now."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    me, checkpoint = Rank(rank, world, torch.device("cpu")), resolve_checkpoint("tiny_qwen3_moe")
    figures = {}
    for role, kwargs in (("trainer", {}), ("reference", {"memory": BF16_REFERENCE, "frozen": True})):
        now = load_on_ranks(checkpoint, me, **kwargs)[0].state_dict()
        before = load_on_ranks(checkpoint, me, whole_experts=True, **kwargs)[0].state_dict()
        figures[role] = {"differ": [name for name in now if not torch.equal(local(now[name]), local(before[name]))],
                         "experts": {name: local(t).clone() for name, t in now.items() if "routed_experts" in name}}
    out[rank] = figures
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_reading_only_its_experts_loads_the_shards_reading_every_expert_whole_loaded(world):
    """Every parameter's shard on every rank is bit-identical to the shard the old way loaded (every rank reading
    every expert whole), for the trainer and for the bf16 reference; the ranks' expert shards are torch.chunk's
    split of the experts (3 ranks: 2, 2, 0) and together the checkpoint's experts exactly."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(world, _free_port(), out), nprocs=world, join=True)
        ranks = [out[r] for r in range(world)]
    whole = load_policy(resolve_checkpoint("tiny_qwen3_moe"))[0].state_dict()
    expert_names = [name for name in whole if "routed_experts" in name]
    assert len(expert_names) == 6  # w1, w2, w3 of both MoE layers
    for role in ("trainer", "reference"):
        assert [r[role]["differ"] for r in ranks] == [[]] * world, role
        for name in expert_names:
            shards = [r[role]["experts"][name] for r in ranks]
            chunks = [len(c) for c in torch.chunk(whole[name], world)]  # fewer than `world` where some are empty
            assert [len(s) for s in shards] == chunks + [0] * (world - len(chunks))
            assert torch.equal(torch.cat(shards), whole[name].to(shards[0].dtype)), (role, name)
