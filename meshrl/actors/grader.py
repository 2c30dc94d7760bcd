"""The grader: turns one prompt's Completions into ScoredCompletions with the task's reward function."""

import logging

from monarch.actor import Actor, endpoint

from meshrl.tasks import make_task
from meshrl.types import Completion, ScoredCompletion

logger = logging.getLogger(__name__)


class Grader(Actor):
    def __init__(self, task: str, task_config):
        self.task = make_task(task, task_config)

    @endpoint
    async def score(self, completions: list[Completion], expected_answer: str) -> list[ScoredCompletion]:
        """Completions whose reward function raises are logged and left out; the caller counts them."""
        scored = []
        for completion in completions:
            try:
                reward, components = self.task.reward(completion.text, expected_answer)
            except Exception:
                logger.exception("reward function failed on %r", completion.text)
                continue
            scored.append(ScoredCompletion(completion, float(reward), components))
        return scored
