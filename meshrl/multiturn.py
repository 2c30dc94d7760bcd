"""Multi-turn rollouts: the controller's side of a group's conversations with an environment.

The generator still only generates, one call per turn, from exact token ids; the environment (in a
grader replica) answers each turn; this module appends its messages in the chat template's tokens
and asks for the next turn, up to `max_turns`. Each turn's Completion keeps its policy version and
behaviour logprobs; the finished conversations are scored Trajectories.
"""

import dataclasses
from dataclasses import dataclass
from typing import Awaitable, Callable

from meshrl.model import ChatTokenizer
from meshrl.types import Completion, Prompt, Sampling, ScoredCompletion, Trajectory

Generate = Callable[[list[Prompt], Sampling], Awaitable[list[Completion]]]
Step = Callable[[list[list[dict]], bool], Awaitable[list]]  # -> one grader.EnvReply per conversation


@dataclass
class Conversation:
    messages: list[dict]  # as the environment sees it: the opening, then each turn and answer
    turns: list[Completion]

    def take(self, completion: Completion) -> None:
        self.turns.append(completion)
        self.messages.append({"role": "assistant", "content": completion.text})

    def trajectory(self, tokenizer: ChatTokenizer, opening_tokens: int) -> Trajectory:
        last = self.turns[-1]
        ids = (last.prompt_token_ids + last.token_ids)[opening_tokens:]
        return Trajectory(self.turns, tokenizer.tokenizer.decode(ids, skip_special_tokens=False))


async def converse(index: int, opening: list[dict], sampling: Sampling, max_turns: int, max_model_len: int,
                   tokenizer: ChatTokenizer, generate: Generate, step: Step) -> tuple[list[ScoredCompletion], int]:
    """`sampling.n` conversations from the `opening` messages: returns the scored trajectories and the
    number of conversations the environment failed on (left out). A conversation whose next prompt
    would leave no room for `sampling.max_tokens` within `max_model_len` ends where it is."""
    opening_ids = tokenizer.encode_messages(opening)
    first = await generate([Prompt(index, opening_ids)], sampling)
    live = [Conversation(list(opening), []) for _ in first]
    for conversation, completion in zip(live, first):
        conversation.take(completion)
    scored, failed = [], 0

    def finish(conversation: Conversation, reply) -> None:
        nonlocal failed
        if reply.failed:
            failed += 1
        else:
            scored.append(ScoredCompletion(conversation.trajectory(tokenizer, len(opening_ids)), reply.reward,
                                           reply.checks))

    for turn in range(1, max_turns + 1):
        going, prompts, full = [], [], []
        for conversation, reply in zip(live, await step([c.messages for c in live], turn == max_turns)):
            if reply.failed or reply.messages is None:
                finish(conversation, reply)
                continue
            last = conversation.turns[-1]
            # the next turn's prompt: everything so far, the environment's messages, the assistant's turn opened
            ids = (last.prompt_token_ids + last.token_ids
                   + tokenizer.continuation(conversation.messages, last.token_ids, reply.messages))
            conversation.messages += reply.messages
            if len(ids) + sampling.max_tokens > max_model_len:
                full.append(conversation)
            else:
                going.append(conversation)
                prompts.append(Prompt(index, ids))
        if full:  # out of context: scored as they stand
            for conversation, reply in zip(full, await step([c.messages for c in full], True)):
                finish(conversation, reply)
        if not going:
            break
        for conversation, completion in zip(going, await generate(prompts, dataclasses.replace(sampling, n=1))):
            conversation.take(completion)
        live = going
    return scored, failed
