"""The shapes of the published checkpoints the recipes name, for planning memory before the weights are here.

`meshrl train --plan-only` (meshrl/runtime/memory_plan.py) estimates each GPU's and host's memory from a
model's HF config alone, and a recipe such as `qwen3_30b_a3b_gsm8k_one_node` names a checkpoint directory
("Qwen3-30B-A3B") that the user downloads on the cluster: on a laptop, or on the machine that plans the run,
it is absent and cannot be downloaded (no network at run time). The table holds the fields the plan reads,
copied from each checkpoint's published config.json on the Hugging Face hub (Qwen/Qwen3-0.6B, Qwen/Qwen3-1.7B,
Qwen/Qwen3-4B, Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B); `hf_config` reads the directory's own config.json whenever
it is there. `meshrl check gpu`'s weights section moves versions of these shapes.
"""

from pathlib import Path

from meshrl.models.model import ModelError, read_hf_config, resolve_checkpoint
from meshrl.models.families import tiny_sources

_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "head_dim": 128,
          "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
          "torch_dtype": "bfloat16"}
PUBLISHED = {
    "Qwen3-0.6B": _QWEN3 | {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                            "num_key_value_heads": 8, "intermediate_size": 3072, "tie_word_embeddings": True},
    "Qwen3-1.7B": _QWEN3 | {"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
                            "num_key_value_heads": 8, "intermediate_size": 6144, "tie_word_embeddings": True},
    "Qwen3-4B": _QWEN3 | {"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                          "num_key_value_heads": 8, "intermediate_size": 9728, "tie_word_embeddings": True},
    "Qwen3-8B": _QWEN3 | {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                          "num_key_value_heads": 8, "intermediate_size": 12288, "tie_word_embeddings": False},
    "Qwen3-30B-A3B": _QWEN3 | {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
                               "num_attention_heads": 32, "num_key_value_heads": 4, "intermediate_size": 6144,
                               "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                               "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                               "tie_word_embeddings": False},
}


def hf_config(source: str) -> dict:
    """`model.source`'s HF config: the checkpoint directory's own config.json where it exists (the built-in
    sources' once prepared), else the published shape of the checkpoint its name names (its last path part,
    e.g. "/models/Qwen3-8B"); ModelError (one line) for neither."""
    path = Path(source)
    if (path / "config.json").is_file():
        return read_hf_config(path)
    if source == "smollm2" or source in tiny_sources():
        return read_hf_config(resolve_checkpoint(source))
    if path.name in PUBLISHED:
        return dict(PUBLISHED[path.name])
    raise ModelError(f"model {source!r}: no config.json there, and no published shape of that name to plan with "
                     f"({', '.join(PUBLISHED)})")
