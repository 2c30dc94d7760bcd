"""The torch generator's engine (meshrl/actors/torch_generator.py): continuous batching over the trainer's own
torchtitan model with a KV cache of its own, in pure torch (no Monarch, no vLLM), so that a generator samples
with exactly the model the trainer trains, wherever torch runs.

KV cache (meshrl/actors/kv_cache.py): each layer's inner attention is wrapped (`CachedAttention`, the layer's own
kept inside). During an engine forward it writes the new keys and values (rotated at the positions the engine
passes) into a slot cache ([slots, max_model_len, kv heads, head dim] per layer, in the compute dtype, allocated at the first forward) and
attends each row's queries to its slot's keys up to their positions. Otherwise it is the layer's own attention:
the same model still computes exactly the trainer's forward (meshrl/exact.py re-scores on it). Without
`attention.inner_attention` in every layer (the transformers backend), or with `kv_cache=False`, each step
computes every running sequence's whole context again, right-padded.

Scheduling: a request of n sequences takes n slots, first come first served, free or held by prefix-cache
entries (evicted least recently used first). Its first sequence prefills the prompt once, then its KV is copied
into the other n-1 slots (fork) and all n sample their first token from its logits. A step runs one prefill
forward (each prefilling sequence's next chunk, `prefill_chunk` tokens in all, right-padded) and one decode
forward ([B, 1]). A finished sequence's slot becomes a prefix-cache entry (its tokens, under its request's
`salt`: the generator's policy version); a later request of that salt whose prompt shares a prefix with it (a
conversation's next turn) copies those rows (or takes the slot over) and prefills only the rest; so does one
whose prompt shares a prefix with a sequence running (a group's conversations share their opening: a request
whose opening another computes in this step waits a step for it).

Sampling: the last position's logits in float32 (float64 kept) / temperature (greedy at 0), top-k, then top-p;
each token's logprob is the log-softmax of those processed logits (vLLM's processed logprobs). A request with a
seed draws from generators of its own: the same tokens whatever else runs beside it.
"""

from dataclasses import dataclass, field

import torch

from meshrl.actors.kv_cache import KVCache, wrap
from meshrl.losses import autocast

PREFIX_BLOCK = 16  # a prefix this much longer being computed in a step is worth waiting a step for


@dataclass
class StepOutput:
    """One sequence's news of one engine step."""

    request_id: str
    index: int  # the sequence within its request
    token_ids: list[int]  # sampled this step (one)
    logprobs: list[float]  # each one's logprob under the processed distribution it was sampled from
    text: str  # a delta: "" while running, the sequence's whole text (cut after a stop string) when it finishes
    finish_reason: str | None  # "stop" | "length", once this sequence finished
    finished: bool  # the whole request is done (on its last output)
    cached_tokens: int  # prompt tokens its request took from the prefix cache (on every output of the request)


@dataclass
class _Request:
    id: str
    prompt: list[int]
    n: int
    temperature: float
    max_tokens: int
    top_p: float
    top_k: int
    stop: list[str]
    seed: int | None
    salt: object
    sequences: list["_Sequence"] = field(default_factory=list)
    cached: int = 0


@dataclass
class _Sequence:
    request: _Request
    index: int
    slot: int
    tokens: list[int]  # prompt and generated
    computed: int = 0  # leading tokens whose keys and values are in the slot
    forked: bool = True  # False: waits for its request's first sequence to prefill the prompt
    looked: bool = True  # False: a request's first sequence before its first prefill chunk (`_reuse`)
    generator: torch.Generator | None = None  # its request's seed: its own draws
    finish_reason: str | None = None
    text: str = ""

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)


class TorchEngine:
    def __init__(self, model: torch.nn.Module, *, slots: int, max_model_len: int, tokenizer,
                 stop_token_ids: set[int] = frozenset(), prefill_chunk: int = 256, seed: int = 0,
                 bf16_autocast: bool = False, kv_cache: bool = True):
        """`model`: a policy from meshrl/models/model.py's `load_policy` (its forward gives hidden states);
        `slots`: sequences held at once (running, or kept as prefix-cache entries); `tokenizer`: a
        `tokenizers.Tokenizer` (texts and stop strings); `stop_token_ids`: the checkpoint's EOS tokens."""
        self.model, self.slots, self.max_model_len, self.tokenizer = model, slots, max_model_len, tokenizer
        self.stop_token_ids, self.prefill_chunk, self.bf16 = set(stop_token_ids), prefill_chunk, bf16_autocast
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        attentions = [getattr(layer, "attention", None) for layer in model.layers.values()]
        self.kv = None
        if kv_cache and all(hasattr(a, "inner_attention") for a in attentions):
            self.kv = KVCache(len(attentions), slots, max_model_len)
            wrap(attentions, self.kv)
        self.free = list(range(slots))[::-1]  # popped from the end: slot 0 first
        self.cache: dict[int, tuple[object, list[int]]] = {}  # slot -> (salt, tokens it holds), LRU first
        self.waiting: list[_Request] = []
        self.running: list[_Sequence] = []
        self.fed_tokens = 0  # tokens fed to the model so far (prefill and decode)
        self.offloaded = False

    # --- requests
    def add(self, request_id: str, prompt_ids: list[int], n: int, temperature: float, max_tokens: int,
            top_p: float = 1.0, top_k: int = 0, stop: list[str] = (), seed: int | None = None,
            salt: object = None) -> None:
        """Queue `n` sequences sampled from one prompt. `salt`: prefix-cache entries are shared only between
        requests of the same salt (the generator's policy version)."""
        if not 0 < len(prompt_ids) < self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens: the context holds {self.max_model_len} "
                             "(generator.max_model_len) and a reply needs one more")
        if not 0 < n <= self.slots or max_tokens < 1:
            raise ValueError(f"n={n} sequences of at least one token (max_tokens={max_tokens}): the engine holds "
                             f"{self.slots} sequences at once")
        self.waiting.append(_Request(request_id, list(prompt_ids), n, temperature, max_tokens, top_p, top_k,
                                     [s for s in stop if s], seed, salt))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_all(self) -> None:
        """Drop every queued and running request (their slots free, not cached)."""
        self.free += [seq.slot for seq in self.running]
        self.waiting, self.running = [], []

    def reset_prefix_cache(self) -> None:
        self.free += list(self.cache)
        self.cache.clear()

    def recompute_running(self) -> None:
        """Every running sequence's keys and values computed again (under weights changed since), in prefill
        chunks, before its next token."""
        for seq in self.running:
            seq.computed = 0

    def sleep(self, offload: bool = False) -> None:
        """Free the KV cache (the prefix cache with it; running sequences recompute theirs after `wake`); with
        `offload`, the weights to host memory too (nothing to do on the CPU)."""
        self.reset_prefix_cache()
        self.recompute_running()
        if self.kv is not None:
            self.kv.release()
        if offload and self.device.type != "cpu":
            self.model.to("cpu")
            self.offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Weights back on the device after `sleep(offload=True)`; the KV cache is allocated at the next forward."""
        if self.offloaded:
            self.model.to(self.device)
            self.offloaded = False

    # --- a step
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Admit what fits, then one prefill chunk budget and one token for every decoding sequence."""
        self._admit()
        ready = [s for s in self.running if s.forked]
        if self.kv is None:  # no cache: every context whole again, a request's first sequence alone until it forks
            for seq in ready:
                seq.computed = 0
            return self._sample(self._feed([(s, s.tokens) for s in ready]))
        decoding = [(s, s.tokens[-1:]) for s in ready if s.computed == len(s.tokens) - 1]
        budget, prefilling = self.prefill_chunk, []
        for seq in [s for s in ready if s.computed < len(s.tokens) - 1]:
            take = min(budget, len(seq.tokens) - seq.computed)
            if take <= 0:
                break
            if not seq.looked:
                if self._computing(seq, [row for row, _ in prefilling]):
                    continue  # its prefix is being computed in this step: taken from there in the next
                self._reuse(seq)
                take = min(budget, len(seq.tokens) - seq.computed)
            prefilling.append((seq, seq.tokens[seq.computed:seq.computed + take]))
            budget -= take
        return self._sample(self._feed(prefilling) + self._feed(decoding))

    def _admit(self) -> None:
        while self.waiting and len(self.free) + len(self.cache) >= self.waiting[0].n:
            request = self.waiting.pop(0)
            entry, length = self._match(request) if self.kv is not None else (None, 0)
            slots = self._take(request.n, entry, length)
            request.cached = length
            for i, slot in enumerate(slots):
                seq = _Sequence(request, i, slot, list(request.prompt), computed=length if i == 0 else 0, forked=i == 0,
                                looked=i != 0)
                if request.seed is not None:  # a stream of its own per sequence
                    seq.generator = torch.Generator(self.device).manual_seed((request.seed * 65537 + i) % 2**63)
                request.sequences.append(seq)
            self.running += request.sequences

    def _match(self, request: _Request) -> tuple[int | None, int]:
        """The prefix-cache entry (of `request`'s salt) sharing the longest prefix with its prompt, leaving at
        least one prompt token to compute: its slot and that length (None, 0: no entry shares one)."""
        best, length = None, 0
        for slot, (salt, tokens) in self.cache.items():
            shared = _shared_prefix(tokens, request.prompt, len(request.prompt) - 1) if salt == request.salt else 0
            if shared > length:
                best, length = slot, shared
        return best, length

    def _computing(self, seq: _Sequence, batch: list[_Sequence]) -> bool:
        """Whether a sequence of `batch` (this step's prefill, of `seq`'s salt) is computing a prefix of `seq`'s
        prompt longer than `seq` holds by PREFIX_BLOCK tokens or more."""
        return any(other.request.salt == seq.request.salt and _shared_prefix(
            other.tokens, seq.tokens, len(seq.request.prompt) - 1) >= seq.computed + PREFIX_BLOCK for other in batch)

    def _reuse(self, seq: _Sequence) -> None:
        """Before a request's first prefill chunk: a longer prefix of its prompt than its admission found, held
        by a sequence running now (of its salt; a request admitted beside it, whose prefill ran since: the
        conversations of one group share their opening), copied into its slot."""
        seq.looked = True
        best, length = None, seq.computed
        for other in self.running:
            if other is not seq and other.forked and other.request.salt == seq.request.salt:
                shared = _shared_prefix(other.tokens[:other.computed], seq.tokens, len(seq.request.prompt) - 1)
                if shared > length:
                    best, length = other.slot, shared
        if best is not None:
            self.kv.copy(best, seq.slot, length)
            seq.computed = seq.request.cached = length

    def _take(self, n: int, entry: int | None, length: int) -> list[int]:
        """`n` slots, cached entries evicted for them least recently used first, `entry` last; the first slot
        holds `entry`'s first `length` positions (a copy, or the entry's own slot when no other is left)."""
        for slot in [s for s in self.cache if s != entry]:
            if len(self.free) >= n:
                break
            del self.cache[slot]
            self.free.append(slot)
        if len(self.free) < n:  # only `entry` is left to evict: the request takes its slot over
            del self.cache[entry]
            return [entry] + [self.free.pop() for _ in range(n - 1)]
        slots = [self.free.pop() for _ in range(n)]
        if entry is not None:
            self.kv.copy(entry, slots[0], length)
            self.cache[entry] = self.cache.pop(entry)  # the most recently used now
        return slots

    def _feed(self, rows: list[tuple[_Sequence, list[int]]]) -> list[tuple[_Sequence, torch.Tensor]]:
        """Feed each row's tokens to its sequence (one forward); the sequences whose context is then computed,
        each with its next token's logits (a request's whole group once its first sequence has the prompt)."""
        if not rows:
            return []
        logits = self._forward(rows)
        ready = []
        for (seq, chunk), row in zip(rows, logits):
            seq.computed += len(chunk)
            if seq.computed == len(seq.tokens):
                ready += self._fork(seq, row)
        return ready

    def _forward(self, rows: list[tuple[_Sequence, list[int]]]) -> torch.Tensor:
        """The logits [B, V] after each row's last token, the rows right-padded. With the cache: their keys and
        values written into their sequences' slots, the padding at position max_model_len - 1, which no sequence
        feeds (one that reaches max_model_len tokens ends) and no real query reads."""
        kv, device = self.kv, self.device
        width, pad = max(len(chunk) for _, chunk in rows), self.max_model_len - 1
        ids = torch.tensor([chunk + [0] * (width - len(chunk)) for _, chunk in rows], device=device)
        last = torch.tensor([len(chunk) - 1 for _, chunk in rows], device=device)
        self.fed_tokens += sum(len(chunk) for _, chunk in rows)
        if kv is not None:
            kv.positions = torch.tensor([list(range(s.computed, s.computed + len(c))) + [pad] * (width - len(c))
                                         for s, c in rows], device=device)
            kv.rows = torch.tensor([seq.slot for seq, _ in rows], device=device)
            span = max(seq.computed + len(chunk) for seq, chunk in rows)
            kv.mask = (torch.arange(span, device=device) <= kv.positions[:, :, None])[:, None]
            kv.active = True
        try:
            with autocast(device, self.bf16):
                hidden = self.model(ids, positions=None if kv is None else kv.positions)
                return _wide(self.model.lm_head(hidden[torch.arange(len(rows), device=device), last]))
        finally:
            if kv is not None:
                kv.active = False

    def _fork(self, seq: _Sequence, logits: torch.Tensor) -> list[tuple[_Sequence, torch.Tensor]]:
        """`seq` with its next token's logits; a request's first sequence that has just computed the prompt with
        its siblings too, each given a copy of its keys and values."""
        waiting = [s for s in seq.request.sequences if not s.forked]
        for other in waiting:
            if self.kv is not None:
                self.kv.copy(seq.slot, other.slot, seq.computed)
            other.computed, other.forked = seq.computed, True
        return [(seq, logits)] + [(other, logits) for other in waiting]

    def _sample(self, ready: list[tuple[_Sequence, torch.Tensor]]) -> list[StepOutput]:
        """A token for each sequence from its logits, as its request samples; the step's outputs."""
        if not ready:
            return []
        seqs = [seq for seq, _ in ready]
        logits = torch.stack([row for _, row in ready])
        logprobs = _processed(logits, [seq.request for seq in seqs]).log_softmax(-1)
        tokens = self._draw(seqs, logits, logprobs)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        return [self._took(seq, token, logprob) for seq, token, logprob in zip(seqs, tokens.tolist(), chosen.tolist())]

    def _draw(self, seqs: list[_Sequence], logits: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """Greedy rows (temperature 0) their argmax; the others drawn, seeded sequences from their own generators
        and the rest in one draw from the engine's."""
        tokens = logits.argmax(-1)
        shared = [i for i, s in enumerate(seqs) if s.request.temperature > 0 and s.generator is None]
        if shared:
            rows = torch.tensor(shared, device=self.device)
            tokens[rows] = _inverse_cdf(logprobs[rows].exp(), self.generator)
        for i, seq in enumerate(seqs):
            if seq.request.temperature > 0 and seq.generator is not None:
                tokens[i] = _inverse_cdf(logprobs[i:i + 1].exp(), seq.generator)[0]
        return tokens

    def _took(self, seq: _Sequence, token: int, logprob: float) -> StepOutput:
        """`seq` takes `token`; its output of this step (its slot a prefix-cache entry once it ends; the output
        that ends its request's last sequence says the request is done)."""
        seq.tokens.append(token)
        seq.finish_reason = self._finish(seq, token)
        request = seq.request
        if seq.finish_reason:
            self.running.remove(seq)
            if self.kv is not None and seq.computed > 0:
                self.cache[seq.slot] = (request.salt, seq.tokens[:seq.computed])
            else:
                self.free.append(seq.slot)
        return StepOutput(request.id, seq.index, [token], [logprob], seq.text if seq.finish_reason else "",
                          seq.finish_reason, all(s.finish_reason for s in request.sequences), request.cached)

    def _finish(self, seq: _Sequence, token: int) -> str | None:
        """Why `seq` ends with `token`: an EOS token or a stop string ("stop": the text cut right after the
        stop string), max_tokens or a full context ("length"); None: it goes on. Its text once it ends."""
        request = seq.request
        text = self._text(seq) if request.stop else ""
        ends = [text.index(s) + len(s) for s in request.stop if s in text]
        if token in self.stop_token_ids or ends:
            reason = "stop"
        elif seq.generated >= request.max_tokens or len(seq.tokens) >= self.max_model_len:
            reason = "length"
        else:
            return None
        seq.text = text[:min(ends, default=len(text))] if request.stop else self._text(seq)
        return reason

    def _text(self, seq: _Sequence) -> str:
        return self.tokenizer.decode(seq.tokens[len(seq.request.prompt):], skip_special_tokens=True)


def _shared_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of the longest common prefix of `a` and `b`, at most `limit` (a binary search of list
    comparisons, which run in C)."""
    high = min(len(a), len(b), limit)
    if high <= 0 or a[0] != b[0]:
        return 0
    if a[:high] == b[:high]:
        return high
    low = 1  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if a[:middle] == b[:middle] else (low, middle)
    return low


def _processed(logits: torch.Tensor, requests: list[_Request]) -> torch.Tensor:
    """The logits [B, V] each row's request samples from: / temperature (1 for greedy), then top-k and top-p
    (the smallest set of the most likely tokens whose mass reaches top_p), the dropped ones -inf."""
    vocab, device = logits.shape[-1], logits.device
    temperature = torch.tensor([r.temperature or 1.0 for r in requests], dtype=logits.dtype, device=device)
    logits = logits / temperature[:, None]
    top_k = [r.top_k if 0 < r.top_k < vocab else vocab for r in requests]
    top_p = [min(r.top_p, 1.0) for r in requests]
    if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    ordered, order = logits.sort(-1, descending=True)
    ordered = ordered.masked_fill(torch.arange(vocab, device=device) >= torch.tensor(top_k, device=device)[:, None],
                                  float("-inf"))
    probs = ordered.softmax(-1)
    p = torch.tensor(top_p, dtype=logits.dtype, device=device)[:, None]
    drop = (probs.cumsum(-1) - probs >= p) & (p < 1.0)
    drop[:, 0] = False  # the most likely token stays, whatever top_p
    return torch.empty_like(logits).scatter_(1, order, ordered.masked_fill(drop, float("-inf")))


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A token of each row of `probs` [B, V]: the first whose cumulative mass exceeds a uniform draw times the
    row's mass (strictly less than it: a token of probability 0 is never drawn). torch.multinomial draws one
    exponential per token of the vocabulary (its single-sample path): 30-70 ms a step for 32 rows of 49k on 2
    CPU cores, against about 1 ms here."""
    mass = probs.cumsum(-1)
    draw = torch.rand((len(probs), 1), generator=generator, dtype=probs.dtype, device=probs.device)
    return torch.searchsorted(mass, draw * mass[:, -1:], right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float32 at least (float64 stays: the tests' reference models)."""
    return logits if logits.dtype == torch.float64 else logits.float()
