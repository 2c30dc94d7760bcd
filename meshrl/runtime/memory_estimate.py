"""Bytes a trainer rank and a reference rank hold at their peak, from the model's architecture alone.

The memory plan (meshrl/runtime/memory_plan.py) asks this module, per rank, before anything starts. Nothing
here is fitted to a measurement: every term is a tensor the code allocates, counted in the dtype it has
(tests/test_memory_plan.py holds the sum against `meshrl check gpu`'s measured peaks, and the per-layer
count against the bytes autograd saves on the CPU).

What a layer's forward saves for its backward, per token (`layer_saved`), bf16 autocast over fp32 weights
("off": fp32 all-gather) or bf16 ones ("on": FSDP2 gathers bf16, the residual stream is bf16 then):

    norm ----> q,k,v in  ----> [q,k norm] -> SDPA(q,k,v,out,lse) -> wo(out) -> + residual
    (input,     (a bf16 copy                  (flash: k,v at KV heads)
     1/rms)      per linear when the
                 residual is fp32)
    norm ----> w1,w3 in  ----> silu(w1 x) * w3 x -> w2       (dense: 4 tensors of the FFN width)
          `--> router (fp32 scores) -> top-k -> experts' grouped matmuls on the k copies of each token (MoE)

A forward_backward's peak is the largest of its phases (`trainer_phases`): the loss's backward (every
layer's activations or checkpointed inputs, the [tokens, vocabulary] fp32 logits, their log-softmax,
probabilities and gradients: 24 bytes a token a vocabulary entry with the entropy bonus, 12 without),
each layer's backward (its activations recomputed under checkpointing, the gradients done so far, its
unsharded gradients and FSDP2's reduce-scatter buffer), and the embedding's at the end. Sharded state is
divided by the ranks; FSDP2's gathered units (the embedding and head kept gathered, one layer and the
next prefetched) are whole on every rank. With fp32 weights, bf16 autocast's copy of every matrix is
saved for the backward (or cached until the forward ends, under checkpointing).
"""

from dataclasses import dataclass

from meshrl.models.families import _is_moe_layer, _num_experts

# Per loss token and vocabulary entry, fp32, at the loss's backward (meshrl/losses.py `_head_terms`): with the
# entropy bonus the saved logits, log-softmax and probabilities, and at the probabilities' backward the gradients
# of both and the exp's (6 x 4); without it the saved logits, logsumexp's backward (x - lse, its exp) and the
# gradient (3 x 4). A no-grad pass (the reference) holds the fp32 logits and logsumexp's temporary (2 x 4).
ENTROPY_BONUS_BYTES, LOGPROB_BYTES, REFERENCE_LOGIT_BYTES = 24, 12, 8


@dataclass(frozen=True)
class Shape:
    """The fields of an HF config the estimate reads (Llama, Qwen3, Qwen3-MoE)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_positions: int
    qwen3: bool  # per-head q and k norms, cos/sin RoPE tables
    experts: int = 0
    moe_intermediate: int = 0
    top_k: int = 0
    route_norm: bool = False
    moe: tuple[bool, ...] = ()  # per layer: MoE or dense FFN

    @staticmethod
    def of(hf: dict) -> "Shape":
        heads = hf["num_attention_heads"]
        return Shape(hf["hidden_size"], hf["num_hidden_layers"], heads, hf.get("num_key_value_heads") or heads,
                     hf.get("head_dim") or hf["hidden_size"] // heads, hf["intermediate_size"], hf["vocab_size"],
                     bool(hf.get("tie_word_embeddings", False)), hf.get("max_position_embeddings", 4096),
                     "Qwen3" in (hf.get("architectures") or [""])[0], _num_experts(hf),
                     hf.get("moe_intermediate_size", 0), hf.get("num_experts_per_tok", 0),
                     bool(hf.get("norm_topk_prob", False)),
                     tuple(_is_moe_layer(hf, i) for i in range(hf["num_hidden_layers"])))

    # -- parameters

    def attention_matmuls(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv)

    def matmuls(self, i: int) -> int:
        """Layer i's linear weights that bf16 autocast copies (experts and the MoE router apart)."""
        return self.attention_matmuls() + (0 if self.moe[i] else 3 * self.hidden * self.intermediate)

    def expert_params(self, i: int) -> int:
        return 3 * self.experts * self.moe_intermediate * self.hidden if self.moe[i] else 0

    def layer_params(self, i: int) -> int:
        norms = 2 * self.hidden + (2 * self.head_dim if self.qwen3 else 0)
        router = self.experts * self.hidden if self.moe[i] else 0  # fp32 under autocast: never copied
        return self.matmuls(i) + self.expert_params(i) + router + norms

    def root_params(self) -> int:
        """The embedding, the final norm and an untied head: FSDP2's units outside the layers."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return sum(self.layer_params(i) for i in range(self.layers)) + self.root_params()

    def buffers(self) -> int:
        """RoPE tables per layer, fp32, for every position: Llama's complex ones (head_dim / 2 complex64),
        Qwen3's cos and sin (2 x head_dim)."""
        return self.layers * self.max_positions * self.head_dim * (8 if self.qwen3 else 4)

    def kv_cache_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """A LoRA adapter's parameters: rank x (in + out) per targeted linear that the model has."""
        q, kv, d, f = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        sides = {"q_proj": d + q, "k_proj": d + kv, "v_proj": d + kv, "o_proj": q + d}
        dense = {"gate_proj": d + f, "up_proj": d + f, "down_proj": f + d}
        per_layer = [sum(sides.get(t, 0) + (0 if self.moe[i] else dense.get(t, 0)) for t in targets)
                     for i in range(self.layers)]
        return rank * sum(per_layer)


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of what a pass holds: weights as gathered or held (4 fp32, 2 bf16; the residual
    stream follows them), compute (2 under bf16 autocast), and the device's RMSNorm: CUDA's fused kernel
    (input and weight of one dtype) saves its input and 1/rms, the composite one (the CPU, or mixed dtypes)
    the fp32 input and the normalised input too. The MoE router's scores are fp32 on CUDA (autocast to
    float32), in the residual's dtype on the CPU (whose autocast refuses float32)."""

    weights: int = 4
    compute: int = 2
    cuda: bool = True

    def norm(self, width: int, heads: int, input_bytes: int) -> int:
        if self.cuda and input_bytes == self.weights:
            return input_bytes * width + 4 * heads
        return 8 * width + 4 * heads

    def copies(self, linears: int, width: int) -> int:
        """The inputs the linears reading one tensor save: one bf16 copy each of an fp32 tensor, else the
        tensor itself once."""
        return (linears if self.weights != self.compute else 1) * self.compute * width

    @property
    def router(self) -> int:
        return 4 if self.cuda else self.weights


def layer_saved(shape: Shape, i: int, d: Dtypes) -> int:
    """Bytes layer i's forward saves for its backward, per token (see the module's drawing)."""
    r, a, dim = d.weights, d.compute, shape.hidden
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    saved = d.norm(dim, 1, r) + d.copies(3, dim)
    if shape.qwen3:  # q and k normalised per head, from the projections' compute dtype
        saved += d.norm(q, shape.heads, a) + d.norm(kv, shape.kv_heads, a)
    saved += a * (2 * q + 2 * kv) + 4 * shape.heads  # SDPA: q, k, v, out, logsumexp (wo reads out itself)
    saved += d.norm(dim, 1, r)
    if not shape.moe[i]:
        return saved + d.copies(2, dim) + 4 * a * shape.intermediate  # w1 x, silu, w3 x, their product
    k, rt = shape.top_k, d.router
    saved += rt * dim + rt * shape.experts + 8 * k  # gate's input, softmax, top-k indices
    saved += rt * (k + 1) if shape.route_norm else 0  # scores / their sum
    saved += 16 * k  # the dispatch's two index tensors
    saved += (2 if r != 2 else 1) * 2 * dim * k  # bf16 copies of the routed tokens (w1, w3)
    saved += 4 * 2 * shape.moe_intermediate * k  # grouped matmuls' outputs, silu, product
    return saved + 4 * dim * k + rt * k  # combine: fp32 expert outputs x scores


def layer_backward_extra(shape: Shape, i: int, d: Dtypes) -> int:
    """Per token, beside a layer's activations at its backward's start: the gradients of the FFN's three
    widest tensors at once, and the residual stream's gradient in and out."""
    width = shape.top_k * shape.moe_intermediate if shape.moe[i] else shape.intermediate
    return 3 * d.compute * width + 2 * d.weights * shape.hidden


def reference_layer_peak(shape: Shape, i: int, d: Dtypes) -> int:
    """Per token, a no-grad forward's most at once (its FFN): the residual and the norm's output, the input's
    bf16 copy, and three tensors of the FFN's width (or the routed copies of each token, with MoE)."""
    r, a, dim = d.weights, d.compute, shape.hidden
    if not shape.moe[i]:
        return 2 * r * dim + a * dim + 3 * a * shape.intermediate
    k = shape.top_k
    return 2 * r * dim + (r + 2) * dim * k + 3 * 2 * shape.moe_intermediate * k + 4 * shape.experts


@dataclass(frozen=True)
class Pass:
    """One micro-batch and how the trainer runs it (meshrl/models/memory.py's switches, resolved)."""

    tokens: int  # positions of the micro-batch (padded)
    loss_tokens: int  # the trained positions among them
    checkpointing: str = "off"  # off | full | selective
    chunk: int = 0  # trainer.logprob_chunk_tokens (0: all loss positions at once)
    entropy_bonus: bool = False  # trainer.loss.entropy_coef > 0: the entropy's gradient too
    trainable: int = 0  # parameters trained (0: all of them; a LoRA adapter's otherwise)


def trainer_phases(shape: Shape, p: Pass, d: Dtypes, ranks: int = 1, sharded: bool = False,
                   steady: bool = True) -> dict[str, int]:
    """Bytes a trainer rank holds at each phase of one forward_backward (the peak is their max). `sharded`:
    FSDP2 (several ranks, or one in a process group); `steady`: the AdamW moments and this update's
    gradients already exist (any micro-batch after a run's first), else neither (the first micro-batch)."""
    n, m, dim, vocab, L = p.tokens, p.loss_tokens, shape.hidden, shape.vocab, shape.layers
    r, a, emb = d.weights, d.compute, shape.vocab * shape.hidden
    total = shape.params()
    lora = 0 < p.trainable < total
    trainable = p.trainable or total
    base = 4 * total // ranks + shape.buffers() + (12 * trainable // ranks if steady else 0)
    gathered = r if sharded else 0  # bytes per parameter of a unit gathered whole on every rank
    kept = gathered * (emb + dim)  # the tied embedding (or the untied head) and the final norm, kept gathered
    cast = a == 2 and r == 4  # bf16 autocast over fp32 weights: a bf16 copy of each matrix
    copies = [2 * (shape.matmuls(i) + shape.expert_params(i)) if cast else 0 for i in range(L)]
    saved_copy = copies if p.checkpointing == "off" else [0] * L  # saved for the backward
    cached = sum(2 * shape.matmuls(i) for i in range(L)) if cast and p.checkpointing != "off" and not lora else 0
    full = [layer_saved(shape, i, d) * n for i in range(L)]
    stored = [full[i] if p.checkpointing == "off" else
              r * dim * n if p.checkpointing == "full" else
              r * dim * n + (full[i] - r * dim * n) // 2 for i in range(L)]  # selective: about half kept
    final = (d.norm(dim, 1, r) + 8) * n + r * dim * m  # the final norm, token ids, hidden at loss positions
    per_logit = ENTROPY_BONUS_BYTES if p.entropy_bonus else LOGPROB_BYTES
    head_cast = 2 * emb if cast else 0
    # the head's gradient: unsharded (tied: until the embedding's backward ends) or its fp32 .grad
    head_grad = 0 if lora else gathered * emb if sharded else 0 if steady else 4 * emb
    if p.chunk <= 0:  # the whole [loss tokens, vocabulary] at once, its input's bf16 copy, the head's copy
        loss = per_logit * vocab * m + (a * dim * m if r != a else 0) + head_cast
    else:  # one chunk's logits, the hidden states' gradient, the head's accumulating over chunks
        loss = per_logit * vocab * min(p.chunk, m) + 2 * r * dim * m + head_cast + head_grad + (0 if lora else 2 * emb)
    last = gathered * shape.layer_params(L - 1)  # prefetched for the backward
    phases = {"forward end": base + kept + sum(stored) + cached + final,
              "loss": base + kept + sum(stored) + sum(saved_copy) + final + loss + last}
    share = lambda params: 0 if steady or lora else 4 * params // ranks  # noqa: E731 (a gradient's shard)
    after_head = head_grad if shape.tied or not sharded else share(emb + dim)  # untied: reduce-scattered at once
    done = 0  # the layers' gradient shards made so far
    for k in reversed(range(L)):
        held = base + kept + after_head + done + sum(stored[:k]) + sum(saved_copy[:k + 1])
        recompute = copies[k] if p.checkpointing != "off" else 0
        units = gathered * (shape.layer_params(k) + (shape.layer_params(k - 1) if k else 0))
        phases[f"layer {k} backward"] = held + full[k] + recompute + units + layer_backward_extra(shape, k, d) * n
        grads = 0 if lora else shape.layer_params(k)  # unsharded in the gather dtype, then FSDP2's fp32 buffers
        phases[f"layer {k} reduce-scatter"] = held + units + ((r + 4) * grads + 4 * grads // ranks if sharded else 0)
        done += share(shape.layer_params(k))
    # the embedding's dense gradient (with a tied head: the head's, and their sum), FSDP2's fp32 buffers
    buffers = 4 * (emb + dim) + 4 * (emb + dim) // ranks if sharded else 0
    root = 0 if lora else (3 if shape.tied else 1) * (gathered or 4) * emb + buffers
    phases["embedding backward"] = base + done + (kept if shape.tied else gathered * emb) + root
    return phases


def optimizer_step(shape: Shape, trainable: int, ranks: int) -> int:
    """An AdamW update's rank: fp32 weights, gradients, two moments and the foreach update's temporary."""
    return 4 * shape.params() // ranks + shape.buffers() + 16 * (trainable or shape.params()) // ranks


def reference_peak(shape: Shape, tokens: int, loss_tokens: int, d: Dtypes, ranks: int = 1,
                   sharded: bool = False, chunk: int = 1024) -> int:
    """A reference rank's most during one logprobs pass: its weights (bf16 matrices with reference.dtype
    bfloat16: d.weights 2), the units gathered in fp32 (the embedding kept), and the larger of a layer's
    forward and one chunk's logits."""
    dim, vocab = shape.hidden, shape.vocab
    matrices = sum(shape.matmuls(i) + shape.expert_params(i) for i in range(shape.layers))
    held = (d.weights * matrices + 4 * (shape.params() - matrices)) // ranks + shape.buffers()
    widest = max(range(shape.layers), key=shape.layer_params)
    gathered = 4 * ((vocab * dim + dim) + shape.layer_params(widest)) if sharded else 0
    fp32 = Dtypes(4, d.compute, d.cuda)  # the residual stream stays fp32 (the embedding does)
    layer = max(reference_layer_peak(shape, i, fp32) for i in range(shape.layers)) * tokens
    if d.weights == 4 and d.compute == 2:  # one matrix's bf16 copy at a time (all experts of a layer at once)
        layer += 2 * max(shape.hidden * shape.intermediate, shape.expert_params(widest) // 3)
    logits = REFERENCE_LOGIT_BYTES * vocab * min(chunk or loss_tokens, loss_tokens) + 4 * dim * loss_tokens
    return held + gathered + max(layer, logits)
