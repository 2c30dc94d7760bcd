"""A fake generator that only holds Completions: the `completions` and `forget` endpoints of a real
generator (meshrl/actors/generator.py), over Completions it was given instead of ones it generated, so
that a real replay buffer actor can take a group's tokens from it, and a real grader score them as a
generate call carrying a Grading has them scored (`grade`), without starting vLLM.
Imported by the actor processes (conftest puts tests/ on their PYTHONPATH)."""

import os

from monarch.actor import Actor, concurrent_endpoint

from meshrl.actors.held import HeldCompletions, graded
from meshrl.types import Completion, Generation, Grading


class FakeHolder(Actor):
    """Holds `completions` under keys 0, 1, ... (their index), as a generator holds what it made."""

    def __init__(self, completions: list[Completion]):
        self.held = HeldCompletions(0)
        for c in completions:
            self.held.keep(c)

    @concurrent_endpoint
    async def completions(self, keys: list[int], forget: bool = False) -> list[Completion]:
        return self.held.take(keys, forget)

    @concurrent_endpoint
    async def forget(self, keys: list[int]) -> None:
        self.held.forget(keys)

    @concurrent_endpoint
    async def grade(self, grading: Grading) -> Generation:
        """Every completion it holds graded as a generate call carrying `grading` has it done: sent from here."""
        made = self.held.take(sorted(self.held.by_key))
        return await graded(Generation([], {}), made, grading)

    @concurrent_endpoint
    async def keys(self) -> list[int]:
        """The keys it still holds (what a test checks was taken)."""
        return sorted(self.held.by_key)

    @concurrent_endpoint
    async def pid(self) -> int:
        """Its process (for a test to kill)."""
        return os.getpid()
