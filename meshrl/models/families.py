"""Model families: which torchtitan model trains a checkpoint, chosen by the checkpoint's own config.json.

One entry per Hugging Face architecture (`architectures[0]` in config.json): how to turn that config
into torchtitan's model config, the state-dict adapter between torchtitan's names and HF's (the names
vLLM loads), and the tiny random stand-in the tests train (`model.source tiny_<family>`). This is the
only module that names a family: everything else asks `family_of(hf_config)`.

Every native family is a torchtitan decoder (built with torchtitan's public config builders) and takes
the same FSDP2 plan (`apply_fsdp_to_decoder`, which covers dense and MoE blocks alike). Any other dense
causal LM that transformers knows trains through torchtitan's transformers backend (meshrl/models/hf_backend.py).

Attention is torchtitan's causal SDPA, not FlexAttention (its default), which has no CPU backward:
exact for the right-padded, unpacked sequences the trainer batches.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn

from meshrl.models import hf_backend


class UnsupportedModel(ValueError):
    pass


_NORMAL = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
_ONES = {"weight": nn.init.ones_}
# Embedding and LM head (tied or not) wider than the blocks, so that a random stand-in's next-token
# distribution is peaked, as a trained model's is: tests that compare two engines' logprobs then tell.
_WIDE = {"weight": partial(nn.init.normal_, std=0.05)}


def shard_decoder(model: nn.Module, mesh, param_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 as torchtitan applies it to a decoder (dense or MoE): parameters all-gathered in
    `param_dtype` (FSDP2's MixedPrecisionPolicy; the shards, the master weights, keep their own dtype),
    gradients reduced in float32."""
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    apply_fsdp_to_decoder(model, mesh, param_dtype, torch.float32, pp_enabled=False)


@torch.no_grad()
def _init_buffers(model: nn.Module, device) -> None:
    model.init_states(buffer_device=device)  # the weights too, which a load then overwrites


@dataclass(frozen=True)
class Family:
    name: str  # the tiny stand-in is `tiny_<name>` ("tiny" for llama)
    architecture: str  # HF's class name in config.json
    titan_config: Callable[[dict], object]  # HF config -> torchtitan model config
    adapter: Callable[[object], object]  # torchtitan model config -> state-dict adapter (to_hf / from_hf)
    tiny: Callable[[dict], dict] | None  # SmolLM2's HF config -> the tiny stand-in's HF config
    shard: Callable[..., None] = shard_decoder  # FSDP2 over a device mesh: (model, mesh, all-gather dtype)
    build: Callable[[object], nn.Module] = lambda config: config.build()  # the model of a torchtitan config
    init_buffers: Callable[[nn.Module, object], None] = _init_buffers  # after `to_empty` on a device
    lora_modules: dict[str, str] | None = None  # LoRA targets: HF's module name -> torchtitan's (None: no LoRA)
    tool_parser: str = "hermes"  # vLLM's tool-call parser for the family's chat format (`model.tool_parser` auto): Hermes-style <tool_call> JSON, as Qwen3's template writes it and meshrl's hermes template gives SmolLM2


def family_of(hf_config: dict) -> Family:
    """The family of a checkpoint, by the architecture its config.json names: a native torchtitan
    model, else torchtitan's transformers backend (meshrl/models/hf_backend.py) where that computes it right."""
    names = hf_config.get("architectures") or ["(none)"]
    if names[0] in FAMILIES:
        return FAMILIES[names[0]]
    if (why := hf_backend.unsupported(hf_config)) is None:
        return TRANSFORMERS
    raise UnsupportedModel(f"unsupported model architecture {names[0]!r} ({why}): meshrl trains "
                           f"{', '.join(sorted(FAMILIES))} natively and other dense causal LMs of transformers "
                           "through torchtitan's transformers backend")


def tiny_sources() -> dict[str, Family]:
    """`model.source` names of the tiny random stand-ins, one per native family."""
    return {("tiny" if f.name == "llama" else f"tiny_{f.name}"): f for f in FAMILIES.values()}


# -- what every family reads from an HF config


def _rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise UnsupportedModel(f"unsupported RoPE scaling {rope!r} (only unscaled RoPE)")
    return float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0)


def _eps(hf: dict) -> float:
    return hf.get("rms_norm_eps", 1e-6)


def _check_plain(hf: dict) -> None:
    """Refuse what the torchtitan blocks here would silently compute differently."""
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if hf.get(key):
            raise UnsupportedModel(f"unsupported model setting {key}={hf[key]!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"unsupported activation {hf['hidden_act']!r} (only silu)")


def _decoder(config_cls, hf: dict, layers: list):
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    dim, vocab = hf["hidden_size"], hf["vocab_size"]
    return config_cls(
        dim=dim, vocab_size=vocab, enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_WIDE),
        norm=RMSNorm.Config(normalized_shape=dim, eps=_eps(hf), param_init=_ONES),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_WIDE),
        layers=layers)


def _attention(hf: dict, rope, qk_norm_eps: float | None):
    from torchtitan.models.common import RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_gqa_config

    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // n_heads
    qk_norm = None if qk_norm_eps is None else RMSNorm.Config(normalized_shape=head_dim, eps=qk_norm_eps,
                                                              param_init=_ONES)
    return make_gqa_config(
        dim=dim, n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads, head_dim=head_dim,
        wqkv_param_init=_NORMAL, wo_param_init=_NORMAL, inner_attention=ScaledDotProductAttention.Config(),
        rope=rope(dim=head_dim, max_seq_len=hf.get("max_position_embeddings", 4096), theta=_rope_theta(hf)),
        fuse_qkv=False,  # HF keeps q, k and v apart: one published tensor per HF tensor
        qk_norm=qk_norm)


def _ffn(hf: dict, hidden_dim: int):
    from torchtitan.models.common.config_utils import make_ffn_config

    return make_ffn_config(dim=hf["hidden_size"], hidden_dim=hidden_dim, w1_param_init=_NORMAL,
                           w2w3_param_init=_NORMAL)


def _norms(hf: dict) -> dict:
    from torchtitan.models.common import RMSNorm

    return {k: RMSNorm.Config(normalized_shape=hf["hidden_size"], eps=_eps(hf), param_init=_ONES)
            for k in ("attention_norm", "ffn_norm")}


# -- Llama (SmolLM2, Llama 3)


def _llama(hf: dict):
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    _check_plain(hf)
    layers = [Llama3TransformerBlock.Config(**_norms(hf), attention=_attention(hf, ComplexRoPE.Config, None),
                                            feed_forward=_ffn(hf, hf["intermediate_size"]))
              for _ in range(hf["num_hidden_layers"])]
    return _decoder(Llama3Model.Config, hf, layers)


def _llama_adapter(config):
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    return Llama3StateDictAdapter(config, None)


TINY = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "intermediate_size": 256}


def _tiny_llama(smollm2: dict) -> dict:
    return smollm2 | TINY


# -- Qwen3, dense and MoE


def _is_moe_layer(hf: dict, i: int) -> bool:
    """HF Qwen3-MoE's rule: every `decoder_sparse_step`-th layer is MoE, except `mlp_only_layers`."""
    step = hf.get("decoder_sparse_step") or 1
    return _num_experts(hf) > 0 and i not in (hf.get("mlp_only_layers") or []) and (i + 1) % step == 0


def _num_experts(hf: dict) -> int:
    return hf.get("num_experts") or hf.get("num_local_experts") or 0


def _moe(hf: dict):
    from torchtitan.models.common.config_utils import make_moe_config, make_routed_experts_config, make_router_config

    dim, experts, top_k = hf["hidden_size"], _num_experts(hf), hf["num_experts_per_tok"]
    return make_moe_config(
        num_experts=experts, load_balance_coeff=None,  # HF Qwen3-MoE routes without an expert bias
        router=make_router_config(dim=dim, num_experts=experts, gate_param_init=_NORMAL, top_k=top_k,
                                  score_func="softmax", route_norm=bool(hf.get("norm_topk_prob", False))),
        routed_experts=make_routed_experts_config(
            dim=dim, hidden_dim=hf["moe_intermediate_size"], num_experts=experts, top_k=top_k,
            param_init={"w1_EFD": _NORMAL["weight"], "w2_EDF": _NORMAL["weight"], "w3_EFD": _NORMAL["weight"]},
            comm_backend="standard"))


def _qwen3(hf: dict):
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.qwen3 import Qwen3Model
    from torchtitan.models.qwen3.model import Qwen3TransformerBlock

    _check_plain(hf)
    layers = []
    for i in range(hf["num_hidden_layers"]):
        mlp = {"moe": _moe(hf)} if _is_moe_layer(hf, i) else {"feed_forward": _ffn(hf, hf["intermediate_size"])}
        layers.append(Qwen3TransformerBlock.Config(**_norms(hf), attention=_attention(hf, CosSinRoPE.Config, _eps(hf)),
                                                   **mlp))
    return _decoder(Qwen3Model.Config, hf, layers)


def _qwen3_adapter(config):
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(config, None)


def _tiny_qwen3(smollm2: dict, moe: bool = False) -> dict:
    """A Qwen3 config of the tiny shape over SmolLM2's vocabulary, completed by transformers' defaults."""
    import transformers

    ids = {k: smollm2[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id") if k in smollm2}
    shape = TINY | {"max_position_embeddings": 8192, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
    if moe:
        config = transformers.Qwen3MoeConfig(**ids, **shape, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=64, norm_topk_prob=True)
    else:
        config = transformers.Qwen3Config(**ids, **shape)
    hf = config.to_dict()
    hf["architectures"] = ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
    return hf


# torchtitan's decoders build k and v from one config (`wkv`): LoRA adapts both or neither
DECODER_LORA = {"q_proj": "wq", "k_proj": "wkv", "v_proj": "wkv", "o_proj": "wo", "gate_proj": "w1", "up_proj": "w3",
                "down_proj": "w2"}
FAMILIES = {f.architecture: f for f in (
    Family("llama", "LlamaForCausalLM", _llama, _llama_adapter, _tiny_llama, lora_modules=DECODER_LORA),
    Family("qwen3", "Qwen3ForCausalLM", _qwen3, _qwen3_adapter, _tiny_qwen3, lora_modules=DECODER_LORA),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3, _qwen3_adapter, partial(_tiny_qwen3, moe=True),
           lora_modules=DECODER_LORA),
)}
TRANSFORMERS = Family("transformers", "(any other)", hf_backend.titan_config, hf_backend.adapter, None,
                      hf_backend.shard, hf_backend.build, hf_backend.init_buffers)
