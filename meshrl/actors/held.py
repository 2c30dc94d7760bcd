"""The completions a generator made and keeps (issue 54's data plane): each under a key unique to the run,
answered to the controller as a `Generated`, until the replay buffer takes it or the controller lets it
go. One owner of that bookkeeping for every generator: vLLM's, the benches' stand-ins and the tests' fakes;
and of the grading a generate call may carry (`graded`): the completions' replies go from here to the
grader, whose scores ride on the answer. And a completion in the making (`PartialCompletion`, one sequence of
a running `Request`), as an engine's steps bring its tokens."""

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field

from meshrl.actors.replicas import error_line, replica_fault
from meshrl.actors.roles import TokensLost
from meshrl.types import Completion, Completions, Generated, Generation, Grading, Prompt, Reply


@dataclass
class PartialCompletion:
    """One sequence of a request as its tokens arrive, each step's under the version then served: a Completion
    in the making (not a task's Sample)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    versions: list[list[int]] = field(default_factory=list)  # [token offset, version] where it changes
    finish_reason: str | None = None

    def add(self, token_ids: list[int], logprobs: list[float], text: str, version: int) -> None:
        """A step's new tokens, the logprob of each, and the new text."""
        if token_ids and (not self.versions or self.versions[-1][1] != version):
            self.versions.append([len(self.token_ids), version])
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.text += text


@dataclass
class Request:
    prompt: Prompt
    sequences: list[PartialCompletion]
    done: asyncio.Future


class HeldCompletions:
    def __init__(self, first_key: int | None = None):
        """Keys count up from `first_key`; by default from a random 40-bit start, so that no other replica
        of the run draws the same."""
        self.by_key: dict[int, Completion] = {}
        self.keys = itertools.count(random.SystemRandom().getrandbits(40) << 23 if first_key is None else first_key)

    def keep(self, completion: Completion, text: bool = False) -> Generated:
        """Keep `completion`; what the controller is answered (with its text if `text`)."""
        key = next(self.keys)
        self.by_key[key] = completion
        return Generated.of(key, completion, text)

    def take(self, keys: list[int], forget: bool = False) -> Completions:
        """The completions `keys` name (KeyError for one not held), let go with `forget`; sent in columns."""
        taken = Completions(self.by_key[k] for k in keys)
        if forget:
            for k in keys:
                del self.by_key[k]
        return taken

    def forget(self, keys: list[int]) -> None:
        """Let `keys` go; those not held are ignored."""
        for k in keys:
            self.by_key.pop(k, None)

    def __len__(self) -> int:
        return len(self.by_key)


async def take_held(holder, keys: list[int], forget: bool = False) -> list[Completion]:
    """The completions `keys` names from the generator `holder` (an actor mesh); TokensLost if it is gone
    (its process died) or no longer holds them: the group is generated again."""
    try:
        return await holder.completions.call_one(keys, forget=forget)
    except Exception as e:  # the holder died or lost them: the caller's group is generated again
        raise TokensLost(f"the generator holding them is gone: {e}") from None


async def graded(generation: Generation, completions: list[Completion], grading: Grading | None) -> Generation:
    """`generation` with `completions`' scores from `grading`'s grader, sent there from here (their `Reply`s
    only), if the call carried a grading. Where the grading failed, `grade_error` says why, and
    `grader_failed` whether the grader did (it did not answer within `grading.timeout_s`, or `replica_fault`:
    the replica pool's own rule, meshrl/actors/replicas.py) rather than the call."""
    if grading is None:
        return generation
    start = time.time()
    try:
        call = grading.grader.score.call_one(grading.sample, [Reply(c.text, c.finish_reason) for c in completions])
        generation.scores = await (asyncio.wait_for(call, grading.timeout_s) if grading.timeout_s > 0 else call)
    except (TimeoutError, asyncio.TimeoutError):
        generation.grade_error = f"the grader did not answer within {grading.timeout_s:g} s"
        generation.grader_failed = True
    except Exception as e:  # the grader's death, or its call's own error: the answer tells the controller which
        generation.grade_error = error_line(e)
        generation.grader_failed = replica_fault(e)
    generation.graded = (start, time.time())
    return generation
