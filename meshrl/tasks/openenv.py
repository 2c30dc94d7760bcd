"""OpenEnv environments, unchanged, as meshrl tasks (`--task openenv`): an `openenv` Environment class built in
each grader's process (`--openenv.env module:Class`, one instance a conversation, as openenv's own server does) or
a served one (`--openenv.url ws://HOST:PORT`, one WebSocket session a conversation through openenv's
GenericEnvClient). Each conversation is a session (meshrl/tasks/__init__.py's SessionEnvironment): reset with its
sample's seed, stepped with an action parsed from the model's reply, its observation rendered as the next user (or
tool) turn, ended when the environment says done; its reward is the sum of its steps' rewards (or the last).

An OpenEnv environment has no dataset: a sample is a reset seed. Train prompt i resets with seed i; the held-out
splits take seeds from ranges of their own (SEEDS), so no validation or test episode is a training one as far as
the environment's episodes follow their seed.

An MCP environment (`openenv.action tool_call`) offers its tools (its ListToolsAction answer, as OpenAI-style function
schemas) to the model through the chat template, and the model's calls are read by vLLM's tool parser of the model's
format (meshrl/tasks/tool_calls.py), named at launch (`OpenEnvConfig.launched`: model.tool_parser and the checkpoint).

openenv is not in requirements.lock (its declared dependencies conflict with vLLM's: requirements-openenv.txt says
why and installs it); it is imported only when a session opens.
"""

import dataclasses
import importlib.util
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

from meshrl.tasks import Sample
from meshrl.plugins import load_object
from meshrl.tasks.splits import SPLITS, check_split

# Reset seeds of each split: train prompt i -> SEEDS["train"] + i, held-out prompt i -> its split's base + i.
SEEDS = {"train": 0, "validation": 1_000_000_000, "test": 2_000_000_000}
SPAN = 1_000_000_000  # seeds a split may use
ACTIONS = ("text", "json", "tool_call")


@dataclass
class OpenEnvConfig:
    """An OpenEnv environment (openenv 0.10.0; `pip install --no-deps -r requirements-openenv.txt`), as sessions."""

    env: str = ""  # module:Class of an openenv Environment, built in each grader's process, one instance a conversation
    url: str = ""  # ws://HOST:PORT of a served environment (openenv's create_app): one WebSocket session a conversation
    action: str = "text"  # text: the reply whole in the action's `text_field` | json: the reply's JSON object is the action | tool_call: an MCP environment's tools offered through the chat template (model.chat_template must render tools: hermes for SmolLM2), the reply's last call in the model's format (read by vLLM's model.tool_parser) sent as a CallToolAction
    text_field: str = "message"  # the action's field that takes the reply (action text)
    observation_field: str = ""  # the observation's field rendered as the next turn; "": its only field's text, or all its fields (not done, reward, metadata) as JSON
    role: str = "user"  # the chat role of a rendered observation (user | tool)
    system: str = ""  # a system message that opens every conversation; "": none
    stop: str = ""  # strings that end a model turn (kept), as a JSON list, e.g. '["]"]'; "": the model's end of turn only
    reward: str = "sum"  # sum: the episode's reward is the sum of its steps' rewards | last: the last step's
    accuracy: str = "success"  # the check reported as accuracy: success (reward >= success_at) or a number in the last observation's metadata
    success_at: float = 1.0  # the episode reward from which `success` is 1
    eval_size: int = 64  # episodes (seeds) in each held-out split
    max_sessions: int = 0  # sessions open at once across the run (a served environment's max_concurrent_envs); a group waits for room for all of its own; 0: no bound

    def check(self) -> None:
        if bool(self.env) == bool(self.url):
            raise ValueError("openenv: give one of openenv.env (module:Class) or openenv.url (ws://HOST:PORT)")
        if self.env and ":" not in self.env:
            raise ValueError(f"openenv.env {self.env!r} is not module:Class")
        if self.url and not self.url.startswith(("ws://", "wss://", "http://", "https://")):
            raise ValueError(f"openenv.url {self.url!r} is not ws://HOST:PORT")
        if self.action not in ACTIONS:
            raise ValueError(f"openenv.action must be one of {', '.join(ACTIONS)}, not {self.action!r}")
        if self.reward not in ("sum", "last"):
            raise ValueError(f"openenv.reward must be sum or last, not {self.reward!r}")
        stop_strings(self.stop)
        if self.max_sessions < 0:
            raise ValueError(f"openenv.max_sessions must be 0 (no bound) or more, not {self.max_sessions}")

    def launched(self, tool_parser: str, checkpoint: Path | str) -> "LaunchedOpenEnv":
        """These settings with what the launch resolves from the model's (run.py, for the graders): the vLLM tool
        parser `model.tool_parser` names (auto: the model family's) and the checkpoint whose tokenizer it reads."""
        from meshrl.models.model import read_hf_config
        from meshrl.tasks.tool_calls import parser_name

        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(OpenEnvConfig)}
        return LaunchedOpenEnv(**settings, tool_parser=parser_name(tool_parser, read_hf_config(Path(checkpoint))),
                               checkpoint=str(checkpoint))


@dataclass
class LaunchedOpenEnv(OpenEnvConfig):
    """OpenEnvConfig.launched's: not command-line settings, but the model's, resolved at launch."""

    tool_parser: str = ""  # vLLM's tool parser of the model's format (tool_call actions)
    checkpoint: str = ""  # the model's HF directory: the parser reads its tokenizer


def stop_strings(text: str) -> list[str]:
    if not text:
        return []
    try:
        stop = json.loads(text)
    except ValueError:
        stop = None
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"openenv.stop {text!r} is not a JSON list of strings, e.g. '[\"]\"]'")
    return stop


def parse_action(reply: str, how: str, text_field: str = "message", parser=None) -> dict | None:
    """The action (as openenv's wire format has it: a dict) that the model's reply names, or None if it names none.
    text: {text_field: reply}; json: the reply's last JSON object; tool_call: the last call `parser` (a
    meshrl.tasks.tool_calls.ToolCallParser) reads in the reply, as an MCP call_tool action (a malformed call is none)."""
    if how == "text":
        return {text_field: reply}
    if how == "json":
        return last_json_object(reply)
    _, calls = parser.parse(reply)
    if not calls:
        return None
    return {"type": "call_tool", "tool_name": calls[-1].name, "arguments": calls[-1].arguments}


def function_schemas(listed: dict) -> list[dict]:
    """An MCP environment's ListToolsObservation (openenv's wire format) as OpenAI-style function schemas, which chat
    templates render (`tools=`) and vLLM's tool parsers take."""
    if "tools" not in listed:
        raise ValueError(f"openenv.action tool_call: the environment answered ListToolsAction without tools "
                         f"({', '.join(listed) or 'nothing'}): is it an MCPEnvironment?")
    return [{"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                              "parameters": tool.get("input_schema") or {"type": "object",
                                                                                         "properties": {}}}}
            for tool in listed["tools"]]


def last_json_object(text: str) -> dict | None:
    """The last JSON object written in `text` (prose or a ``` fence around it allowed)."""
    decoder, found, at = json.JSONDecoder(), None, text.find("{")
    while at >= 0:
        try:
            found, end = decoder.raw_decode(text, at)  # an object, and the objects inside it skipped
        except ValueError:
            end = at + 1
        at = text.find("{", end)
    return found


def render(observation: dict, field_name: str = "") -> str:
    """An observation's fields (openenv's wire format: no done, no reward) as the text of the next turn; an MCP
    tool call's observation as its result's text (or its error)."""
    fields = {k: v for k, v in observation.items() if k != "metadata"}
    if not field_name and set(fields) == {"tool_name", "result", "error"}:  # CallToolObservation
        if fields["error"]:
            return f"error: {fields['error'].get('message', fields['error'])}"
        result = fields["result"]
        if isinstance(result, dict) and isinstance(result.get("content"), list):
            return "".join(part.get("text", "") for part in result["content"] if isinstance(part, dict))
        return result if isinstance(result, str) else json.dumps(result, sort_keys=True, default=str)
    if field_name:
        if field_name not in fields:
            raise KeyError(f"the observation has no field {field_name!r} (openenv.observation_field); "
                           f"its fields: {', '.join(fields)}")
        value = fields[field_name]
    else:
        value = next(iter(fields.values())) if len(fields) == 1 else fields
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def action_class(env_class: type, how: str) -> type:
    """The Action class an openenv Environment subclass is parameterised with (Environment[Action, ...]); for
    MCP tool calls, which openenv recognises whatever the class, openenv's Action if it names none."""
    for cls in env_class.__mro__:
        for base in getattr(cls, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type):
                return args[0]
    if how == "tool_call":
        from openenv.core.env_server.types import Action

        return Action
    raise ValueError(f"{env_class.__name__} names no Action class: subclass openenv's Environment[MyAction, ...]")


class LocalSession:
    """One conversation's environment instance in this process."""

    def __init__(self, env_class: type, actions: type):
        self.env, self.actions = env_class(), actions

    async def reset(self, seed: int) -> dict:
        from openenv.core.env_server.serialization import serialize_observation

        return serialize_observation(await self.env.reset_async(seed=seed))

    async def step(self, action: dict) -> dict:
        from openenv.core.env_server.serialization import deserialize_action, serialize_observation

        return serialize_observation(await self.env.step_async(deserialize_action(action, self.actions)))

    async def close(self) -> None:
        self.env.close()


class RemoteSession:
    """One conversation's WebSocket session on a served environment."""

    def __init__(self, url: str):
        from openenv.core.generic_client import GenericEnvClient

        self.client = GenericEnvClient(base_url=url)

    @staticmethod
    def _wire(result) -> dict:
        return {"observation": result.observation, "reward": result.reward, "done": result.done,
                "metadata": result.metadata}

    async def reset(self, seed: int) -> dict:
        return self._wire(await self.client.reset(seed=seed))

    async def step(self, action: dict) -> dict:
        return self._wire(await self.client.step(action))

    async def close(self) -> None:
        await self.client.close()


@dataclass
class Episode:
    session: LocalSession | RemoteSession
    rewards: list[float] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)  # the last observation's
    done: bool = False  # the environment said so
    invalid: bool = False  # a reply named no action: the episode ended there
    tools: list[dict] | None = None  # an MCP environment's tools offered to the model (tool_call actions)


class OpenEnvTask:
    """An OpenEnv environment as a SessionEnvironment (meshrl/tasks/__init__.py)."""

    def __init__(self, config: OpenEnvConfig):
        config.check()
        if importlib.util.find_spec("openenv") is None:
            raise ValueError("--task openenv needs the openenv package: .venv/bin/pip install --no-deps -r "
                             "requirements-openenv.txt")
        self.config = config
        self.accuracy = config.accuracy
        self.stop = stop_strings(config.stop)
        self.max_sessions = config.max_sessions  # the controller's bound on sessions open at once (0: none)
        self.offers_tools = config.action == "tool_call"  # the chat template must render tools (checked at launch)
        self.episodes: dict[str, Episode] = {}
        self._parsers: dict[str, object] = {}  # vLLM's tool parser, by the tools it was given (as JSON)
        self._env_class = self._actions = None

    def train_sample(self, index: int) -> Sample:
        return seed_sample("train", index)

    def eval_samples(self, split: str = "validation") -> list[Sample]:
        check_split(split)
        return [seed_sample(split, i) for i in range(self.config.eval_size)]

    def _session(self) -> LocalSession | RemoteSession:
        if self.config.url:
            return RemoteSession(self.config.url)
        if self._env_class is None:

            self._env_class = load_object(self.config.env, "openenv.env")
            self._actions = action_class(self._env_class, self.config.action)
        return LocalSession(self._env_class, self._actions)

    async def open(self, session: str, sample: Sample) -> list[dict]:
        episode = Episode(self._session())
        self.episodes[session] = episode
        try:
            first = await episode.session.reset(sample.info["seed"])
        except RuntimeError as e:
            if "CAPACITY_REACHED" in str(e):  # openenv's server refusing a session
                raise RuntimeError(f"{e}; set openenv.max_sessions to the server's capacity (max_concurrent_envs)") \
                    from None
            raise
        episode.metadata = first.get("metadata") or {}
        if self.offers_tools:
            episode.tools = function_schemas((await episode.session.step({"type": "list_tools"}))["observation"])
        opening = [{"role": "system", "content": self.config.system}] if self.config.system else []
        return opening + [{"role": "user", "content": render(first["observation"], self.config.observation_field)}]

    async def tools(self, session: str) -> list[dict] | None:
        """The tools offered in this session (OpenAI-style function schemas; None: none), rendered by the chat template."""
        return self.episodes[session].tools

    def _parser(self, tools: list[dict] | None):
        """vLLM's parser of the model's tool calls (the launch names it: OpenEnvConfig.launched), one per tool set."""
        from meshrl.tasks.tool_calls import ToolCallParser

        if not getattr(self.config, "tool_parser", ""):
            raise ValueError("openenv.action tool_call reads calls with the model's tool parser: build the task from "
                             "OpenEnvConfig.launched(model.tool_parser, checkpoint), as a run's graders are")
        key = json.dumps(tools, sort_keys=True)
        if key not in self._parsers:
            self._parsers[key] = ToolCallParser(self.config.tool_parser, self.config.checkpoint, tools)
        return self._parsers[key]

    async def step(self, session: str, reply: str) -> tuple[list[dict] | None, dict]:
        episode = self.episodes[session]
        parser = self._parser(episode.tools) if self.config.action == "tool_call" else None
        action = parse_action(reply, self.config.action, self.config.text_field, parser)
        if action is None:
            episode.invalid = True
            return None, {"invalid_action": True}
        result = await episode.session.step(action)
        episode.rewards.append(float(result.get("reward") or 0.0))
        episode.metadata = result.get("metadata") or {}
        if result.get("done"):
            episode.done = True
            return None, {"reward": episode.rewards[-1], "done": True}
        return ([{"role": self.config.role, "content": render(result["observation"], self.config.observation_field)}],
                {"reward": episode.rewards[-1]})

    async def finish(self, session: str) -> tuple[float, dict[str, float], dict]:
        episode = self.episodes[session]
        rewards = episode.rewards
        reward = (sum(rewards) if self.config.reward == "sum" else rewards[-1]) if rewards else 0.0
        checks = {k: float(v) for k, v in episode.metadata.items() if isinstance(v, (int, float))}  # bools too
        checks = {"success": float(reward >= self.config.success_at), **checks, "done": float(episode.done),
                  "invalid_action": float(episode.invalid)}
        if self.accuracy not in checks and not episode.done:  # truncated, or no action: not right
            checks[self.accuracy] = 0.0
        if self.accuracy not in checks:
            raise KeyError(f"openenv.accuracy {self.accuracy!r} is neither success nor a number in the last "
                           f"observation's metadata (it has: {', '.join(episode.metadata) or 'nothing'})")
        metadata = json.loads(json.dumps({"rewards": rewards, "metadata": episode.metadata}, default=str))
        return reward, checks, metadata

    async def close(self, session: str) -> None:
        episode = self.episodes.pop(session, None)
        if episode is not None:
            await episode.session.close()


def seed_sample(split: str, index: int) -> Sample:
    """Prompt `index` of `split`: an episode reset with its split's seed (SEEDS)."""
    assert split in SPLITS
    if not 0 <= index < SPAN:
        raise ValueError(f"openenv: prompt index {index} is outside its split's {SPAN} seeds")
    seed = SEEDS[split] + index
    return Sample(f"reset(seed={seed})", "", {"seed": seed})
