"""Model families (meshrl/models/families.py): the torchtitan model a checkpoint's config.json picks, checked
against Hugging Face transformers' own model of the same weights, in process and in milliseconds to
seconds. What vLLM makes of the same weights is in test_actors.py."""

import json
import shutil

import pytest
import torch

from meshrl.models.families import FAMILIES, family_of, tiny_sources
from meshrl.models.model import ModelError, load_hf_weights, load_policy, read_hf_config, resolve_checkpoint
from meshrl.weight_sync import published_weights

# max |logit difference| against transformers in fp32, measured on these tiny models (2026-11-23): Llama
# 1.2e-6, Qwen3 0, Qwen3-MoE 1.2e-3 (the router's top-k and the grouped expert matmuls sum in another order)
LOGIT_TOLERANCE = {"llama": 1e-4, "qwen3": 1e-4, "qwen3_moe": 5e-3}


def hf_logits(checkpoint, ids):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def titan_logits(checkpoint, ids):
    model, _ = load_policy(checkpoint)
    model._skip_lm_head = False
    with torch.no_grad():
        return model.eval()(ids).float()


@pytest.mark.parametrize("source", sorted(tiny_sources()))
def test_each_family_computes_what_transformers_computes_from_the_same_checkpoint(source):
    checkpoint = resolve_checkpoint(source)
    family = family_of(read_hf_config(checkpoint))
    assert tiny_sources()[source] is family
    ids = torch.randint(0, read_hf_config(checkpoint)["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    ours, theirs = titan_logits(checkpoint, ids), hf_logits(checkpoint, ids)
    assert theirs.std() > 0.5  # the stand-in's next-token distributions are peaked enough to tell models apart
    assert (ours - theirs).abs().max() < LOGIT_TOLERANCE[family.name]


@pytest.mark.parametrize("source", sorted(tiny_sources()))
def test_the_published_layout_maps_onto_exactly_the_checkpoints_tensors(source):
    """What the trainer publishes (torchtitan names), through the family's adapter, is every tensor of
    the HF checkpoint under its own name and shape: the names vLLM loads."""
    checkpoint = resolve_checkpoint(source)
    layout, to_hf = published_weights(checkpoint, "float32")
    zeros = {spec.name: torch.zeros(spec.shape) for spec in layout.specs}
    hf = to_hf(zeros)
    saved = load_hf_weights(checkpoint)
    assert {k: tuple(v.shape) for k, v in hf.items()} == {k: tuple(v.shape) for k, v in saved.items()}


def test_a_llama_checkpoint_saved_by_transformers_loads_by_its_path(llama_checkpoint):
    assert resolve_checkpoint(str(llama_checkpoint)) == llama_checkpoint
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(1))
    assert (titan_logits(llama_checkpoint, ids) - hf_logits(llama_checkpoint, ids)).abs().max() < 1e-4


def test_a_qwen2_checkpoint_trains_through_the_transformers_backend(qwen2_checkpoint):
    """No native family: torchtitan's transformers backend, corrected to compute what transformers does
    (biased q/k/v projections, tied head, positions of the batch's own length)."""
    from meshrl.models.families import TRANSFORMERS

    assert family_of(read_hf_config(qwen2_checkpoint)) is TRANSFORMERS
    for length in (12, 17):
        ids = torch.randint(0, 49152, (2, length), generator=torch.Generator().manual_seed(length))
        assert (titan_logits(qwen2_checkpoint, ids) - hf_logits(qwen2_checkpoint, ids)).abs().max() < 1e-4
    layout, to_hf = published_weights(qwen2_checkpoint, "float32")
    hf = to_hf({spec.name: torch.zeros(spec.shape) for spec in layout.specs})
    assert {k: tuple(v.shape) for k, v in hf.items()} == {k: tuple(v.shape) for k, v in
                                                          load_hf_weights(qwen2_checkpoint).items()}
    assert "lm_head.weight" not in hf  # tied: published once, as the embedding


def test_an_unsupported_architecture_is_one_line_naming_what_is_supported(tmp_path):
    tiny = resolve_checkpoint("tiny")
    shutil.copytree(tiny, tmp_path / "own")
    config = read_hf_config(tiny) | {"architectures": ["MyOwnModelForCausalLM"]}
    (tmp_path / "own" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"unsupported model architecture 'MyOwnModelForCausalLM' \(MyOwnModelForCausalLM is "
                                         r"not a causal LM transformers knows\): meshrl trains "
                                         + ", ".join(sorted(FAMILIES)) + " natively") as e:
        resolve_checkpoint(str(tmp_path / "own"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("setting, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "unsupported RoPE scaling"),
    ({"attention_bias": True}, "unsupported model setting attention_bias=True"),
    ({"hidden_act": "gelu"}, "unsupported activation 'gelu'"),
    ({"architectures": ["Gemma2ForCausalLM"], "final_logit_softcapping": 30.0}, "soft-caps its logits"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8}, "is a mixture of experts"),
])
def test_settings_the_model_would_compute_differently_are_refused(setting, message):
    hf = read_hf_config(resolve_checkpoint("tiny_qwen3")) | setting
    with pytest.raises(ValueError, match=message):
        family_of(hf).titan_config(hf)  # the backend's refusals come from family_of itself


def test_moe_layers_follow_the_checkpoints_sparse_step_and_dense_layers():
    hf = read_hf_config(resolve_checkpoint("tiny_qwen3_moe")) | {"num_hidden_layers": 4, "decoder_sparse_step": 2,
                                                                 "mlp_only_layers": [3], "intermediate_size": 96}
    layers = family_of(hf).titan_config(hf).layers
    assert [layer.moe is not None for layer in layers] == [False, True, False, False]
    assert layers[0].feed_forward.w1.out_features == 96 and layers[1].moe.num_experts == 4


def test_only_the_registry_knows_the_families():
    """Code that builds or names a family's model lives in families.py (and the transformers backend's
    hf_backend.py): everything else asks `family_of`."""
    import re
    from pathlib import Path

    import meshrl

    family_code = re.compile(r"torchtitan\.models\.(llama3|qwen3)|transformers_modeling_backend|"
                             r"(Llama|Qwen3)(Model|StateDictAdapter|TransformerBlock)")
    root = Path(meshrl.__file__).parent
    naming = {str(p.relative_to(root)) for p in root.rglob("*.py") if family_code.search(p.read_text())}
    assert naming == {"models/families.py", "models/hf_backend.py"}


def test_a_chat_template_kept_in_tokenizer_config_is_used_as_the_file_would_be(tmp_path):
    """Published checkpoints (Qwen3's among them) keep the template in tokenizer_config.json."""
    from meshrl.models.model import ChatTokenizer

    tiny = resolve_checkpoint("tiny")
    shutil.copytree(tiny, tmp_path / "ckpt", ignore=shutil.ignore_patterns("chat_template.jinja"))
    template = (tiny / "chat_template.jinja").read_text()
    config = json.loads((tiny / "tokenizer_config.json").read_text()) | {"chat_template": template}
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTokenizer(tmp_path / "ckpt").encode_chat("What is 1 + 2?") == ChatTokenizer(tiny).encode_chat("What is 1 + 2?")
    config["chat_template"] = "{{ raise_exception('no system message allowed') }}"
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="the chat template refused the conversation: no system message allowed"):
        ChatTokenizer(tmp_path / "ckpt").encode_chat("hi")
