"""The grader: scores completions with the task's reward function, and hosts a multi-turn environment
(its answers to the model's turns, its reward at the end), so user code runs in an actor that is
replaced if it dies, not in the controller."""

import logging
from dataclasses import dataclass, field

from monarch.actor import Actor, endpoint

from meshrl.configs import GraderConfig
from meshrl.tasks import Sample, make_task
from meshrl.types import Completion, ScoredCompletion

logger = logging.getLogger(__name__)


@dataclass
class EnvReply:
    """An environment's answer to one conversation's latest model turn."""

    messages: list[dict] | None = None  # the next messages: the conversation goes on
    reward: float = 0.0  # else it is over, with this reward
    checks: dict[str, float] = field(default_factory=dict)
    failed: bool = False  # the environment raised (logged): the conversation is left out and counted


class Grader(Actor):
    """Scores with the task's own reward function (roles.Grader)."""

    def __init__(self, task: str, task_config, config: GraderConfig | None = None):
        self.task = make_task(task, task_config)
        self.zero_truncated = config is not None and config.zero_truncated

    @endpoint
    async def score(self, completions: list[Completion], sample: Sample) -> list[ScoredCompletion]:
        """Completions whose reward function raises are logged and left out; the caller counts them."""
        rewards = self.rewards(completions, sample)
        return [ScoredCompletion(c, reward, checks) for c, (reward, checks) in zip(completions, rewards)
                if reward is not None]

    def rewards(self, completions: list[Completion], sample: Sample) -> list[tuple[float | None, dict]]:
        """The task's (reward, checks) of each completion, its checks with `truncated` (cut off at its token
        limit, not rewarded) added; (None, {}) where its reward function raised (logged). With
        `zero_truncated` a truncated completion scores 0 (verifiers' zero_truncated_completions): a reply
        that babbles on after its answer earns nothing."""
        results = []
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
            except Exception:
                logger.exception("reward function failed on %r", completion.text)
                results.append((None, {}))
        return results

    @endpoint
    async def step(self, sample: Sample, conversations: list[list[dict]], last: bool) -> list[EnvReply]:
        """The environment's answer to each conversation's latest model turn; with `last` (the model has
        no turn left) every conversation ends and is scored."""
        replies = []
        for messages in conversations:
            try:
                if not last and (new := self.task.step(sample, messages)) is not None:
                    replies.append(EnvReply(messages=new))
                    continue
                reward, checks = self.task.reward(sample, messages)
                replies.append(EnvReply(reward=float(reward), checks=checks))
            except Exception:
                logger.exception("environment failed on %r", messages[-1]["content"])
                replies.append(EnvReply(failed=True))
        return replies
