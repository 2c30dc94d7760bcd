"""The grader: scores completions with the task's reward function, and hosts a multi-turn environment
(its answers to the model's turns, its reward at the end), so user code runs in an actor that is
replaced if it dies, not in the controller. The generator holding the completions it scores sends it
their text and finish reason (a `Reply`: no token), and it answers their rewards and checks there.

A session environment (meshrl/tasks/__init__.py's SessionEnvironment, e.g. OpenEnv's) keeps its conversations'
state here: `open_sessions`, `step_sessions` and `close_sessions` are called on the one replica that holds a
group's sessions; a session that ends (done, the last turn, a failure) is closed here, the rest by the
controller's `close_sessions` on whatever path the group ends.

User code that raises is never silent. A completion (or conversation) whose reward function or
environment raised is left out and counted (`reward_errors`); the first traceback of each kind of
error is logged, later ones of that kind are not. A call on which it raised for more than half of the
completions fails the group (`UserCodeFailed`, naming the function and its first error): the group
counts toward `controller.max_failed_fraction`, so code that raises on most replies stops the run at
its first batch, with that one line, instead of training on nothing. A group failed so says how many of
its replies raised (`failure`'s words, read back by `failed_counts`), so they count in the step's
`reward_errors` too; each replica keeps the first error it saw (`first_error`), for the controller's
warning when a step's share of errors passes `grader.warn_error_fraction`.
"""

import asyncio
import logging
import re
from dataclasses import dataclass, field

from monarch.actor import Actor, endpoint

from meshrl.actors.grader_config import GraderConfig
from meshrl.tasks import make_task
from meshrl.types import Reply, Sample

logger = logging.getLogger(__name__)


@dataclass
class EnvReply:
    """An environment's answer to one conversation's latest model turn."""

    messages: list[dict] | None = None  # the next messages: the conversation goes on
    reward: float = 0.0  # else it is over, with this reward
    checks: dict[str, float] = field(default_factory=dict)
    failed: bool = False  # the environment raised (logged): the conversation is left out and counted
    metadata: dict = field(default_factory=dict)  # a session's episode metadata (JSON), kept in rollouts.jsonl


@dataclass
class Opening:
    """How a session environment opens a group's conversations."""

    messages: list[dict]  # the opening messages
    tools: list[dict] | None = None  # the tools offered to the model (OpenAI-style function schemas); None: none


class UserCodeFailed(RuntimeError):
    """The task's reward function or environment raised on most of one call's completions."""


def user_code(task: str, task_config, environment: bool) -> str:
    """How an error names the user's code: `the environment zorplex`, `the reward function mymodule:reward`
    (a dataset's `module:function`), `the reward function of task user_task:Parity`."""
    if environment:
        return f"the environment {task}"
    reward = getattr(task_config, "reward", None)
    if task == "dataset" and isinstance(reward, str):
        return f"the reward function {reward}" if ":" in reward else f"the reward function dataset.reward {reward}"
    return f"the reward function of task {task}"


def failure(who: str, errors: list[BaseException], total: int, what: str) -> str | None:
    """The group's error if `errors` (raised by `who`) are more than half of its `total` items, else None."""
    if 2 * len(errors) <= total:
        return None
    first = errors[0]
    return f"{who} raised on {len(errors)} of {total} {what}; the first: {type(first).__name__}: {first}"


FAILED_COUNTS = re.compile(r" raised on (\d+) of (\d+) (?:completions|conversations); the first: ")


def failed_counts(error: str) -> tuple[int, int]:
    """(items raised on, items graded) of a group failed by `failure` (its error's line, as the controller got
    it); (0, 0) for any other error (nothing of the group was graded)."""
    found = FAILED_COUNTS.search(error)
    return (int(found[1]), int(found[2])) if found else (0, 0)


class TaskGrader(Actor):
    """Scores with the task's own reward function (roles.Grader)."""

    def __init__(self, task: str, task_config, config: GraderConfig | None = None):
        self.task = make_task(task, task_config)
        self.zero_truncated = config is not None and config.zero_truncated
        self.reward_name = user_code(task, task_config, environment=False)
        self.env_name = user_code(task, task_config, environment=True)
        self.logged: set[str] = set()  # the kinds of error whose traceback is in the log already
        self.first = ""  # the first error the user's code raised here, one line

    def _log(self, who: str, error: BaseException, on: str) -> None:
        """The first traceback of each kind of error; its repeats are counted, not logged."""
        kind = f"{who}: {type(error).__name__}"
        if not self.first:
            lines = str(error).strip().splitlines()
            self.first = f"{kind}: {lines[0]}" if lines else kind
        if kind not in self.logged:
            self.logged.add(kind)
            logger.error("%s failed on %r (its later %s errors are counted, not logged)", who, on,
                         type(error).__name__, exc_info=error)

    @endpoint
    async def first_error(self) -> str:
        """The first error the task's reward function or environment raised in this replica ("": none)."""
        return self.first

    @endpoint
    async def score(self, sample: Sample, replies: list[Reply]) -> list[tuple[float, dict[str, float]] | None]:
        """(reward, checks) of each reply (a completion's text and finish reason, sent by the generator holding
        it), None where its reward function raised (logged; the caller counts them). UserCodeFailed if it
        raised on most of them."""
        return self.scores(replies, sample)

    def scores(self, completions: list[Reply], sample: Sample) -> list[tuple[float, dict[str, float]] | None]:
        """`score`'s answer for `completions`: here, the task's reward function's."""
        return [None if reward is None else (reward, checks) for reward, checks in self.rewards(completions, sample)]

    def rewards(self, completions: list[Reply], sample: Sample) -> list[tuple[float | None, dict]]:
        """The task's (reward, checks) of each completion, its checks with `truncated` (cut off at its token
        limit, not rewarded) added; (None, {}) where its reward function raised (logged). With
        `zero_truncated` a truncated completion scores 0 (verifiers' zero_truncated_completions): a reply
        that babbles on after its answer earns nothing. UserCodeFailed if it raised on more than half."""
        results, errors = [], []
        for completion in completions:
            try:
                reward, checks = self.task.reward(completion.text, sample.answer)
                if prompt_checks := getattr(self.task, "prompt_checks", None):
                    checks = {**checks, **prompt_checks(sample, completion.text)}
                truncated = completion.finish_reason == "length"
                checks = {**checks, "truncated": float(truncated)}
                if self.zero_truncated and truncated:
                    reward = 0.0
                results.append((float(reward), checks))
            except Exception as e:  # the user's code: counted, and named if it fails most completions
                self._log(self.reward_name, e, completion.text)
                errors.append(e)
                results.append((None, {}))
        if message := failure(self.reward_name, errors, len(completions), "completions"):
            raise UserCodeFailed(message)
        return results

    @endpoint
    async def step(self, sample: Sample, conversations: list[list[dict]], last: bool) -> list[EnvReply]:
        """The environment's answer to each conversation's latest model turn; with `last` (the model has
        no turn left) every conversation ends and is scored. A conversation whose environment raised is
        failed (left out, counted); UserCodeFailed if it raised on more than half of them."""
        replies, errors = [], []
        for messages in conversations:
            try:
                if not last and (new := self.task.step(sample, messages)) is not None:
                    replies.append(EnvReply(messages=new))
                    continue
                reward, checks = self.task.conversation_reward(sample, messages)
                replies.append(EnvReply(reward=float(reward), checks=checks))
            except Exception as e:  # the user's code: counted, and named if it fails most conversations
                self._log(self.env_name, e, messages[-1]["content"])
                errors.append(e)
                replies.append(EnvReply(failed=True))
        if message := failure(self.env_name, errors, len(conversations), "conversations"):
            raise UserCodeFailed(message)
        return replies

    # The session form: a group's conversations as sessions held by this replica.

    @endpoint
    async def open_sessions(self, sample: Sample, sessions: list[str]) -> Opening:
        """Open a session per conversation of `sample`'s group: the messages that open them and the tools offered
        (alike: the same sample). Raises (the group fails) if the environment raised, or opened them differently."""
        openings, tools = [], getattr(self.task, "tools", None)
        try:
            for session in sessions:
                messages = await self.task.open(session, sample)
                openings.append(Opening(messages, await tools(session) if tools else None))
        except Exception as e:
            self._log(self.env_name, e, f"opening {sample.prompt}")
            await self._close(sessions)
            raise
        if any(opening != openings[0] for opening in openings):
            await self._close(sessions)
            raise ValueError(f"{self.env_name} opened the conversations of one sample ({sample.prompt}) differently: "
                             f"its reset must follow the seed alone")
        return openings[0]

    @endpoint
    async def step_sessions(self, sessions: list[str], replies: list[str | None], last: bool) -> list[EnvReply]:
        """Each session's answer to its model turn `replies[i]` (None: no new turn, the conversation ends where
        it is); with `last` (the model has no turn left) every one ends. An ended session is scored and closed;
        one whose environment raised is failed (closed, left out, counted); UserCodeFailed if it raised on more
        than half of them."""
        async def one(session: str, reply: str | None) -> EnvReply:
            try:
                if reply is not None:
                    messages, _ = await self.task.step(session, reply)
                    if messages is not None and not last:
                        return EnvReply(messages=messages)
                reward, checks, metadata = await self.task.finish(session)
                return EnvReply(reward=float(reward), checks=checks, metadata=metadata)
            except Exception as e:  # the user's code: counted, and named if it fails most conversations
                self._log(self.env_name, e, reply or "")
                errors.append(e)
                return EnvReply(failed=True)

        errors: list[BaseException] = []
        answers = await asyncio.gather(*(one(s, r) for s, r in zip(sessions, replies)))
        await self._close([s for s, a in zip(sessions, answers) if a.messages is None])
        if message := failure(self.env_name, errors, len(sessions), "conversations"):
            raise UserCodeFailed(message)
        return answers

    @endpoint
    async def close_sessions(self, sessions: list[str]) -> None:
        """Close these sessions (those not open are ignored); an environment that raises on close is logged."""
        await self._close(sessions)

    async def _close(self, sessions: list[str]) -> None:
        for session in sessions:
            try:
                await self.task.close(session)
            except Exception as e:  # the user's code: logged, and the other sessions are closed all the same
                self._log(f"{self.env_name} (closing a session)", e, session)
