"""The torch engine's KV cache (meshrl/actors/torch_engine.py): slots of keys and values per layer, and the
wrapper that puts them in a torchtitan decoder layer's attention. While the engine runs a forward
(`KVCache.active`), each layer writes its new keys and values (rotated at the positions the engine passes) into
its rows' slots and attends each query to its slot's keys up to its position; at any other time the wrapper is
the layer's own attention, untouched, so the same model still computes the trainer's forward exactly."""

import torch
import torch.nn.functional as F


class KVCache:
    """The slot cache every CachedAttention of a model shares, and what the engine's forward in flight tells them:
    the rows' slots [B], the positions their tokens take [B, L] and the attention mask [B, 1, L, S]."""

    def __init__(self, layers: int, slots: int, length: int):
        self.shape = (slots, length)
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.active = False
        self.rows = self.positions = self.mask = None

    def layer(self, i: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[i] is None:  # in the forward's compute dtype; zeros: a masked NaN would still poison
            self.keys[i] = k.new_zeros((*self.shape, *k.shape[2:]))
            self.values[i] = k.new_zeros((*self.shape, *k.shape[2:]))
        return self.keys[i], self.values[i]

    def copy(self, source: int, target: int, length: int) -> None:
        for cache in self.keys + self.values:
            if cache is not None:
                cache[target, :length] = cache[source, :length]

    def release(self) -> None:
        self.keys, self.values = [None] * len(self.keys), [None] * len(self.values)


class CachedAttention(torch.nn.Module):
    """A layer's inner attention with the engine's KV cache; the layer's own (`inner`) outside engine forwards."""

    def __init__(self, inner: torch.nn.Module, kv: KVCache, layer: int):
        super().__init__()
        self.inner, self.kv, self.layer = inner, kv, layer

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        kv = self.kv
        if not kv.active:
            return self.inner(q, k, v, attention_masks=attention_masks, scale=scale, enable_gqa=enable_gqa, **kwargs)
        keys, values = kv.layer(self.layer, k)
        keys[kv.rows[:, None], kv.positions] = k.to(keys.dtype)
        values[kv.rows[:, None], kv.positions] = v.to(values.dtype)
        span = kv.mask.shape[-1]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys[kv.rows, :span].transpose(1, 2),
                                             values[kv.rows, :span].transpose(1, 2), attn_mask=kv.mask,
                                             scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def wrap(attentions: list[torch.nn.Module], kv: KVCache) -> None:
    """Each layer's inner attention wrapped with the cache (an earlier engine's wrapper replaced)."""
    for i, attention in enumerate(attentions):
        inner = attention.inner_attention
        attention.inner_attention = CachedAttention(inner.inner if isinstance(inner, CachedAttention) else inner,
                                                    kv, i)
