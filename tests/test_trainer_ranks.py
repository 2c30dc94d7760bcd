"""The trainer and the reference model on 2 ranks (real Monarch actors, torch.distributed over gloo,
torchtitan's FSDP2 on the tiny model): one step gives what one rank gives, and a checkpoint resumes on
another number of ranks (`meshrl train --trainer.ranks 2` end to end: test_train_smoke.py)."""

import asyncio
import itertools

import pytest
import torch
from actor_helpers import fixed_episodes, replay_buffer_on, train_through_buffer

from meshrl.actors import first, rank_procs, spawn_ranks
from meshrl.actors.reference import ReferenceModel
from meshrl.actors.reference_config import ReferenceConfig
from meshrl.actors.trainer import TitanTrainer
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.losses import LossConfig
from meshrl.models.model import ChatTokenizer, load_hf_weights, resolve_checkpoint
from meshrl.weight_sync import WeightSyncConfig

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def shared_ranks():
    """A proc mesh of 1 rank and one of 2 that every test here spawns its trainers on: each process pays
    its imports (torch, torchtitan) once, not once per test. The 2 ranks' process group is made by the first
    trainer on them and joined by the others."""
    async def stop():
        for procs in meshes.values():
            await procs.stop()

    meshes = {ranks: asyncio.run(rank_procs(f"ranks{ranks}", ranks)) for ranks in (1, 2)}
    yield meshes
    asyncio.run(stop())


NAMES = itertools.count()  # each actor spawned on a shared mesh has a name of its own


def trainer_on(procs, config: TrainerConfig, checkpoint):
    return procs.spawn(f"trainer{next(NAMES)}", TitanTrainer, config, WeightSyncConfig(), str(checkpoint))


def one_step(procs, buffer_procs, checkpoint, ranks: int, out_dir, kl: bool) -> dict:
    """One step, the trainer on `ranks` ranks (`procs`) taking its micro-batches from a replay buffer (on
    `buffer_procs`); with the KL penalty (`kl`), the reference on as many (processes of its own)."""
    async def run():
        # fp32 (no bf16 autocast), so the two runs differ only in the order of their sums
        config = TrainerConfig(lr=1e-3, num_threads=1, ranks=ranks, micro_batch_size=2, bf16_autocast=False,
                               loss=LossConfig(kl_coef=0.5 if kl else 0.0))
        trainer, meshes, reference = trainer_on(procs, config, checkpoint), [], None
        if kl:
            ref_procs, reference = await spawn_ranks("reference", ReferenceModel, ranks,
                                                     ReferenceConfig(bf16_autocast=False, num_threads=1, ranks=ranks),
                                                     str(checkpoint))
            meshes.append(ref_procs)
        try:
            tokenizer = ChatTokenizer(checkpoint)
            buffer = replay_buffer_on(buffer_procs, config, tokenizer.pad_id)
            metrics = await train_through_buffer(trainer, buffer, fixed_episodes(tokenizer), config, reference,
                                                 reference_ranks=ranks)
            await trainer.save.call(str(out_dir))
            return metrics
        finally:
            for mesh in meshes:
                await mesh.stop()

    return asyncio.run(run())


@pytest.mark.parametrize("source", ["tiny", "tiny_qwen3", "tiny_qwen3_moe", "qwen2_checkpoint"])
def test_one_step_on_two_ranks_matches_one_rank(source, tmp_path, request, shared_ranks):
    """Each family (and the transformers backend), sharded over two ranks (each reading only its rows of
    the checkpoint), trains as one; on the first, with the KL penalty to a reference sharded alike (the
    reference's sharding is the trainer's, whatever the family)."""
    tiny_checkpoint = (request.getfixturevalue(source) if source == "qwen2_checkpoint"
                       else resolve_checkpoint(source))
    kl = source == "tiny"
    one = one_step(shared_ranks[1], shared_ranks[1], tiny_checkpoint, 1, tmp_path / "one", kl)
    two = one_step(shared_ranks[2], shared_ranks[1], tiny_checkpoint, 2, tmp_path / "two", kl)
    # Gradients are summed over ranks (each rank's loss carries the whole step's normalisers): an average
    # would halve the gradient norm. AdamW's first update hardly depends on the gradient's scale, so the
    # norm and the loss are what tell a sum from a mean.
    assert one["tokens_trained"] == two["tokens_trained"]
    assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5 * one["grad_norm"]
    assert abs(one["loss"] - two["loss"]) <= 1e-6
    assert one["clip_fraction_low"] == two["clip_fraction_low"] == 0
    # Before the update the policy is the reference: every rank's reference logprobs must be those of its
    # own micro-batch for the KL to vanish (a logprob gap of 0.1 on a few tokens would give ~1e-3).
    assert not kl or (one["kl"] < 1e-6 and two["kl"] < 1e-6)
    # The updated weights, saved in bf16. The fp32 weights differ by summation order only (~1e-7), so a
    # bf16 value may round the other way where the two straddle a rounding boundary: at most one bf16 step
    # (2^-8 to 2^-7 of the value), and in very few places (measured: 20 of 6.3 million). An averaged
    # gradient or a micro-batch lost shows in the gradient norm above.
    initial, a, b = (load_hf_weights(p) for p in (tiny_checkpoint, tmp_path / "one", tmp_path / "two"))
    assert a.keys() == b.keys() == initial.keys()
    changed = differ = total = 0
    for name in a:
        torch.testing.assert_close(a[name].float(), b[name].float(), rtol=2 ** -7, atol=1e-6, msg=name)
        differ += int((a[name] != b[name]).sum())
        total += a[name].numel()
        changed += a[name].dim() > 1 and not torch.equal(a[name], initial[name])
    assert differ <= 1e-4 * total, f"{differ} of {total} weights differ"
    # every matrix was trained (the RMSNorm weights are 1.0, where bf16's step, 2^-7, exceeds one update of 1e-3)
    assert changed == sum(t.dim() > 1 for t in a.values())


def test_a_checkpoint_of_two_ranks_resumes_on_one_and_one_of_one_rank_on_two(tmp_path, shared_ranks):
    """The trainer's state (policy, AdamW's moments, counters) saved by 2 ranks and loaded on 1, and saved
    by 1 and loaded on 2: the next two steps' losses and gradient norms are those of the trainer that
    saved it, going on (within the sums' order: fp32). The second step's loss depends on the first's
    update, so on the optimizer state restored too."""
    async def steps(trainer, buffer, config, tokenizer) -> list[tuple[float, float]]:
        out = []
        for batch in (1, 2):
            metrics = await train_through_buffer(trainer, buffer, fixed_episodes(tokenizer, batch), config)
            assert metrics["updates_skipped"] == 0
            out.append((metrics["loss"], metrics["grad_norm"]))
        return out

    async def run():
        tokenizer = ChatTokenizer(resolve_checkpoint("tiny"))
        configs = {ranks: TrainerConfig(lr=1e-3, num_threads=1, ranks=ranks, micro_batch_size=2, bf16_autocast=False)
                   for ranks in (1, 2)}
        spawned = {ranks: trainer_on(shared_ranks[ranks], configs[ranks], resolve_checkpoint("tiny"))
                   for ranks in (1, 2)}
        buffers = {ranks: replay_buffer_on(shared_ranks[1], configs[ranks], tokenizer.pad_id) for ranks in (1, 2)}
        going_on, resumed = {}, {}
        for ranks, trainer in spawned.items():
            await train_through_buffer(trainer, buffers[ranks], fixed_episodes(tokenizer), configs[ranks])
            assert await first(trainer.publish_weights.call()) == 1
            await trainer.save_state.call(str(tmp_path / f"saved_by_{ranks}"))
            going_on[ranks] = await steps(trainer, buffers[ranks], configs[ranks], tokenizer)
        for ranks, trainer in spawned.items():  # each loads what the other rank count saved
            assert await first(trainer.load_state.call(str(tmp_path / f"saved_by_{3 - ranks}"))) == 1
            resumed[ranks] = await steps(trainer, buffers[ranks], configs[ranks], tokenizer)
        return going_on, resumed

    # measured: the losses agree to 1e-7 and the norms to 2e-6 of their value (their sums' order differs
    # between 1 and 2 ranks); a restore that started AdamW afresh moved the second loss by 9e-3
    going_on, resumed = asyncio.run(run())
    for ranks in (1, 2):
        saver = going_on[3 - ranks]
        for (loss, grad_norm), (loss_saver, grad_norm_saver) in zip(resumed[ranks], saver):
            assert abs(loss - loss_saver) <= 1e-6 and abs(grad_norm - grad_norm_saver) <= 1e-5 * grad_norm_saver
