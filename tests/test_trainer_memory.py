"""The trainer's memory switches (meshrl/models/memory.py) leave the loss and its gradients as they were:
chunked logprobs and entropy against all positions at once, torchtitan's activation checkpointing against
none, FSDP2's bf16 all-gathers against fp32 ones (2 ranks over gloo), and the bf16 reference against the fp32
one, on the tiny random models of each family and LoRA; and "auto" chooses per device as documented."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from rounding import assert_within, rounding_bound

import meshrl.losses
from meshrl.actors.distributed import Rank, load_on_ranks, local
from meshrl.losses import LossConfig
from meshrl.losses import (on_positions, policy_logprobs, policy_loss, policy_terms, response_logits, token_entropy,
                           token_logprobs)
from meshrl.models.lora import LoraConfig
from meshrl.models.memory import MemoryChoice, resolve
from meshrl.models.model import resolve_checkpoint
from meshrl.types import Episode, TrainBatch

ONE = Rank(0, 1, torch.device("cpu"))
OFF = MemoryChoice("off", "float32", "float32")


def sample_batch(temperatures=(0.7, 1.0, 1.3)) -> TrainBatch:
    """Three sequences of different lengths (17 loss positions), sampled at different temperatures."""
    episodes = []
    for i, temperature in enumerate(temperatures):
        prompt, response = 4 + i, 3 + 2 * i
        episodes.append(Episode(tokens=[(97 * i + 13 * t) % 40000 + 50 for t in range(prompt + response)],
                                loss_mask=[False] * prompt + [True] * response,
                                behaviour_logprobs=[0.0] * prompt + [-10.0 - 0.1 * t for t in range(response)],
                                advantage=(-1.0) ** i * (0.5 + i), policy_version=0, group_id=i,
                                temperature=temperature))
    return TrainBatch.collate(episodes, sum(e.num_response_tokens for e in episodes), len(episodes))


def loss_and_grads(model, batch, chunk: int, bf16: bool = False, entropy_coef: float = 0.01):
    """The trainer's loss on `batch` with the entropy bonus, and every trained parameter's gradient (whole)."""
    logprobs, entropy = policy_terms(model, batch, bf16, chunk, "bonus" if entropy_coef else "metric")
    loss, _ = policy_loss(logprobs, batch, LossConfig(entropy_coef=entropy_coef), entropy)
    loss.backward()
    grads = {name.replace("._checkpoint_wrapped_module", ""): p.grad for name, p in model.named_parameters()
             if p.grad is not None}
    grads = {k: g.full_tensor() if hasattr(g, "full_tensor") else g for k, g in grads.items()}
    return loss.detach(), grads


def plain_loss_and_grads(model, batch, entropy_coef: float = 0.01):
    """`loss_and_grads` in fp32 without `policy_terms`: the logits of every loss position at once
    (`response_logits`), their logprobs and their entropy with its gradient, as the trainer took them before
    the chunks."""
    mask = batch.loss_mask
    logits = response_logits(model, batch).float()
    logprobs = on_positions(token_logprobs(logits, batch.target_ids[mask]), mask)
    entropy = on_positions(token_entropy(logits), mask)
    loss, _ = policy_loss(logprobs, batch, LossConfig(entropy_coef=entropy_coef), entropy)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def lora_model(source: str, memory: MemoryChoice, lora: LoraConfig | None):
    torch.manual_seed(0)  # the adapter's A
    model, _ = load_on_ranks(resolve_checkpoint(source), ONE, lora, memory)
    if lora:  # B away from zero, so that A gets a gradient too
        torch.manual_seed(3)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_b." in name:
                    param.normal_(0, 0.02)
    return model


def assert_equal(a, b):
    """The same loss and gradients, bit for bit."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert grads_a.keys() == grads_b.keys() and grads_a
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("source", ["tiny", "tiny_qwen3", "tiny_qwen3_moe"])
def test_chunked_logprobs_and_entropy_bonus_match_all_positions_at_once(source):
    """fp32: chunks of 5 of 17 positions (the last one short), the temperatures and the entropy bonus applied
    per chunk, give the loss and gradients of one pass over all positions, and of the loss taken without
    `policy_terms` (whole logits, then logprobs and entropy), to float32's rounding: each within
    `rounding_bound` of the same model in float64 (reference), so within twice it of each other, on any CPU."""
    batch = sample_batch()
    reference = loss_and_grads(lora_model(source, OFF, None).double(), batch, chunk=0)
    bound = rounding_bound(source)
    whole = loss_and_grads(lora_model(source, OFF, None), batch, chunk=0)
    chunked = loss_and_grads(lora_model(source, OFF, None), batch, chunk=5)
    # and the loss taken without policy_terms: an entropy bonus losing its gradient fails here
    plain = plain_loss_and_grads(lora_model(source, OFF, None), batch)
    for result in (whole, chunked, plain):
        assert_within(result, reference, bound)
    # and without a graph (logprobs for the ratio's pi_old, the reference's): chunks of the head alone, in fp32
    model = lora_model(source, OFF, None)
    torch.testing.assert_close(policy_logprobs(model, batch, False, 5), policy_logprobs(model, batch, False, 0),
                               rtol=2 * rounding_bound("tiny"), atol=0)


def test_chunks_take_each_sequences_temperature():
    """Chunks that split sequences sampled at different temperatures divide each position by its own: the
    logprobs differ from those at temperature 1, and match the whole pass's."""
    model = lora_model("tiny", OFF, None)
    hot, plain = sample_batch(), sample_batch(temperatures=(1.0, 1.0, 1.0))
    chunked = policy_logprobs(model, hot, False, 4)
    torch.testing.assert_close(chunked, policy_logprobs(model, hot, False, 0), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(chunked[0], policy_logprobs(model, plain, False, 4)[0], atol=1e-3)


@pytest.mark.parametrize("source,lora", [("tiny", None), ("tiny", LoraConfig(rank=4, alpha=8.0)),
                                         ("tiny_qwen3", None), ("tiny_qwen3_moe", None)])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_leaves_loss_and_gradients_exact(source, lora, mode):
    """torchtitan's activation checkpointing recomputes each layer's forward in the backward: the same
    operations on the same values, so the same loss and gradients bit for bit (chunked logprobs on: the
    trainer's default); the state dict keeps its names (the publish and checkpoints read them)."""
    batch = sample_batch()
    plain = lora_model(source, OFF, lora)
    checkpointed = lora_model(source, MemoryChoice(mode, "float32", "float32"), lora)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert any("_checkpoint_wrapped_module" in name for name, _ in checkpointed.named_modules())
    assert_equal(loss_and_grads(plain, batch, 5), loss_and_grads(checkpointed, batch, 5))


@pytest.mark.parametrize("source", ["tiny", "tiny_qwen3_moe"])
def test_bf16_reference_holds_its_matmul_weights_in_bf16_and_gives_the_fp32_references_logprobs(source, monkeypatch):
    """The frozen reference in bf16 (`reference.dtype`): the weights of its linear layers and experts bf16
    (half their memory), the embedding, norms, router and RoPE tables as they were; under bf16 autocast
    autocast multiplies with exactly those bf16 values, so its logprobs are the fp32 reference's bit for bit
    (the KL penalty is 0 before the first update, as with an fp32 reference). The claim is autocast's
    arithmetic, the same whether the CPU multiplies bf16 natively or emulates it: autocast is forced on, so
    that a CPU without bf16 math (AVX2 only, where a run never picks a bf16 reference) checks it too."""
    monkeypatch.setattr(meshrl.losses, "has_bf16_math", lambda device: True)
    checkpoint = resolve_checkpoint(source)
    batch = sample_batch()
    fp32, _ = load_on_ranks(checkpoint, ONE, memory=OFF, frozen=True)
    bf16, _ = load_on_ranks(checkpoint, ONE, memory=MemoryChoice("off", "float32", "bfloat16"), frozen=True)
    dtypes = {name: p.dtype for name, p in bf16.named_parameters()}
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    assert {n for n, d in dtypes.items() if d == torch.bfloat16} == {
        n for n, p in fp32.named_parameters() if p.dim() >= 2 and "tok_embeddings" not in n and "router" not in n
        and "lm_head" not in n}
    assert dtypes["tok_embeddings.weight"] == torch.float32 and dtypes["norm.weight"] == torch.float32
    assert {b.dtype for b in bf16.buffers()} == {b.dtype for b in fp32.buffers()}
    assert torch.equal(policy_logprobs(bf16, batch, True), policy_logprobs(fp32, batch, True))


def test_auto_chooses_per_device():
    """CUDA: every saving on (full checkpointing; bf16 gathers and reference with bf16 compute); the CPU:
    no checkpointing (measured slower, docs/performance.md) and fp32 gathers (bf16 ones move the logprobs off
    the reference's), a bf16 reference with bf16 compute; fp32 compute keeps fp32 gathers and reference;
    explicit values win; an unknown value, or a bf16 reference without bf16 compute, is one clear error."""
    assert resolve("cuda", True) == MemoryChoice("full", "bfloat16", "bfloat16")
    assert resolve("cuda", False) == MemoryChoice("full", "float32", "float32")
    assert resolve("cpu", True) == MemoryChoice("off", "float32", "bfloat16")
    assert resolve("cpu", False) == MemoryChoice("off", "float32", "float32")
    assert resolve("cuda", True, "selective", "off", "float32") == MemoryChoice("selective", "float32", "float32")
    assert resolve("cpu", False, "full", "on", "float32") == MemoryChoice("full", "bfloat16", "float32")
    with pytest.raises(ValueError, match="unknown activation_checkpointing 'some'; known: auto, off, full, selective"):
        resolve("cpu", True, "some")
    with pytest.raises(ValueError, match="reference.dtype bfloat16 .* needs reference.bf16_autocast"):
        resolve("cpu", False, reference_dtype="bfloat16")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(rank: int, port: int, out: dict) -> None:
    """Rank `rank` of 2 over gloo: the tiny model sharded with FSDP2 under each memory choice, one loss and
    its gradients (gathered whole) on this rank's half of the batch."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # the claims are autocast's arithmetic, native or emulated: forced on (this process is the test's alone),
    # so that a CPU without bf16 math (AVX2 only) checks them too
    meshrl.losses.has_bf16_math = lambda device: True
    torch.distributed.init_process_group("gloo")
    me = Rank(rank, 2, torch.device("cpu"))
    batch = sample_batch()
    half = TrainBatch(*(getattr(batch, f)[rank::2] if isinstance(getattr(batch, f), torch.Tensor) else getattr(batch, f)
                        for f in batch.__dataclass_fields__))
    results, lora = {}, LoraConfig(rank=4, alpha=8.0)
    bf16_gather = MemoryChoice("full", "bfloat16", "float32")
    for name, memory, bf16, chunk, adapter in (
            ("fp32", OFF, False, 0, None), ("fp32_saving", MemoryChoice("full", "float32", "float32"), False, 5, None),
            ("bf16_fp32_gather", OFF, True, 5, None), ("bf16_gather", bf16_gather, True, 5, None),
            ("lora_bf16_fp32_gather", OFF, True, 5, lora), ("lora_bf16_gather", bf16_gather, True, 5, lora)):
        torch.manual_seed(0)  # the adapter's A, alike in both
        model, _ = load_on_ranks(resolve_checkpoint("tiny"), me, adapter, memory)
        if adapter:  # B away from zero, so that A gets a gradient too
            with torch.no_grad():
                for param_name, param in model.named_parameters():
                    if ".lora_b." in param_name:
                        param.fill_(0.01)
        masters = {p.dtype for p in model.parameters()}
        loss, grads = loss_and_grads(model, half, chunk, bf16)
        torch.distributed.all_reduce(loss)  # each rank's share of the step's loss
        results[name] = (loss, grads, masters, {local(p.grad).dtype for p in model.parameters() if p.grad is not None})
    torch.distributed.destroy_process_group()
    if rank == 0:
        out.update(results)


@pytest.mark.processes
def test_fsdp2_bf16_all_gathers_on_two_ranks_keep_fp32_masters_and_match_within_bf16():
    """2 ranks over gloo (FSDP2's MixedPrecisionPolicy works there): activation checkpointing and chunked
    logprobs on the sharded model give fp32's loss and gradients (sums in another order only); bf16
    all-gathers keep the shards (master weights) and their gradients in fp32, and stay within bf16 rounding
    of fp32 gathers under the same bf16 autocast, without being equal to them; with LoRA too (the frozen base
    gathered in bf16, only the adapter trained)."""
    out = mp.Manager().dict()
    mp.spawn(_two_ranks, args=(_free_port(), out), nprocs=2, join=True)
    fp32, saving, autocast, gathered = (out[k] for k in ("fp32", "fp32_saving", "bf16_fp32_gather", "bf16_gather"))
    assert_within(saving[:2], fp32[:2], 2 * rounding_bound("tiny"))  # each within fp32's rounding of the exact
    assert gathered[2] == gathered[3] == {torch.float32}  # master weights and their gradients
    # measured: each gradient within 1.3% of its largest entry, the loss within 1e-3
    torch.testing.assert_close(autocast[0], gathered[0], rtol=0, atol=2e-3)
    for name, grad in autocast[1].items():
        torch.testing.assert_close(gathered[1][name], grad, rtol=0, atol=0.03 * float(grad.abs().max()), msg=name)
    assert any(not torch.equal(autocast[1][k], gathered[1][k]) for k in gathered[1])
    lora_autocast, lora_gathered = out["lora_bf16_fp32_gather"], out["lora_bf16_gather"]
    assert lora_gathered[2] == lora_gathered[3] == {torch.float32}
    assert lora_gathered[1] and all(".lora_" in name for name in lora_gathered[1])
    torch.testing.assert_close(lora_autocast[0], lora_gathered[0], rtol=0, atol=2e-3)
    for name, grad in lora_autocast[1].items():
        torch.testing.assert_close(lora_gathered[1][name], grad, rtol=0, atol=0.03 * float(grad.abs().max()), msg=name)
