"""`meshrl bench experts`: what each rank reads from the safetensors files, and the memory its load adds,
when a Mixture-of-Experts model is loaded sharded on 1, 2 and 4 ranks (meshrl/actors/distributed.py
`load_on_ranks`, as the trainer and the reference load it). Each rank now reads only its own experts'
tensors (`expert_rows`); before 2026-11-28 every rank read every expert whole and kept its rows
(`whole_experts=True`), measured beside it in the same processes.

The model is the tiny Qwen3-MoE's shape (meshrl/models/families.py) with more and wider experts and a
small vocabulary, so that experts are most of its bytes; random weights, written once to a temporary
directory. Each rank count runs in fresh processes (gloo; a process group at 1 rank too, so that it
reads through the same sharded path). In each: one load unmeasured (first-call costs), then each way:
- bytes read: the bytes of every slice torch.distributed.checkpoint's HF reader takes out of the files
  (a reader that counts what its file handle returns);
- peak added: the peak resident memory the load adds (VmHWM minus VmRSS just before, the C heap's free
  pages returned first: meshrl/tools/bench/trainer_memory.py `_Peak`), MiB;
- share: this rank's experts' bytes (FSDP2's split: weight_sync/shards.py `shard_rows`) plus every dense tensor's
  bytes, from the files' headers (an upper bound: a rank reads only its rows of most dense tensors too).
"""

import gc
import os
import re
import socket
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader

WAYS = {"sharded": False, "whole": True}  # name -> load_on_ranks' whole_experts
EXPERT = re.compile(r"\.experts\.(\d+)\.")


def run(ranks: list[int], experts: int = 16, width: int = 1024, vocab: int = 4096) -> dict:
    """Per rank count, per rank: bytes read and peak memory added by each way, beside the rank's share."""
    import torch.multiprocessing as mp

    from meshrl.actors import cpu_name
    from meshrl.weight_sync.shards import shard_rows

    with tempfile.TemporaryDirectory(prefix="meshrl-bench-experts-") as tmp:
        checkpoint = Path(tmp)
        make_model(checkpoint, experts, width, vocab)
        per_expert, dense = file_bytes(checkpoint)
        result = {"cpu": cpu_name(), "cores": os.cpu_count(), "experts": experts, "expert_width": width,
                  "vocab": vocab, "expert_bytes": sum(per_expert.values()), "dense_bytes": dense, "worlds": {}}
        for world in ranks:
            with mp.Manager() as manager:
                out = manager.dict()
                mp.spawn(_rank, args=(world, _free_port(), str(checkpoint), out), nprocs=world, join=True)
                result["worlds"][str(world)] = [
                    out[r] | {"share_bytes": dense + sum(per_expert[e] for e in range(*shard_rows(experts, r, world)))}
                    for r in range(world)]
    return result


def make_model(out: Path, experts: int, width: int, vocab: int) -> None:
    """The tiny Qwen3-MoE with `experts` experts of hidden width `width` over a `vocab` vocabulary, random
    weights (torchtitan's initialisation, seed 0), saved as the tiny models are (no tokenizer: only loaded)."""
    from meshrl.models.families import FAMILIES
    from meshrl.models.model import build_policy, save_checkpoint

    config = FAMILIES["Qwen3MoeForCausalLM"].tiny({"vocab_size": vocab}) | {"num_experts": experts,
                                                                            "moe_intermediate_size": width}
    model, adapter = build_policy(config)
    torch.manual_seed(0)
    model.init_states()
    save_checkpoint(adapter.to_hf(model.state_dict()), out, out, config)


def file_bytes(checkpoint: Path) -> tuple[dict[int, int], int]:
    """The files' bytes of each expert (its tensors in every layer) and of all other tensors."""
    from safetensors import safe_open

    per_expert, dense = {}, 0
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                size = torch.Size(piece.get_shape()).numel() * _DTYPE_BYTES[piece.get_dtype()]
                if (expert := EXPERT.search(name)) is None:
                    dense += size
                else:
                    per_expert[int(expert[1])] = per_expert.get(int(expert[1]), 0) + size
    return per_expert, dense


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


class CountingReader(HuggingFaceStorageReader):
    """The HF storage reader, counting the bytes of every tensor slice it reads out of a file."""

    total = 0  # bytes read in this process, by every reader

    def _process_read_request(self, f, req, planner) -> None:
        super()._process_read_request(_CountedFile(f), req, planner)


class _CountedFile:
    def __init__(self, f):
        self.f = f

    def get_slice(self, name: str):
        return _CountedSlice(self.f.get_slice(name))


class _CountedSlice:
    def __init__(self, piece):
        self.piece = piece

    def __getitem__(self, index):
        tensor = self.piece[index]
        CountingReader.total += tensor.nbytes
        return tensor


def _rank(rank: int, world: int, port: int, checkpoint: str, out: dict) -> None:
    """One rank: a load unmeasured, then each way's bytes read, peak memory added, and parameters held."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from meshrl.actors.distributed import Rank, load_on_ranks, local
    from meshrl.models.model import build_policy, read_hf_config
    from meshrl.tools.bench.trainer_memory import _Peak

    with torch.device("meta"):  # the family's adapter class (its registry's), reading through the counting reader
        adapter = build_policy(read_hf_config(checkpoint))[1]
    type(adapter).get_hf_storage_reader = lambda self, path, from_quantized=False: CountingReader(path)
    torch.distributed.init_process_group("gloo")
    me, cpu = Rank(rank, world, torch.device("cpu")), torch.device("cpu")
    try:
        load_on_ranks(checkpoint, me)
        figures = {"read_bytes": {}, "peak_added_mib": {}, "params_bytes": {}}
        for way, whole in WAYS.items():
            gc.collect()
            peak, before = _Peak(cpu), CountingReader.total
            peak.start()
            model, _ = load_on_ranks(checkpoint, me, whole_experts=whole)
            figures["peak_added_mib"][way] = peak.added_mb()
            figures["read_bytes"][way] = CountingReader.total - before
            figures["params_bytes"][way] = sum(local(p).nbytes for p in model.parameters())
            del model
        out[rank] = figures
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(result: dict) -> str:
    mib = 2**20
    lines = [f"a tiny Qwen3-MoE, {result['experts']} experts of width {result['expert_width']}: experts "
             f"{result['expert_bytes'] / mib:.1f} MiB, dense {result['dense_bytes'] / mib:.1f} MiB in its file (bf16) "
             f"({result['cpu']}, {result['cores']} cores). Per rank: its share (its experts + all dense), then "
             "each rank reading only its experts (now), then every expert whole (before); params: the rank's "
             "fp32 shard held",
             f"  {'ranks':>5s} {'rank':>4s} {'share MiB':>9s} | {'read MiB':>8s} {'params MiB':>10s} "
             f"{'peak added MiB':>14s} | {'read MiB':>8s} {'peak added MiB':>14s}"]
    for world, ranks in result["worlds"].items():
        for rank, r in enumerate(ranks):
            now, before = ({k: r[k][way] for k in ("read_bytes", "params_bytes", "peak_added_mib")} for way in WAYS)
            lines.append(f"  {world:>5s} {rank:4d} {r['share_bytes'] / mib:9.1f} | {now['read_bytes'] / mib:8.1f} "
                         f"{now['params_bytes'] / mib:10.1f} {now['peak_added_mib']:14.1f} | "
                         f"{before['read_bytes'] / mib:8.1f} {before['peak_added_mib']:14.1f}")
    return "\n".join(lines)
