"""Tasks: where prompts and rewards come from. A task maps a training index to a Sample, holds two fixed
held-out splits (validation, evaluated during training and used to choose settings; test, reported once
they are chosen: `meshrl eval RUN_DIR --split test`) disjoint from training and from each other
(meshrl/tasks/splits.py), and scores a reply with named checks. An environment is a multi-turn task: it answers the
model's turns (a tool's result, say) until the conversation ends, then scores the whole conversation; in the
stateless form (`Environment`) it is given the whole conversation each time, in the session form
(`SessionEnvironment`, as OpenEnv's environments are) it keeps each conversation's state itself. Chosen by name (`--task sum_digits`, `--task
dataset`, `--task reasoning_gym`, `--task openenv`) or by `module:Class` (`--task mypkg.tasks:MyTask`), so a task in a user's own package needs
no edit here; built-in tasks have a config section of their own (`--sum_digits.num_terms 3`), a
`module:Class` task is built from its `Config` dataclass with `--task_args '{"size": 100}'`.
"""

import dataclasses
import json
from typing import Protocol

from meshrl.plugins import load_object
from meshrl.types import Sample  # a task's samples; `from meshrl.tasks import Sample` in a task of one's own


class Task(Protocol):
    """A single-turn task. `accuracy` names the reward check that says a reply is right: it is
    reported as `accuracy` (and `eval_accuracy`); every other check under its own name."""

    accuracy: str

    def train_sample(self, index: int) -> Sample:
        """The training sample at `index` (0, 1, ...): the same index gives the same sample."""

    def eval_samples(self, split: str = "validation") -> list[Sample]:
        """The fixed held-out split `split` ("validation" or "test"): no prompt of it is a training prompt or
        one of the other split's."""

    def reward(self, text: str, answer: str) -> tuple[float, dict[str, float]]:
        """The reward of a reply and the checks it is made of (`accuracy` among them). Raising counts the
        reply as a reward error: it is left out of training and counted."""

    # Optional: `prompt_checks(sample, text) -> dict[str, float]`: checks that need the question itself, reported
    # beside reward's (not rewarded), as sum_digits' `copied` (its tagged answer is a number of the question).
    # Optional: `keep_only(fits, why)`, called once before the first sample, drops the samples whose
    # prompt does not `fits` (too long for the generator; `why` says so) and says which, as the dataset
    # task does. A task without it has its too-long prompts fail their groups one by one.


class Environment(Protocol):
    """A multi-turn task. The controller opens the conversation with `opening`, lets the model take a turn
    (which ends at the model's end of turn or at one of the `stop` strings, kept), and asks `step` for the
    environment's answer, until `step` ends it or the model has taken `controller.max_turns` turns; then
    `conversation_reward` scores the whole conversation (a single-turn Task's `reward` scores one reply against
    the answer). Only the model's tokens are trained."""

    accuracy: str
    stop: list[str]  # strings that end a model turn, e.g. the end of a tool call

    def train_sample(self, index: int) -> Sample: ...

    def eval_samples(self, split: str = "validation") -> list[Sample]: ...

    def opening(self, sample: Sample) -> list[dict]:
        """The messages that open the conversation ({"role": ..., "content": ...}; the chat template is
        applied by the controller)."""

    def step(self, sample: Sample, messages: list[dict]) -> list[dict] | None:
        """The messages that answer the model's turn (the last of `messages`), or None: the conversation
        is over."""

    def conversation_reward(self, sample: Sample, messages: list[dict]) -> tuple[float, dict[str, float]]:
        """The conversation's reward and the checks it is made of (`accuracy` among them)."""


class SessionEnvironment(Protocol):
    """A multi-turn task in the session form: stateful, as OpenEnv's environments are (meshrl/tasks/openenv.py).
    Each conversation is a session, opened with an id the controller makes, stepped with the model's latest turn
    only, and closed; its state lives in the grader replica that opened it, so a group's conversations stay on
    that replica (a replica that dies takes them along: the group is generated again). `step` and `finish` are
    called for open sessions only; `close` on every path (done, truncated, stopped, failed), for any id, twice
    included. The conversation's reward is `finish`'s, once the environment says done, the model has taken
    `controller.max_turns` turns, or the next turn would not fit the context."""

    accuracy: str
    stop: list[str]

    def train_sample(self, index: int) -> Sample: ...

    def eval_samples(self, split: str = "validation") -> list[Sample]: ...

    async def open(self, session: str, sample: Sample) -> list[dict]:
        """Start session `session` for `sample` (an environment's reset): the messages that open it. The
        conversations of one group open alike (the same sample, the same seed). A task that offers tools to the
        model also has `async def tools(session) -> list[dict] | None`: the session's tools (OpenAI-style function
        schemas), rendered by the chat template in every turn (OpenEnv's MCP environments)."""

    async def step(self, session: str, reply: str) -> tuple[list[dict] | None, dict]:
        """The session's answer to the model's turn `reply`: (the next messages, or None when the episode is
        done; what the step said, kept for `finish`)."""

    async def finish(self, session: str) -> tuple[float, dict[str, float], dict]:
        """The ended conversation's reward, its checks (`accuracy` among them) and its metadata (JSON, kept in
        rollouts.jsonl)."""

    async def close(self, session: str) -> None:
        """Free the session (its environment, its connection); an id not open is ignored."""


def is_environment(task) -> bool:
    """A multi-turn task, of either form."""
    return callable(getattr(task, "step", None))


def is_session(task) -> bool:
    """A multi-turn task in the session form (SessionEnvironment)."""
    return callable(getattr(task, "open", None)) and callable(getattr(task, "finish", None))


BUILT_IN = {"sum_digits": "meshrl.tasks.sum_digits:SumDigits", "dataset": "meshrl.tasks.dataset:DatasetTask",
            "zorplex": "meshrl.tasks.zorplex:Zorplex", "reasoning_gym": "meshrl.tasks.reasoning_gym:ReasoningGym",
            "openenv": "meshrl.tasks.openenv:OpenEnvTask"}


def task_class(name: str) -> type:
    """A built-in task's class, or the class `module:Class` names."""
    target = BUILT_IN.get(name, name)
    if ":" not in target:
        raise ValueError(f"unknown task {name!r}; built in: {', '.join(sorted(BUILT_IN))}, or module:Class")

    return load_object(target, "task")


def task_config(config):
    """The settings of the run's task: a built-in task's own config section, or a `module:Class`
    task's `Config` dataclass (if it has one) built from `task_args` (JSON)."""
    if config.task in BUILT_IN:
        return getattr(config, config.task)
    cls = task_class(config.task)
    try:
        args = json.loads(config.task_args) if config.task_args else {}
    except ValueError as e:
        raise ValueError(f"task_args {config.task_args!r} is not JSON ({e})") from None
    if not hasattr(cls, "Config"):
        if args:
            raise ValueError(f"task {config.task} takes no task_args (it has no Config dataclass)")
        return None
    try:
        return cls.Config(**args)
    except TypeError as e:
        fields = ", ".join(f.name for f in dataclasses.fields(cls.Config))
        raise ValueError(f"task_args for {config.task}: {e} (its fields: {fields})") from None


def make_task(name: str, config) -> Task:
    cls = task_class(name)
    task = cls(config) if config is not None else cls()
    if not isinstance(getattr(task, "accuracy", None), str):
        raise ValueError(f"task {name} has no `accuracy`: the name of its reward check that says a reply is right")
    if is_environment(task) and not is_session(task) and not callable(getattr(task, "conversation_reward", None)):
        raise ValueError(f"environment {name} has no `conversation_reward(sample, messages)`, which scores a whole "
                         "conversation (an environment's `reward` is called `conversation_reward` since 2026-11-27)")
    return task
