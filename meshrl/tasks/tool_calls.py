"""Tool calls read from a model's turn by the library that knows its format: vLLM's tool-call parsers.

A model offered tools through its chat template (`ChatTokenizer.encode_messages(..., tools=...)`) writes its calls
in that template's format: Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` for Qwen3 and for
SmolLM2 under meshrl's hermes template. vLLM registers a parser per format (`hermes`, `qwen3_xml`, `llama3_json`,
`mistral`, ... in `ToolParserManager`); an environment reads a turn through the one named by `model.tool_parser`
(auto: the model family's default) instead of a regex of its own. A call that does not parse is no call: the turn's
whole text is its content, as vLLM's server answers it (and so is a call whose arguments are no JSON object).
"""

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from meshrl.models.families import family_of


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)  # the call's JSON arguments, parsed
    id: str = ""  # the parser's id for it (OpenAI's tool_call_id)

    def openai(self) -> dict:
        """As an assistant message's `tool_calls` entry, which chat templates render."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parser_name(setting: str, hf_config: dict) -> str:
    """`model.tool_parser`: auto is the checkpoint family's default; any other value is a vLLM parser's name."""
    return family_of(hf_config).tool_parser if setting == "auto" else setting


class ToolCallParser:
    """vLLM's tool-call parser `name`, with the tokenizer of the model's checkpoint (some parsers read its vocabulary)
    and the `tools` offered (OpenAI-style schemas; some parsers check calls against them)."""

    def __init__(self, name: str, checkpoint: Path | str, tools: list[dict] | None = None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tokenizers import get_tokenizer
        from vllm.tool_parsers import ToolParserManager

        try:
            cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            known = ", ".join(sorted(ToolParserManager.list_registered()))
            raise ValueError(f"tool parser {name!r} unknown: vLLM has {known}") from None
        self.name = name
        self.request = ChatCompletionRequest(messages=[], model=str(checkpoint), tools=tools or None)
        self.parser = cls(get_tokenizer(str(checkpoint)), self.request.tools)
        self._logger = logging.getLogger(cls.__module__)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A model turn's text -> its content (the text before its first call, less the one newline a template puts
        between content and call; the whole text when there is no call) and its calls, in order."""
        with _quiet(self._logger):  # a malformed call is the model's mistake, not a traceback in the log
            found = self.parser.extract_tool_calls(text, self.request)
        if not found.tools_called:
            return text, []
        try:
            arguments = [json.loads(c.function.arguments or "{}") for c in found.tool_calls]
        except json.JSONDecodeError:
            return text, []
        if not all(isinstance(a, dict) for a in arguments):
            return text, []
        calls = [ToolCall(c.function.name, a, c.id or "") for c, a in zip(found.tool_calls, arguments)]
        return (found.content or "").removesuffix("\n"), calls


def assistant_message(text: str, parser: ToolCallParser) -> dict:
    """A model turn as a chat message: its content and, when it called tools, its `tool_calls`."""
    content, calls = parser.parse(text)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.openai() for call in calls]
    return message


@contextmanager
def _quiet(logger: logging.Logger):
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled
