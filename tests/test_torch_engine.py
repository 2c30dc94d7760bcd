"""The torch generator's engine (meshrl/actors/torch_engine.py) on the tiny random models, in this process: its
cached, chunked, continuously batched decoding computes what a plain forward of each whole sequence computes,
which is what the trainer scores the samples with. Numbers are compared in float64 (the models cast to it), where
two ways of computing the same thing differ by rounding far below the tolerance (TOL); the patched model outside
the engine's steps is compared bit for bit with an unpatched one, as the exact mode's re-scoring relies on."""

import copy

import pytest
import torch
from tokenizers import Tokenizer

from meshrl.actors.kv_cache import CachedAttention
from meshrl.actors.torch_engine import TorchEngine
from meshrl.losses import autocast
from meshrl.models.model import load_policy, resolve_checkpoint

TOL = 1e-9  # float64: the cached and the plain computation differ by rounding of order 1e-15
MODELS: dict[str, torch.nn.Module] = {}


def model64(name: str = "tiny") -> torch.nn.Module:
    """A fresh float64 copy of the tiny model `name` (loaded once; RoPE's complex table stays complex)."""
    if name not in MODELS:
        MODELS[name] = load_policy(resolve_checkpoint(name))[0].double().eval()
    return copy.deepcopy(MODELS[name])


def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(resolve_checkpoint("tiny") / "tokenizer.json"))


def engine(model, **settings) -> TorchEngine:
    settings = {"slots": 8, "max_model_len": 128, "tokenizer": tokenizer(), "prefill_chunk": 16, **settings}
    return TorchEngine(model, **settings)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def drain(e: TorchEngine, joins: dict | None = None) -> dict:
    """Step `e` until it has nothing left (calling `joins[step]` before that step): per (request, index) its
    tokens, logprobs, text, finish reason, cached tokens, and the steps of its first output and of its end.
    Each request says it is finished once, on its last output."""
    got, step, done = {}, 0, set()
    while e.has_unfinished() or step in (joins or {}):
        if step in (joins or {}):
            joins[step]()
        for out in e.step():
            assert out.request_id not in done and len(out.token_ids) == len(out.logprobs) == 1
            if out.finished:
                done.add(out.request_id)
            seq = got.setdefault((out.request_id, out.index), {"tokens": [], "logprobs": [], "text": "", "first": step})
            seq["tokens"] += out.token_ids
            seq["logprobs"] += out.logprobs
            seq["text"] += out.text
            seq.update(reason=out.finish_reason, cached=out.cached_tokens, end=step)
        step += 1
    assert done == {key for key, _ in got}
    return got


def reference(model, prompt_ids: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The log-softmax [T, V] before each of `tokens` from a plain forward of the whole sequence."""
    with torch.no_grad():
        logits = model.lm_head(model(torch.tensor([prompt_ids + tokens])))[0, len(prompt_ids) - 1:-1]
    return (logits.double() / temperature).log_softmax(-1)


def assert_matches(model, prompt_ids: list[int], seq: dict, temperature: float = 1.0) -> None:
    expected = reference(model, prompt_ids, seq["tokens"], temperature)
    expected = expected[torch.arange(len(seq["tokens"])), torch.tensor(seq["tokens"])]
    assert torch.allclose(torch.tensor(seq["logprobs"], dtype=torch.float64), expected, rtol=0, atol=TOL), \
        (seq["logprobs"], expected)


@pytest.mark.parametrize("name", ["tiny", "tiny_qwen3"])
def test_cached_chunked_batched_decoding_matches_a_plain_forward(name):
    """Prompts of 5, 23 and 40 tokens prefilled in chunks of 16 and decoded together: every sampled token's
    logprob is the plain forward's of the whole sequence (llama3; qwen3 with its q/k norms), each prompt token
    fed once and each generated one but the last once."""
    model = model64(name)
    e = engine(model)
    prompts = {str(i): prompt(length, i) for i, length in enumerate((5, 23, 40))}
    for key, ids in prompts.items():
        e.add(key, ids, n=1, temperature=1.0, max_tokens=12, seed=int(key))
    got = drain(e)
    for (key, _), seq in got.items():
        assert len(seq["tokens"]) == 12 and seq["reason"] == "length"
        assert_matches(model, prompts[key], seq)
    assert e.fed_tokens == 5 + 23 + 40 + 3 * 11
    assert len({seq["first"] for seq in got.values()}) == 3  # the 40-token prompt took 3 chunks to join


def test_a_request_samples_the_same_whatever_joins_and_leaves():
    """A seeded request's tokens (and logprobs, within rounding) are the same alone and among requests that
    were decoding when it joined, and one that joins later, waits for free slots, and leaves before it ends."""
    model = model64()
    alone = engine(model)
    alone.add("a", prompt(17, 1), n=2, temperature=1.0, max_tokens=10, seed=7)
    expected = drain(alone)

    e = engine(model, slots=4)
    e.add("b", prompt(30, 2), n=2, temperature=1.0, max_tokens=8, seed=1)
    joins = {3: lambda: e.add("a", prompt(17, 1), n=2, temperature=1.0, max_tokens=10, seed=7),
             5: lambda: e.add("c", prompt(9, 3), n=1, temperature=1.0, max_tokens=2, seed=2)}
    got = drain(e, joins)
    for index in (0, 1):
        assert got["a", index]["tokens"] == expected["a", index]["tokens"]
        assert_matches(model, prompt(17, 1), got["a", index])
    assert got["a", 0]["tokens"] != got["a", 1]["tokens"]
    assert got["b", 0]["first"] < 3 < got["b", 0]["end"]  # a joined while b decoded
    assert got["c", 0]["first"] > max(got["b", 0]["end"], got["b", 1]["end"])  # c waited for b's slots
    assert got["c", 0]["end"] < got["a", 0]["end"]  # and left before a ended
    assert_matches(model, prompt(9, 3), got["c", 0])


def test_n_sequences_share_one_prefill_of_their_prompt():
    """n=4: the 30-token prompt is prefilled once (in chunks of 8), its KV copied to the other 3 slots, and
    each of the 4 different samples matches the plain forward."""
    model = model64()
    e = engine(model, prefill_chunk=8)
    ids = prompt(30, 4)
    e.add("r", ids, n=4, temperature=1.0, max_tokens=6)
    got = drain(e)
    assert e.fed_tokens == 30 + 4 * 5
    assert len({tuple(seq["tokens"]) for seq in got.values()}) == 4
    for seq in got.values():
        assert_matches(model, ids, seq)


@pytest.mark.parametrize("slots", [1, 3])
def test_a_conversations_next_turn_reuses_the_prefix_cache(slots):
    """A second turn (the first's prompt + completion + 5 new tokens) takes the first turn's KV from the cache
    (copied, or its slot taken over when it is the only one): 27 tokens cached, 6 prefilled, the same tokens
    and logprobs as without the cache; another salt, or reset_prefix_cache, and nothing is cached."""
    model = model64()
    e = engine(model, slots=slots)
    first = prompt(20, 5)
    e.add("1", first, n=1, temperature=1.0, max_tokens=8, seed=1)
    turn = drain(e)["1", 0]
    assert turn["cached"] == 0
    second = first + turn["tokens"] + prompt(5, 6)
    fed = e.fed_tokens
    e.add("2", second, n=1, temperature=1.0, max_tokens=6, seed=2)
    cached = drain(e)["2", 0]
    assert cached["cached"] == 27 and e.fed_tokens - fed == 6 + 5
    assert len(e.cache) == min(slots, 2)  # copied: the first turn's entry stays beside the second's
    assert_matches(model, second, cached)
    e.add("3", second, n=1, temperature=1.0, max_tokens=6, seed=2, salt="newer weights")
    assert drain(e)["3", 0]["cached"] == 0
    e.reset_prefix_cache()
    e.add("4", second, n=1, temperature=1.0, max_tokens=6, seed=2)
    plain = drain(e)["4", 0]
    assert plain["cached"] == 0 and plain["tokens"] == cached["tokens"]
    assert torch.allclose(torch.tensor(plain["logprobs"]), torch.tensor(cached["logprobs"]), rtol=0, atol=TOL)


def test_cached_entries_are_evicted_least_recently_used_first():
    """With 2 slots, three finished prompts leave the last two cached: an extension of the first finds
    nothing (and evicts the second), an extension of the third finds its entry."""
    e = engine(model64(), slots=2)
    prompts = [prompt(12, 10 + i) for i in range(3)]
    for i, ids in enumerate(prompts):
        e.add(str(i), ids, n=1, temperature=1.0, max_tokens=3, seed=i)
        drain(e)
    e.add("x", prompts[0] + [7, 8], n=1, temperature=1.0, max_tokens=2)
    assert drain(e)["x", 0]["cached"] == 0
    e.add("y", prompts[2] + [7, 8], n=1, temperature=1.0, max_tokens=2)
    assert drain(e)["y", 0]["cached"] == 12
    e.add("z", prompts[1] + [7, 8], n=2, temperature=1.0, max_tokens=2)
    assert drain(e)["z", 0]["cached"] == 0  # evicted for x


def test_finish_reasons_and_texts():
    """A seeded request sampled until max_tokens ("length", the whole text); the same request ended by an EOS
    token ("stop", the token kept), by a stop string ("stop" at the first token whose text holds it, the text
    cut right after it), by a full context ("length"); a prompt that leaves no room refused (ValueError);
    temperature 0 decodes greedily."""
    model, tok = model64(), tokenizer()
    ids, sampling = prompt(10, 20), {"n": 1, "temperature": 1.0, "max_tokens": 20, "seed": 3}
    e = engine(model)
    e.add("all", ids, **sampling)
    whole = drain(e)["all", 0]
    tokens = whole["tokens"]
    assert whole["reason"] == "length" and len(tokens) == 20 and whole["text"] == tok.decode(tokens)

    k = next(i for i in range(3, 20) if tokens[i] not in tokens[:i])
    e = engine(model, stop_token_ids={tokens[k]})
    e.add("eos", ids, **sampling)
    assert (got := drain(e)["eos", 0])["tokens"] == tokens[:k + 1] and got["reason"] == "stop"

    stop = tok.decode(tokens[:10]).strip()[-3:]
    k = next(i for i in range(1, 21) if stop in tok.decode(tokens[:i]))
    text = tok.decode(tokens[:k])
    e = engine(model)
    e.add("stop", ids, **sampling, stop=["\x00never", stop])
    got = drain(e)["stop", 0]
    assert len(stop) == 3 and got["tokens"] == tokens[:k] and got["reason"] == "stop"
    assert got["text"] == text[:text.index(stop) + len(stop)] and got["text"].endswith(stop)

    e = engine(model, max_model_len=15)
    e.add("full", ids, **sampling)
    assert (got := drain(e)["full", 0])["tokens"] == tokens[:5] and got["reason"] == "length"
    with pytest.raises(ValueError, match="15"):
        e.add("long", prompt(15, 0), n=1, temperature=1.0, max_tokens=1)

    e = engine(model)
    e.add("greedy", ids, n=1, temperature=0.0, max_tokens=5)
    greedy = drain(e)["greedy", 0]
    assert greedy["tokens"] == reference(model, ids, greedy["tokens"]).argmax(-1).tolist()
    assert_matches(model, ids, greedy)


def test_top_k_and_top_p_filter_and_renormalise():
    """top_k=1 samples the argmax with logprob 0; with top_p=0.3 each token is among the most likely tokens
    whose mass first reaches 0.3, its logprob renormalised over them."""
    model, ids = model64(), prompt(15, 30)
    e = engine(model)
    e.add("k", ids, n=2, temperature=0.7, max_tokens=8, top_k=1)
    e.add("p", ids, n=2, temperature=0.7, max_tokens=8, top_p=0.3, seed=3)
    got = drain(e)
    for index in (0, 1):
        seq = got["k", index]
        assert seq["tokens"] == reference(model, ids, seq["tokens"]).argmax(-1).tolist()
        assert seq["logprobs"] == [0.0] * 8
        seq = got["p", index]
        for token, logprob, row in zip(seq["tokens"], seq["logprobs"], reference(model, ids, seq["tokens"], 0.7)):
            probs, order = row.exp().sort(descending=True)
            kept = int((probs.cumsum(0) < 0.3).sum()) + 1
            assert token in order[:kept].tolist() and 1 < kept < len(probs)
            assert logprob == pytest.approx(float(row[token] - probs[:kept].sum().log()), abs=TOL)
            assert logprob > row[token] + 1e-3


@pytest.mark.parametrize("name", ["tiny", "tiny_qwen3"])
def test_the_patched_model_outside_a_step_is_the_plain_model_bit_for_bit(name):
    """After an engine wrapped its attention and ran, the same model object's forward (in float32, plain and
    under the trainer's bf16 autocast, with and without positions) equals an unpatched copy's exactly."""
    patched, _ = load_policy(resolve_checkpoint(name))
    plain = copy.deepcopy(patched)
    e = engine(patched)
    e.add("r", prompt(9, 40), n=2, temperature=1.0, max_tokens=3)
    drain(e)
    assert any(isinstance(m, CachedAttention) for m in patched.modules())
    ids = torch.tensor([prompt(17, 41), prompt(17, 42)])
    positions = torch.arange(3, 20).expand(2, -1)
    with torch.no_grad():
        for bf16 in (False, True):
            with autocast(torch.device("cpu"), bf16):
                assert torch.equal(patched(ids), plain(ids))
                assert torch.equal(patched(ids, positions=positions), plain(ids, positions=positions))


def test_recompute_running_takes_new_weights_into_the_kv():
    """Weights changed in place before step 6: after recompute_running every later token's logprob is the plain
    forward's under the new weights; without it (in_flight) the old keys and values make them differ."""
    ids, errors = prompt(25, 50), {}
    for recompute in (True, False):
        model = model64()
        e = engine(model, prefill_chunk=8)
        e.add("r", ids, n=2, temperature=1.0, max_tokens=10, seed=5)
        got = drain(e, {6: lambda: change(model, e, recompute)})
        for seq in got.values():
            before = 6 - seq["first"]  # tokens sampled before the change
            assert 0 < before < 10 and len(seq["tokens"]) == 10
            rows = reference(model, ids, seq["tokens"])[before:]
            expected = rows[torch.arange(len(rows)), torch.tensor(seq["tokens"][before:])]
            error = (torch.tensor(seq["logprobs"][before:], dtype=torch.float64) - expected).abs().max()
            errors[recompute] = max(errors.get(recompute, 0.0), float(error))
    assert errors[True] < TOL and errors[False] > 1e-6, errors


def change(model, e: TorchEngine, recompute: bool) -> None:
    with torch.no_grad():
        noise = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise, dtype=p.dtype) * 0.05)
    if recompute:
        e.recompute_running()


def test_sleep_frees_the_cache_and_the_run_goes_on():
    """sleep() mid-run frees every layer's cache tensors; after wake() the running sequences recompute their
    context and go on exactly (float64 tolerance)."""
    model = model64()
    e = engine(model)
    ids = prompt(20, 60)
    e.add("r", ids, n=2, temperature=1.0, max_tokens=8, seed=9)
    got = drain(e, {3: lambda: (e.sleep(), check_freed(e), e.wake())})
    for seq in got.values():
        assert len(seq["tokens"]) == 8
        assert_matches(model, ids, seq)


def check_freed(e: TorchEngine) -> None:
    assert all(t is None for t in e.kv.keys + e.kv.values) and not e.cache


def test_without_a_kv_cache_the_results_are_the_cached_ones():
    """kv_cache=False (as for a model whose layers have no inner attention to wrap): nothing is wrapped, each
    step recomputes whole contexts, and the seeded samples and their logprobs are the cached engine's."""
    ids = [prompt(length, 70 + length) for length in (6, 19)]
    results = []
    for kv_cache in (True, False):
        model = model64()
        e = engine(model, kv_cache=kv_cache)
        assert any(isinstance(m, CachedAttention) for m in model.modules()) == kv_cache
        for i, p in enumerate(ids):
            e.add(str(i), p, n=2, temperature=1.0, max_tokens=7, seed=i)
        results.append(drain(e))
    cached, recomputed = results
    assert cached.keys() == recomputed.keys()
    for key, seq in cached.items():
        assert recomputed[key]["tokens"] == seq["tokens"] and recomputed[key]["reason"] == seq["reason"]
        assert torch.allclose(torch.tensor(recomputed[key]["logprobs"]), torch.tensor(seq["logprobs"]), atol=TOL)


def test_abort_all_drops_every_request_and_frees_the_slots():
    e = engine(model64(), slots=2)
    e.add("a", prompt(10, 80), n=2, temperature=1.0, max_tokens=50)
    e.add("b", prompt(10, 81), n=1, temperature=1.0, max_tokens=50)
    e.step()
    e.abort_all()
    assert not e.has_unfinished() and sorted(e.free) == [0, 1] and not e.cache
