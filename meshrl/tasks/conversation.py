"""Multi-turn rollouts: the controller's side of one group's conversations with an environment (`converse`,
called by meshrl/attempt.py for each group of an environment task).

The generator only generates, one call per turn, from exact token ids; the environment (in a grader replica)
answers each turn, given the whole conversation (the stateless form) or its session and latest turn (the session
form); `converse` appends its messages in the chat template's tokens and asks for the next turn, up to
`max_turns`. Each turn's Completion keeps its policy version and behaviour logprobs; the finished conversations are
scored Trajectories.
"""

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Awaitable, Callable

from meshrl.models.model import ChatTokenizer
from meshrl.types import Generated, Prompt, Sampling, ScoredCompletion, Trajectory

Generate = Callable[[list[Prompt], Sampling], Awaitable[list[Generated]]]
Step = Callable[..., Awaitable[list]]  # (conversations, last[, their sessions]) -> one grader.EnvReply per conversation


@dataclass
class Conversation:
    messages: list[dict]  # as the environment sees it: the opening, then each turn and answer
    turns: list[Generated]
    between: list[list[int]]  # the template's tokens after each turn (its end, the answer, the next turn opened)
    session: str | None = None  # its session, in a session environment

    def take(self, turn: Generated) -> None:
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": turn.text})

    def trajectory(self, tokenizer: ChatTokenizer) -> Trajectory:
        """Its model turns, and its text: each turn's and the template's tokens between them."""
        parts = []
        for i, turn in enumerate(self.turns):
            parts.append(turn.text)
            if i + 1 < len(self.turns):
                parts.append(tokenizer.tokenizer.decode(self.between[i], skip_special_tokens=False))
        return Trajectory(self.turns, "".join(parts))


async def converse(index: int, opening: list[dict], sampling: Sampling, max_turns: int, max_model_len: int,
                   tokenizer: ChatTokenizer, generate: Generate, step: Step,
                   sessions: list[str] | None = None) -> tuple[list[ScoredCompletion], int]:
    """`sampling.n` conversations from the `opening` messages: returns the scored trajectories and the
    number of conversations the environment failed on (left out). `step(conversations, last)` answers the
    live conversations' latest turns; with `sessions` (a session environment, one per conversation) it is
    `step(conversations, last, their sessions)`. Each later turn's prompt is its new
    tokens after the previous turn (`Prompt.prefix`), which the generators hold. A conversation whose
    next prompt would leave no room for `sampling.max_tokens` within `max_model_len` ends where it is."""
    first = await generate([Prompt(index, tokenizer.encode_messages(opening))], sampling)
    live = [Conversation(list(opening), [], [], sessions[k] if sessions else None) for k in range(len(first))]
    for conversation, turn in zip(live, first):
        conversation.take(turn)
    scored, failed = [], 0

    def finish(conversation: Conversation, reply) -> None:
        nonlocal failed
        if reply.failed:
            failed += 1
        else:
            scored.append(ScoredCompletion(conversation.trajectory(tokenizer), reply.reward, reply.checks,
                                           getattr(reply, "metadata", {})))

    def ask(conversations: list[Conversation], last: bool):
        messages = [c.messages for c in conversations]
        return step(messages, last) if sessions is None else step(messages, last, [c.session for c in conversations])

    for turn in range(1, max_turns + 1):
        going, prompts, full = [], [], []
        for conversation, reply in zip(live, await ask(live, turn == max_turns)):
            if reply.failed or reply.messages is None:
                finish(conversation, reply)
                continue
            last = conversation.turns[-1]
            # the next turn's new tokens: the template's end of the turn, the environment's messages, the
            # assistant's turn opened
            new = tokenizer.continuation(conversation.messages, last.tail, reply.messages)
            conversation.messages += reply.messages
            conversation.between.append(new)
            if last.prompt_tokens + last.num_tokens + len(new) + sampling.max_tokens > max_model_len:
                full.append(conversation)
            else:
                going.append(conversation)
                prompts.append(Prompt(index, new, prefix=last.key))
        if full:  # out of context: scored as they stand
            for conversation, reply in zip(full, await ask(full, True)):
                finish(conversation, reply)
        if not going:
            break
        for conversation, completion in zip(going, await generate(prompts, dataclasses.replace(sampling, n=1))):
            conversation.take(completion)
        live = going
    return scored, failed


class SessionRoom:
    """Room for a session environment's sessions open at once across the run (`max_sessions` of the task, e.g. a
    served environment's capacity): a group takes room for all its sessions at once, or waits, so groups never
    hold part of what each needs; 0: no bound."""

    def __init__(self, size: int = 0):
        self.size, self.free = size, size
        self.changed = asyncio.Condition()

    async def take(self, n: int) -> None:
        if self.size:
            async with self.changed:
                await self.changed.wait_for(lambda: self.free >= n)
                self.free -= n

    async def give(self, n: int) -> None:
        if self.size:
            async with self.changed:
                self.free += n
                self.changed.notify_all()
