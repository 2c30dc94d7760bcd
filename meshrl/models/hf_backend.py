"""Any other dense Hugging Face causal LM (Qwen2.5, Mistral, Gemma...), trained through torchtitan's
transformers backend: transformers' own model class inside a torchtitan model, with torchtitan's
state-dict adapter (the HF names under a `model.` prefix). meshrl/models/families.py falls back to it for an
architecture it has no native torchtitan family for.

The backend as shipped does not compute what transformers computes on the CPU; four corrections,
each checked against transformers' forward on the same weights (tests/test_model_families.py):
- attention: SDPA with transformers' own causal mask (the backend's FlexAttention has no CPU backward,
  and with positions it builds a flex BlockMask that SDPA cannot take);
- positions: those of the batch's sequences (given none, the backend numbers `max_seq_len` of them);
- the checkpoint's own attention_bias, mlp_bias and max_position_embeddings (the backend overwrites
  them), and its config read from the checkpoint's config.json alone (no remote code);
- RoPE tables rebuilt after the model is materialised from the meta device (the backend's init looks
  for a `rope_init_fn` that transformers 5 no longer keeps).
Building the backend's model also replaces transformers' `PreTrainedModel._init_weights` for the whole
process (breaking a later `from_pretrained`): it is put back. Refused: MoE architectures, and final
logit soft-capping (Gemma 2), which the backend's forward leaves out.
"""

import json
import logging
import tempfile
import types
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

KEPT = ("attention_bias", "mlp_bias", "max_position_embeddings", "use_cache", "initializer_range")


def unsupported(hf: dict) -> str | None:
    """Why the backend cannot train this checkpoint here, or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = (hf.get("architectures") or [""])[0]
    if name not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return f"{name or 'no architecture'} is not a causal LM transformers knows"
    if hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts"):
        return f"{name} is a mixture of experts (only dense models train through the transformers backend)"
    if hf.get("final_logit_softcapping"):
        return f"{name} soft-caps its logits, which the transformers backend leaves out"
    return None


def titan_config(hf: dict):
    from torchtitan.experiments.transformers_modeling_backend import HFTransformerModel, TitanModelConfig

    config = HFTransformerModel.Config(model_config=TitanModelConfig())
    with tempfile.TemporaryDirectory() as where:  # the backend reads a config from a directory
        (Path(where) / "config.json").write_text(json.dumps(hf))
        job = types.SimpleNamespace(hf_model=where, parallelism=None, loss=types.SimpleNamespace(),
                                    training=types.SimpleNamespace(seq_len=hf.get("max_position_embeddings", 4096)),
                                    debug=types.SimpleNamespace(deterministic=False))
        config.update_from_config(config=job)
    config._attn_implementation = config.attn_implementation = "sdpa"
    for key in KEPT:
        if key in hf:
            setattr(config, key, hf[key])
    return config


def adapter(config):
    from torchtitan.experiments.transformers_modeling_backend import HFTransformerStateDictAdapter

    return HFTransformerStateDictAdapter(config, None)


def build(config) -> nn.Module:
    from transformers import PreTrainedModel

    patched = PreTrainedModel._init_weights, PreTrainedModel._initialize_weights
    quiet = logging.getLogger("torchtitan.config.configurable")  # warns of the HF config's dtype, harmlessly
    level, quiet.level = quiet.level, logging.ERROR
    try:
        model = config.build()
    finally:
        quiet.setLevel(level)
        PreTrainedModel._init_weights, PreTrainedModel._initialize_weights = patched
    model.forward = partial(_forward, model.forward)
    model.get_attention_masks = _hf_causal_mask
    return model


def _forward(forward, tokens: torch.Tensor, positions: torch.Tensor | None = None, attention_masks=None):
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    return forward(tokens, positions=positions, attention_masks=attention_masks)


def _hf_causal_mask(positions: torch.Tensor) -> None:
    return None  # no mask passed: transformers builds its causal one for SDPA


@torch.no_grad()
def init_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers after `to_empty` (the weights are loaded next): RoPE tables as transformers makes them."""
    model.init_states(buffer_device=device)
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            fresh = type(module)(module.config)
            for name, buffer in fresh.named_buffers():
                module.get_buffer(name).copy_(buffer.to(device))
            for key, value in vars(fresh).items():
                if key.endswith("attention_scaling"):
                    setattr(module, key, value)


def shard(model: nn.Module, mesh, param_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 per decoder layer, the embedding, final norm and LM head as one group (they may be tied),
    then the root; parameters all-gathered in `param_dtype`, gradients reduced in float32. (torchtitan's
    own plan for the backend asks gloo for a PREMUL_SUM it does not have.)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    settings = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                                                 cast_forward_inputs=False)}
    for layer in model.layers.values():
        fully_shard(layer, **settings)
    fully_shard([model.tok_embeddings, model.norm, model.lm_head], **settings)
    fully_shard(model, **settings)
