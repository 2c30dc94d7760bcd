"""The models: torchtitan's model code for each supported family (`families`), any other Hugging Face
architecture through torchtitan's transformers backend (`hf_backend`), and checkpoints found,
converted and tokenized (`model`). The trainer and the generators build on it; it imports nothing
of the controller.

`ModelConfig` (the run's `model` section) is here, where every module of the package can read it without
loading torch."""

from dataclasses import dataclass


@dataclass
class ModelConfig:
    """The policy's starting checkpoint."""

    source: str = "smollm2"  # smollm2 (embedded SmolLM2-135M-Instruct) | tiny, tiny_qwen3, tiny_qwen3_moe (random, tests) | an HF checkpoint dir (Llama, Qwen3, Qwen3-MoE)
    chat_template: str = "auto"  # auto (the checkpoint's own) | hermes (meshrl's Hermes-style template with tools, for SmolLM2 and other ChatML models) | qwen3_training (Qwen3's, keeping every <think>: prefix-preserving) | a .jinja file
    tool_parser: str = "auto"  # vLLM's tool-call parser that reads the model's tool calls (hermes, qwen3_xml, llama3_json, ...); auto: the model family's (hermes)

