"""Tasks: where prompts and reward functions come from. A task maps a sample index to a Sample."""

from dataclasses import dataclass


@dataclass
class Sample:
    prompt: str  # the user's message; the chat template is applied by the controller
    answer: str


def make_task(name: str, config):
    from meshrl.tasks.sum_digits import SumDigits

    tasks = {"sum_digits": SumDigits}
    if name not in tasks:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(tasks))}")
    return tasks[name](config)
