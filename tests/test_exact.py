"""generator.exact's two halves without processes: meshrl/exact.py scores each sequence alone, so its logprobs
do not depend on what it is batched or padded with (bit for bit), the generator's re-scoring of a completion is
the trainer's row, and the settings that cannot hold it are one line before anything starts."""

import pytest
import torch

from meshrl.actors.trainer_config import TrainerConfig
from meshrl.configs import Config, resolve
from meshrl.exact import per_sequence_terms, sequence_logprobs
from meshrl.losses import policy_terms
from meshrl.models.model import load_policy, resolve_checkpoint
from meshrl.runtime.dtypes import apply
from meshrl.actors.dtypes import Bf16Choice
from meshrl.types import TrainBatch


def batch_of(rows: list[list[int]], prompts: list[int], temperature: float = 0.8) -> TrainBatch:
    """Right-padded rows as the trainer's collate makes them: inputs all but the last token, targets shifted,
    the loss on each row's completion."""
    width = max(len(r) for r in rows) - 1
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        ids[i, :len(row) - 1], targets[i, :len(row) - 1] = torch.tensor(row[:-1]), torch.tensor(row[1:])
        mask[i, prompt - 1:len(row) - 1] = True
    return TrainBatch(ids, targets, mask, torch.zeros(mask.shape), torch.zeros(len(rows)), int(mask.sum()), len(rows),
                      temperature=torch.full((len(rows),), temperature))


@pytest.fixture(scope="module")
def model():
    policy, _ = load_policy(resolve_checkpoint("tiny_qwen3"))
    return policy


def test_a_sequence_scores_the_same_bits_alone_and_beside_any_other(model):
    """A row's logprobs from per_sequence_terms are torch.equal whether it is scored alone, beside a longer
    row (padded) or beside a shorter one, and they are the generator's `sequence_logprobs` of it: the trainer's
    row and the generator's re-scoring are one computation. (The batched `policy_terms` of the same rows is
    the trainer's default and may differ in the last bits: that is what per_sequence removes.)"""
    rows = [list(range(3, 40)), list(range(7, 90)), list(range(11, 25))]
    prompts = [10, 30, 5]
    alone = [per_sequence_terms(model, batch_of([r], [p]), False)[0][0] for r, p in zip(rows, prompts)]
    together = per_sequence_terms(model, batch_of(rows, prompts), False)[0]
    reversed_ = per_sequence_terms(model, batch_of(rows[::-1], prompts[::-1]), False)[0]
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        n = len(row) - 1
        assert torch.equal(together[i, :n], alone[i]) and torch.equal(reversed_[2 - i, :n], alone[i])
        assert not together[i, n:].any()  # padding scores nothing
        rescored = torch.tensor(sequence_logprobs(model, row, prompt, 0.8, False))
        assert torch.equal(rescored, alone[i][prompt - 1:])
    # the same values as the batched computation, to float32's rounding (not necessarily its bits)
    batched = policy_terms(model, batch_of(rows, prompts), False, 0)[0]
    torch.testing.assert_close(batched, together, rtol=0, atol=1e-5)


def test_per_sequence_terms_carry_the_gradient_and_the_entropy(model):
    """With a graph: the per-row logprobs' gradient reaches the weights, and the entropy comes back on the
    loss positions (zeros elsewhere), equal to the batched computation's to float32's rounding."""
    batch = batch_of([list(range(3, 30)), list(range(5, 20))], [6, 4])
    logprobs, entropy = per_sequence_terms(model, batch, False, "metric")
    logprobs.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad()
    _, batched_entropy = policy_terms(model, batch, False, 0, "metric")
    torch.testing.assert_close(entropy, batched_entropy, rtol=0, atol=1e-4)
    assert not entropy[~batch.loss_mask].any()


@pytest.mark.parametrize("args, message", [
    (["--generator.exact", "true"], "generator.exact samples in the trainer's own numerics: it needs generator.impl "
                                    "torch"),
    (["--generator.impl", "torch", "--generator.exact", "true", "--generator.weight_update", "in_flight"],
     "generator.exact re-scores a completion under the weights that sampled all of it: generator.weight_update "
     "drain (or auto), not in_flight"),
    (["--generator.impl", "torch", "--generator.exact", "true", "--weight_sync.dtype", "bfloat16"],
     "generator.exact serves the trainer's float32 master weights: weight_sync.dtype auto or float32, not bfloat16"),
    (["--generator.impl", "torch", "--generator.exact", "true", "--task", "zorplex"],
     "generator.exact re-scores each completion as the trainer scores its sequence: a multi-turn conversation is "
     "trained as one sequence, which no turn's re-scoring sees whole: single-turn tasks only"),
    (["--generator.impl", "torch", "--weight_sync.verify", "true"],
     "weight_sync.verify compares the tensors vLLM holds: not with generator.impl torch"),
])
def test_a_setting_exactness_cannot_hold_is_one_line_before_anything_starts(args, message, cli, tmp_path):
    code, _, err = cli("train", "--config", "smoke", "--run-dir", tmp_path / "run", *args)
    assert (code, err.strip().splitlines()) == (2, [f"meshrl: error: {message}"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("bf16", [False, True])
def test_exact_resolves_to_the_trainers_numerics(bf16):
    """generator.exact: the trainer scores row by row, loads drain (asynchronous or not), versions are published
    in float32 and the generator computes in the trainer's autocast rule, whatever the dtype choice was."""
    config = Config()
    config.generator.impl, config.generator.exact, config.controller.max_policy_age = "torch", True, 1
    config.check()
    resolved = resolve(config)
    assert resolved.trainer.per_sequence and resolved.generator.weight_update == "drain"
    choice = Bf16Choice(bf16, "measured")
    apply(resolved, {"generator": Bf16Choice(not bf16, "measured"), "trainer": choice}, {"generator", "trainer"})
    assert resolved.weight_sync.dtype == "float32"
    assert resolved.generator.dtype == ("bfloat16" if bf16 else "float32")
    plain = resolve(Config())
    assert not plain.trainer.per_sequence and TrainerConfig().per_sequence is False
