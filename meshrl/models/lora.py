"""LoRA: a low-rank adapter trained on a frozen base, as torchtitan builds it, and the adapter's files
in the PEFT layout that vLLM and `peft` load.

The trainer converts its family's torchtitan config with torchtitan's `LoRAConverter` (each targeted
linear layer becomes a frozen base plus trainable `lora_a` [rank, in] and `lora_b` [out, rank], its
output scaled by alpha / rank); every other parameter is frozen. `lora_b` starts at zero, so the
policy at step 0 is the base exactly. Targets are named as HF (and PEFT) name the modules; each
family says which torchtitan module each name is (`Family.lora_modules`).

What the generators load is the adapter alone: PEFT's names (`base_model.model.<HF module>.lora_A
.weight`) with the rows of `lora_b` in HF's order (torchtitan keeps q and k rows in another order
within each head, which the family's state-dict adapter knows: the row order is read off it).
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the config is read by processes that never load it
    import torch

PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
# the sizes vLLM sizes its LoRA buffers for (vllm.config.lora's max_lora_rank)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoraConfig:
    """A LoRA adapter instead of full fine-tuning (rank 0: full fine-tuning)."""

    rank: int = 0  # > 0: train a LoRA adapter of this rank on the frozen base; only the adapter is published to the generators
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # the modules adapted, by their HF names (comma-separated)
    serving: str = "auto"  # how generators serve it: adapter (vLLM's LoRA, loaded in place) | merged (into the base weights a replica holds, reloaded as full weights) | auto: merged on the CPU (vLLM's CPU LoRA kernels generate about 5 times slower), adapter on GPUs

    def check(self) -> None:
        if self.rank < 0 or self.rank > VLLM_RANKS[-1]:
            raise ValueError(f"trainer.lora.rank must be between 0 and {VLLM_RANKS[-1]} (vLLM's largest), not {self.rank}")
        if self.rank and self.alpha <= 0:
            raise ValueError(f"trainer.lora.alpha must be above 0, not {self.alpha}")
        if self.rank and not self.names():
            raise ValueError("trainer.lora.targets names no module")
        if self.serving not in ("auto", "adapter", "merged"):
            raise ValueError(f"unknown trainer.lora.serving {self.serving!r}; known: auto, adapter, merged")

    def names(self) -> list[str]:
        return [name.strip() for name in self.targets.split(",") if name.strip()]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def convert(titan_config, family, lora: LoraConfig):
    """The family's torchtitan config with the targets made LoRA layers and everything else frozen;
    ValueError for a target the family does not have or a rank above a target's smaller side."""
    from torchtitan.components.lora import LoRAConverter
    from torchtitan.models.common import Linear
    from torchtitan.protocols.module import Module

    modules = family.lora_modules
    if not modules:
        raise ValueError(f"trainer.lora: the {family.name} family (torchtitan's transformers backend) trains full "
                         "weights only")
    names = lora.names()
    unknown = [name for name in names if name not in modules]
    if unknown:
        raise ValueError(f"trainer.lora.targets: the {family.name} family has no {', '.join(unknown)} "
                         f"(its modules: {', '.join(modules)})")
    titan = {modules[name] for name in names}
    for name in names:  # torchtitan builds k and v from one config: both are adapted, or neither
        partners = sorted(other for other in modules if modules[other] == modules[name] and other not in names)
        if partners:
            raise ValueError(f"trainer.lora.targets: {name} goes with {', '.join(partners)} in torchtitan's "
                             f"{family.name} model: name both or neither")
    found = set()
    for fqn, cfg, _, _ in titan_config.traverse(Module.Config, recurse=True):
        if isinstance(cfg, Linear.Config) and fqn.rsplit(".", 1)[-1] in titan:
            found.add(fqn.rsplit(".", 1)[-1])
            if lora.rank > min(cfg.in_features, cfg.out_features):
                raise ValueError(f"trainer.lora.rank {lora.rank} is larger than {fqn} ({cfg.out_features} x "
                                 f"{cfg.in_features}): a rank at most {min(cfg.in_features, cfg.out_features)}")
    if missing := [name for name in names if modules[name] not in found]:  # an MoE model's experts, say
        raise ValueError(f"trainer.lora.targets: this {family.name} model has no linear {', '.join(missing)}")
    converter = LoRAConverter(LoRAConverter.Config(rank=lora.rank, alpha=lora.alpha, target_modules=sorted(titan)))
    return converter.convert(titan_config)


@contextmanager
def adapter_off(model: torch.nn.Module):
    """The base alone while inside: each LoRA layer's scaling 0 (torchtitan's LoRALinear adds
    `_lora_scaling` x its adapter's output to the base's, which 0 leaves exactly as it is)."""
    layers = [m for m in model.modules() if hasattr(m, "_lora_scaling")]
    saved = [m._lora_scaling for m in layers]
    for m in layers:
        m._lora_scaling = 0.0
    try:
        yield
    finally:
        for m, scaling in zip(layers, saved):
            m._lora_scaling = scaling


def is_adapter(name: str) -> bool:
    return ".lora_a." in name or ".lora_b." in name


def base_of(name: str) -> str:
    """"layers.0.attention.wo.lora_a.weight" -> "layers.0.attention.wo.weight"."""
    return name.replace(".lora_a.", ".").replace(".lora_b.", ".")


def init_adapters(model: torch.nn.Module) -> None:
    """A as torch initialises a linear layer (Kaiming uniform), B zero: the adapted model is the base."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_a." in name:
                bound = 1 / math.sqrt(param.shape[1])  # kaiming_uniform_(a=sqrt(5)), as nn.Linear
                param.uniform_(-bound, bound)
            elif ".lora_b." in name:
                param.zero_()


class PeftNames:
    """torchtitan's adapter tensors -> PEFT's names, `lora_b`'s rows in HF order. Called with a dict, as a
    state-dict adapter's `to_hf` is (the weight readers take either)."""

    def __init__(self, adapter_names: list[str], base_shapes: dict[str, tuple], state_dict_adapter):
        import torch

        self.hf_name, self.rows = {}, {}
        for base in sorted({base_of(name) for name in adapter_names}):
            out, inp = base_shapes[base]
            # each row numbered: the adapter's to_hf says where each row goes, and under which HF name
            numbered = torch.arange(out, dtype=torch.float32)[:, None].expand(out, inp).contiguous()
            [(hf, moved)] = state_dict_adapter.to_hf({base: numbered}).items()
            self.hf_name[base] = PEFT_PREFIX + hf.removesuffix(".weight")
            order = moved[:, 0].long()
            self.rows[base] = None if torch.equal(order, torch.arange(out)) else order

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in tensors.items():
            base = base_of(name)
            if ".lora_a." in name:
                out[f"{self.hf_name[base]}.lora_A.weight"] = tensor
            else:
                rows = self.rows[base]
                out[f"{self.hf_name[base]}.lora_B.weight"] = tensor if rows is None else tensor[rows]
        return out

    def target_modules(self) -> list[str]:
        return sorted({name.rsplit(".", 1)[-1] for name in self.hf_name.values()})


def adapter_config(lora: LoraConfig, target_modules: list[str], base: str) -> dict:
    """adapter_config.json as PEFT writes it for a causal LM."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": 0.0, "target_modules": target_modules, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None, "inference_mode": True}


def save_adapter(peft_tensors: dict[str, torch.Tensor], config: dict, out: Path, dtype=None) -> None:
    """The adapter directory: adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    # copies: a ring's tensors are views of one buffer, which safetensors refuses to write as they are
    tensors = {k: v.detach().to("cpu", dtype or v.dtype).clone() for k, v in peft_tensors.items()}
    save_file(tensors, out / ADAPTER_FILE, metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def merged(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scaling: float,
           dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF weights with each adapted matrix W + scaling * B A (computed in fp32, stored in `dtype`, by default
    W's)."""
    out = dict(base)
    for name, a in adapter.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = adapter[f"{PEFT_PREFIX}{module}.lora_B.weight"]
        w = base[f"{module}.weight"]
        out[f"{module}.weight"] = (w.float() + scaling * (b.float() @ a.float())).to(dtype or w.dtype)
    return out
