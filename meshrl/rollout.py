"""Rollout collection, one prompt's group at a time: each group is generated on the least-loaded
generator replica, a multi-turn group's later turns on the replica of its previous turn while the pool's
sticky routing allows (`generator.routing`: that replica's prefix cache holds the conversation), each
call from the newest published version on (the replica loads it first if need be), and
graded as soon as it is complete; the work buffer (meshrl/work_buffer.py) decides which prompts start and what each finished
group does to its batch. The same on the eval split.

A group whose call raised an error of its own (vLLM rejecting its prompt, an environment raising)
fails: it is counted, its prompt named once in the log, and the run goes on. A replica that died or
hung is replaced by its pool and the call redone elsewhere (meshrl/actors/replicas.py).

Multi-turn rollouts (`converse`, below): the controller's side of a group's conversations with an environment.

The generator still only generates, one call per turn, from exact token ids; the environment (in a
grader replica) answers each turn; `converse` appends its messages in the chat template's tokens
and asks for the next turn, up to `max_turns`. Each turn's Completion keeps its policy version and
behaviour logprobs; the finished conversations are scored Trajectories.
"""

import asyncio
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Awaitable, Callable

from tqdm import tqdm

from meshrl.actors.replicas import CallFailed, Replica, ReplicaPool
from meshrl.actors.timeouts import Timeouts
from meshrl.configs import ControllerConfig, GeneratorConfig
from meshrl.episodes import check_rates
from meshrl.models.model import ChatTokenizer
from meshrl.tasks import Sample, is_environment
from meshrl.types import Completion, Prompt, Sampling, ScoredCompletion, Trajectory
from meshrl.work_buffer import Group, WorkBuffer

logger = logging.getLogger(__name__)


class RolloutCollector:
    """Runs groups on the generator and grader pools; each finished group goes to the work buffer."""

    def __init__(self, controller: ControllerConfig, generator: GeneratorConfig, task, tokenizer,
                 generators: ReplicaPool, graders: ReplicaPool, tracer, work: WorkBuffer,
                 timeouts: Timeouts = Timeouts()):
        """The controller's section (group size, turns, evals) and the generator's (sampling, context)."""
        self.controller, self.generator, self.task, self.tokenizer = controller, generator, task, tokenizer
        self.generators, self.graders, self.work, self.timeouts, self.tracer = generators, graders, work, timeouts, tracer
        self.sampling = Sampling(n=controller.group_size, temperature=generator.temperature, top_p=generator.top_p,
                                 max_tokens=generator.max_tokens)
        self.latest = 0  # the newest version the trainer published: a group's first tokens come from it or newer
        self.staleness = controller.staleness  # the token a sequence's staleness is counted from
        self.groups: dict[int, asyncio.Task] = {}  # prompt index -> its group, generating or grading
        self.changed = asyncio.Event()  # a group ended or a version was published: the gate may open
        self.batch_ready = asyncio.Event()  # a group completed a batch
        self.error: BaseException | None = None  # what ends the run (a role out of replicas, too many failures)

    def start_groups(self, trainer_version: int) -> None:
        """Start a group for every prompt the work buffer lets start now."""
        while (index := self.work.start(trainer_version)) is not None:
            self.groups[index] = asyncio.create_task(self._group(index))

    async def _group(self, index: int) -> None:
        try:
            try:
                group = await self.run_group(index, self.task.train_sample(index), self.sampling, "generate")
            except CallFailed as e:
                logger.warning("the group of prompt %d failed and is not trained: %s", index, e)
                self.work.fail(index, str(e), e.tokens)
            else:
                if self.work.finish(group):
                    self.batch_ready.set()
        except asyncio.CancelledError:
            if index in self.work.running:
                self.work.stop(index)
            raise
        except Exception as e:  # a pool out of replicas, too many failed groups: the run ends
            if index in self.work.running:
                self.work.stop(index)
            self.error = self.error or e
        finally:
            del self.groups[index]
            self.changed.set()

    def published(self, version: int) -> None:
        """A new policy version: groups started from now on start from it; the gate may open."""
        self.latest = version
        self.changed.set()

    async def stop(self) -> None:
        """Stop every group in flight; their prompts start first again (work buffer)."""
        for task in list(self.groups.values()):
            task.cancel()
        await asyncio.gather(*self.groups.values(), return_exceptions=True)

    async def evaluate(self, step: int | None, split: str = "validation") -> dict[str, float]:
        """The newest policy on the task's held-out `split` (`eval_samples` per prompt at `eval_temperature`;
        greedy by default): each reward check's mean as `eval_<check>` (the task's accuracy check as
        `eval_accuracy`); a group that failed counts as wrong. Prints the rates and three example completions."""
        cfg = self.controller
        samples = self.task.eval_samples(split)
        sampling = Sampling(n=cfg.eval_samples, temperature=cfg.eval_temperature, top_p=cfg.eval_top_p,
                            max_tokens=self.generator.max_tokens)

        async def one(i: int, sample: Sample) -> Group:
            try:
                return await self.run_group(i, sample, sampling, "evaluate")
            except CallFailed as e:
                logger.warning("eval prompt %d failed (counted as wrong): %s", i, e)
                return Group(i, [], sampling.n, 0, self.latest)

        groups = await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
        scored = [s for g in groups for s in g.scored]
        rates = check_rates([s.reward_components for s in scored], sum(g.completions for g in groups), "eval_",
                            self.task.accuracy)  # failed: 0
        when = f" at step {step}" if step is not None else ""  # None: a finished run's policy (meshrl eval)
        lines = [f"{split} eval{when} ({len(samples)} prompts): "
                 + "  ".join(f"{k.removeprefix('eval_')} {v:.3f}" for k, v in rates.items())]
        for g in groups[:3]:
            reply = g.scored[0].completion.text.strip() if g.scored else "(failed, or its reward function did)"
            lines += [f"  prompt: {samples[g.prompt_index].prompt}", f"  reply:  {reply!r}"]
        tqdm.write("\n".join(lines))
        return rates

    async def run_group(self, index: int, sample: Sample, sampling: Sampling, what: str) -> Group:
        """One prompt's completions (or, for an environment, conversations) from generator replicas (from the
        newest published version on), graded by grader replicas. A replica that fails is replaced and its
        call redone elsewhere; CallFailed if a call raised an error of its own. The group's policy version
        is its oldest sequence's, each counted by `controller.staleness`."""
        launched = self.tracer.now()
        spans = []  # each generate call's span
        tokens, oldest = 0, math.inf
        served_by: Replica | None = None  # the replica of the previous turn: its prefix cache holds the group

        async def generate(prompts: list[Prompt], sampling: Sampling) -> list[Completion]:
            nonlocal tokens, oldest
            version = self.latest

            async def on(replica: Replica):
                nonlocal served_by
                served_by = replica
                async with self.tracer.span("generator", what, version, replica.index,
                                            timeout=self.timeouts.generate) as span:
                    out = await replica.actor.generate.call_one(prompts, sampling=sampling, min_version=version)
                    # the version served (its first tokens'), not the one asked for
                    span["min_version"], span["policy_version"] = version, min(
                        (c.policy_version for c in out), default=version)
                    return out, span

            completions, span = await self.generators.call(on, prefer=served_by)
            spans.append(span)
            tokens += sum(len(c.token_ids) for c in completions)
            oldest = min(oldest, *(c.sampled_version(self.staleness) for c in completions))
            return completions

        def grade(endpoint: str, *args):  # a reward (score) or an environment's answer (step): a "grade" span
            async def on(replica: Replica):
                async with self.tracer.span("grader", "grade", replica=replica.index, timeout=self.timeouts.grade,
                                            lock=replica.calls):
                    return await getattr(replica.actor, endpoint).call_one(*args)
            return self.graders.call(on)

        try:
            if is_environment(self.task):
                scored, completions = await self._converse(index, sample, sampling, generate, grade)
            else:
                first = await generate([Prompt(index, self.tokenizer.encode_chat(sample.prompt))], sampling)
                scored, completions = await grade("score", first, sample), len(first)
        except CallFailed as e:
            e.tokens = tokens  # generated, and now not trained
            raise
        return Group(index, scored, completions, tokens, oldest, launched, spans[0]["start"], spans[-1]["end"])

    async def _converse(self, index: int, sample: Sample, sampling: Sampling, generate, grade):
        """A multi-turn group: (its scored trajectories, how many it started)."""
        scored, failed = await converse(
            index, self.task.opening(sample), dataclasses.replace(sampling, stop=list(self.task.stop)),
            self.controller.max_turns, self.generator.max_model_len, self.tokenizer, generate,
            lambda conversations, last: grade("step", sample, conversations, last))
        return scored, len(scored) + failed


# Multi-turn: one group's conversations with an environment, turn by turn.

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
