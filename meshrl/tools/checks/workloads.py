"""What `meshrl check gpu` trains: the tiny random models of the tests, a random ~1B Llama of the same
family and vocabulary (the tiny config with Llama-3.2-1B's dims), real trainer actors built in this
process on them, and micro-batches of a given number of tokens, which the actors take by BatchRef as in
a run (`on_batch`: from `HeldBatches`, the replay buffer's side of the fetch, in this process).

The trainer's memory switches (`SWITCHES`) are set by name where the config has them; one it lacks is
reported as not available instead of failing the check.
"""

import dataclasses
import math
import os
from pathlib import Path

import torch

from meshrl.actors.reference_config import ReferenceConfig
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.tools.checks import standins
from meshrl.types import BatchRef, TrainBatch
from meshrl.weight_sync import WeightSyncConfig

# Llama-3.2-1B's shape over the tiny model's 49,152-token vocabulary (tied embeddings): 1.07B parameters
LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 64, "intermediate_size": 8192}
SEQUENCE = 2048  # tokens per sequence of a memory or MFU micro-batch (a quarter of them prompt)
# Each memory switch of item 3 of issue 53: (section, field) -> (value off, value on)
SWITCHES = {("trainer", "activation_checkpointing"): ("off", "full"), ("trainer", "bf16_all_gather"): ("off", "on"),
            ("trainer", "logprob_chunk_tokens"): (0, 1024), ("reference", "dtype"): ("float32", "bfloat16")}


def threads() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0))))


def big_checkpoint(out: Path, shape: dict, device: torch.device) -> Path:
    """A random Llama of `shape` (HF config keys over the tiny model's config) saved as an HF checkpoint
    (bf16) in `out`, initialised by torchtitan on `device`; returns `out`."""
    from meshrl.models.model import build_policy, read_hf_config, resolve_checkpoint, save_checkpoint

    tiny = resolve_checkpoint("tiny")
    config = read_hf_config(tiny) | shape
    torch.manual_seed(0)
    with torch.device(device):
        model, adapter = build_policy(config)
        model.init_states(buffer_device=device)
    save_checkpoint(adapter.to_hf(model.state_dict()), tiny, out, config)
    return out


def set_fields(config, section: str, values: dict) -> tuple:
    """`config` with the fields of `values` set (those it has: the switch names of SWITCHES), and the
    names it lacks as `section.field`."""
    have = {f.name for f in dataclasses.fields(config)}
    missing = [f"{section}.{k}" for k in values if k not in have]
    return dataclasses.replace(config, **{k: v for k, v in values.items() if k in have}), missing


def switches(on: bool) -> dict[str, dict]:
    """Every switch's value, on or off, by section."""
    out = {"trainer": {}, "reference": {}}
    for (section, name), (off, on_value) in SWITCHES.items():
        out[section][name] = on_value if on else off
    return out


def trainer_config(device: torch.device, bf16: bool, lora_rank: int = 0, **fields) -> tuple[TrainerConfig, list]:
    """A trainer's config on `device` (its loss depends on the model everywhere: no truncation of the behaviour
    weight, an entropy bonus), with `fields` (switches) where the config has them."""
    from meshrl.losses import LossConfig
    from meshrl.models.lora import LoraConfig

    config = TrainerConfig(device=str(device), num_threads=threads(), bf16_autocast=bf16, lr=1e-4,
                           loss=LossConfig(tis_cap=0.0, entropy_coef=0.01), lora=LoraConfig(rank=lora_rank))
    config, missing = set_fields(config, "trainer", fields)
    config.check()
    return config, missing


def trainer(checkpoint: Path, config: TrainerConfig, ring: bool = True):
    """The trainer actor on `checkpoint`, built in this process (its endpoints called with standins.call);
    without `ring`, no weight ring (nothing will be published)."""
    from meshrl.actors.trainer import TitanTrainer

    return TitanTrainer(config, WeightSyncConfig(transport="auto" if ring else "disk"), str(checkpoint))


def reference(checkpoint: Path, device: torch.device, **fields):
    """The reference actor on `checkpoint` with `fields` (its dtype) where its config has them."""
    from meshrl.actors.reference import ReferenceModel

    config, missing = set_fields(ReferenceConfig(device=str(device), num_threads=threads()), "reference", fields)
    return ReferenceModel(config, str(checkpoint)), missing


def batch(tokens: int, vocab: int, seed: int = 0, sequence: int = SEQUENCE) -> TrainBatch:
    """A micro-batch of `tokens` positions: sequences of `sequence` tokens (fewer when `tokens` is smaller),
    random ids, the last three quarters of each trained, behaviour logprobs about a uniform policy's,
    advantages +1 and -0.5 in turn (a loss well away from 0, for relative differences)."""
    generator = torch.Generator().manual_seed(seed)
    sequence = min(sequence, tokens)
    rows = max(1, tokens // sequence)
    ids = torch.randint(100, vocab, (rows, sequence + 1), generator=generator)
    mask = torch.zeros(rows, sequence, dtype=torch.bool)
    mask[:, sequence // 4:] = True
    behaviour = torch.where(mask, -math.log(vocab) + 0.5 * torch.randn(rows, sequence, generator=generator), 0.0)
    advantages = torch.tensor([1.0 if i % 2 == 0 else -0.5 for i in range(rows)])
    return TrainBatch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), mask, behaviour, advantages,
                      loss_tokens=int(mask.sum()), loss_sequences=rows, temperature=torch.ones(rows))


class HeldBatches:
    """The replay buffer's side of an actor's fetches (its `micro_batch` and `attach` calls), in this process:
    the micro-batches the check made, each under a BatchRef, and what the actor put back for them."""

    def __init__(self):
        self.batches: list[TrainBatch] = []
        self.values: dict[int, torch.Tensor] = {}
        self.micro_batch, self.attach = _Calls(self._micro_batch), _Calls(self._attach)

    def hold(self, batch: TrainBatch) -> BatchRef:
        self.batches.append(batch)
        return BatchRef(len(self.batches) - 1, 0, 0, into="old_logprobs")

    async def _micro_batch(self, ref: BatchRef) -> TrainBatch:
        return self.batches[ref.batch]

    async def _attach(self, ref: BatchRef, values: torch.Tensor) -> None:
        self.values[ref.batch] = values


class _Calls:
    """An endpoint of an in-process stand-in, called as an actor mesh's is (`call_one`)."""

    def __init__(self, call_one):
        self.call_one = call_one


async def on_batch(actor, endpoint: str, batch: TrainBatch):
    """`actor`'s `endpoint` (forward_backward, logprobs) on `batch`, called in this process as a run calls it:
    by a BatchRef, the actor taking the micro-batch from its buffer (here `HeldBatches`); what forward_backward
    returns, or the logprobs [B, T] the actor put back."""
    if not isinstance(actor.buffer, HeldBatches):
        actor.buffer = HeldBatches()
    ref = actor.buffer.hold(batch)
    result = await standins.call(actor, endpoint, [ref])
    return result[0] if endpoint == "forward_backward" else actor.buffer.values.pop(ref.batch)


def free(device: torch.device) -> None:
    """Give back what the last actor held (call after dropping it)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def big_model(check) -> Path:
    """The sections' ~1B Llama (in the dry mode a tiny one of the same family, built the same way), made
    once per check in its scratch directory."""
    if "big" not in check.cache:
        check.cache["big"] = big_checkpoint(check.tmp / "big", {} if check.dry else LLAMA_1B, check.device)
    return check.cache["big"]


def peak_memory(check, work) -> dict:
    """`work()` timed, with the device's peak memory while it ran (CUDA's allocator; none on the CPU) and
    what was allocated before it; on running out of device memory {"oom": True}."""
    import time

    if check.device.type != "cuda":
        start = time.perf_counter()
        work()
        return {"seconds": time.perf_counter() - start, "peak_gib": None}
    torch.cuda.synchronize(check.device)
    torch.cuda.reset_peak_memory_stats(check.device)
    before = torch.cuda.memory_allocated(check.device)
    start = time.perf_counter()
    try:
        work()
        torch.cuda.synchronize(check.device)
    except torch.cuda.OutOfMemoryError:
        free(check.device)
        return {"oom": True, "before_gib": before / 2**30}
    return {"seconds": time.perf_counter() - start, "before_gib": before / 2**30,
            "peak_gib": torch.cuda.max_memory_allocated(check.device) / 2**30}
