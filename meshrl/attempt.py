"""One try at a group (`Attempt`): its generate calls (each graded by its generator, or an environment's
turns through the graders), the replay buffer's stage of what it made, and the let-go of the rest. The
collector (meshrl/rollout.py) runs a group's tries.

A group's life, and who sends each of its messages (-> a message; the controller's modules on the left):

    work_buffer.start          prompt p may start (the staleness gate)
    attempt   generate ------> generator: completions made and held there, keyed
                                  `-- score(replies) --> grader (the Grading the call carried)
              <- Generation: keys, lengths, versions, scores, the replica's report
    attempt   stage ---------> replay buffer (buffer_calls.Stages: those graded meanwhile, one message)
                                  `-- completions(keys, forget) --> generator: the tokens, taken once
    work_buffer.finish         kept, equal-reward, stale or failed (what it does to its batch)
    controller add ----------> replay buffer: a kept group's advantages (buffer_calls: one message a batch,
                               within FLUSH_S); a stale or dropped try's discard rides in it
    attempt   forget --------> generator: what the buffer did not take (a failed or evaluated group's)
    controller sample, trained -> replay buffer; trainer's ranks take micro-batches from it by BatchRef

A try is staged under (prompt, attempt id): an add or a discard names its try, so a stale try's discard
can never touch the next try at the same prompt, whatever order their messages arrive in.

No token passes through here: a generator answers each completion's key and what the rules need
(`Generated`), and a single-turn group's scores: its generate call carries the grading (`Grading`), the
generator sending the grader the completions' text and finish reason itself (a group costs the
controller one message, not two). A training group's completions are staged in the replay buffer
(`stage`), which takes them from the generators itself. Every answer the controller receives is counted
(the step's `controller_bytes_in`). A generator that dies holding a group's completions before the
buffer took them costs the try (TokensLost): the collector generates the group again. What the buffer
does not take is let go.

Multi-turn rollouts: each conversation of a group is carried turn by turn by `converse` (meshrl/tasks/
conversation.py). A stateless environment's turns go to any grader replica; a session environment's group
(`Attempt.sessions`) opens its sessions on one replica, steps and closes them there: its death costs the try,
and its sessions are closed whichever way the group ends.
"""

import asyncio
import contextlib
import dataclasses
import logging
import math
import pickle
import uuid

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError

from meshrl.actors.held import take_held
from meshrl.actors.replicas import CallFailed, Replica
from meshrl.actors.roles import TokensLost
from meshrl.actors.timeouts import CallTimeout, Timeouts, deadline
from meshrl.tasks import Sample, is_environment, is_session
from meshrl.tasks.conversation import SessionRoom, converse
from meshrl.types import (Generated, Generation, Grading, Prompt, Reply, Sampling, ScoredCompletion, Trajectory,
                          model_turns)
from meshrl.work_buffer import Group

logger = logging.getLogger(__name__)
EXAMPLES = 3  # eval prompts whose first reply is printed
LETTING_GO: set[asyncio.Task] = set()  # `forget` and `close_sessions` calls on their way (not awaited: bookkeeping)


class Attempt:
    """One try at a group: its calls, timed and counted, and the generators holding what it made until
    the replay buffer takes it (or, at the end, it is let go)."""

    def __init__(self, collector, index: int, what: str, launched: float):
        self.c, self.index, self.what, self.launched = collector, index, what, launched
        # this try's number, unique to the run's controller: the buffer stages its sequences under (index, id), so a
        # discard or an add meant for one try can never touch another try's at the same prompt, whatever the order
        # their calls arrive in
        self.id = next(collector.attempts)
        self.spans: list[dict] = []  # each generate call's
        self.tokens, self.oldest = 0, math.inf
        self.served_by: Replica | None = None  # the previous turn's replica: its prefix cache holds the group
        self.holders: dict[int, Replica] = {}  # each completion's key -> the replica holding it
        self.staged: set[int] = set()  # keys the replay buffer took

    async def run(self, sample: Sample, sampling: Sampling) -> Group:
        c = self.c
        try:
            if is_session(c.task):
                scored, failed = await self.sessions(sample, sampling)
                completions = len(scored) + failed
            elif is_environment(c.task):
                scored, failed = await converse(
                    self.index, c.task.opening(sample), dataclasses.replace(sampling, stop=list(c.task.stop)),
                    c.controller.max_turns, c.generator.max_model_len, c.tokenizer,
                    self.turns, lambda conversations, last: self.grade("step", sample, conversations, last))
                completions = len(scored) + failed
            else:
                first, scores = await self.generate_scored(sample, sampling)
                scored = [ScoredCompletion(g, *score) for g, score in zip(first, scores) if score is not None]
                completions = len(first)
            if self.what == "generate" and scored:
                await self.stage(scored)
            elif self.what == "evaluate" and self.index < EXAMPLES and scored:
                await self.example(scored[0].completion)
        except CallFailed as e:
            e.tokens = self.tokens  # generated, and now not trained
            raise
        finally:
            self.let_go()
        return Group(self.index, scored, completions, self.tokens, self.oldest, self.launched, self.spans[0]["start"],
                     self.spans[-1]["end"], attempt=self.id)

    def meter(self, answer):
        """An answer a training group received, counted in the controller's bytes in."""
        if self.what == "generate":
            self.c.counts["controller_bytes_in"] += len(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
        return answer

    async def generate_scored(self, sample: Sample, sampling: Sampling) -> tuple[list[Generated], list]:
        """A single-turn group's completions and their scores. Its generate call carries the grading: the
        generator sends the completions' replies to a grader replica picked here (the least loaded, counted
        busy meanwhile) and answers the scores with them, so no score message leaves the controller. Where that
        grader failed (died, hung, broken), it is replaced and the group graded on another through the pool (its
        replies then pass through here: only the generator held them); where the reward function raised on
        most completions, the group fails."""
        c = self.c
        prompt = Prompt(self.index, c.tokenizer.encode_chat(sample.prompt))
        grade, generate = c.timeouts.grade, c.timeouts.generate
        # the generator's wait for the grader is bounded by the grader's timeout (or, without one, the generator's)
        wait = grade.seconds if grade and grade.seconds > 0 else generate.seconds if generate else 0.0
        async with c.graders.lent() as grader:
            answer = await self.generate([prompt], sampling, grading=Grading(grader.actor, sample, wait))
        if answer.graded is not None:  # on the generator's lane: its wait for the grader (queued there included)
            c.tracer.add("generator", "grade", *answer.graded, replica=self.served_by.index)
        if answer.scores is not None:
            return answer.completions, answer.scores
        if not answer.grader_failed:  # its reward function's error: the group's, as a call's own error is
            raise CallFailed(answer.grade_error)
        await c.graders.replace(grader, answer.grade_error)
        whole = self.meter(await take_held(self.holders[answer.completions[0].key].actor,
                                           [g.key for g in answer.completions]))
        return answer.completions, await self.grade("score", sample, [Reply(w.text, w.finish_reason) for w in whole])

    async def turns(self, prompts: list[Prompt], sampling: Sampling) -> list[Generated]:
        """A multi-turn group's next turns (`converse`'s generate), with their text for the environment."""
        return (await self.generate(prompts, sampling, text=True)).completions

    async def generate(self, prompts: list[Prompt], sampling: Sampling, text: bool = False,
                       grading: Grading | None = None) -> Generation:
        """Completions from a generator replica, from the newest published version on (scored too, with
        `grading`); a later turn's prompt names the earlier turn, and the replica holding it when that is not
        the one called."""
        c, version = self.c, self.c.latest
        timeout = c.timeouts.generate
        if grading is not None and timeout and timeout.seconds > 0:  # the call waits for its grading too
            timeout = dataclasses.replace(timeout, seconds=timeout.seconds + grading.timeout_s)
        for p in prompts:
            if p.prefix is not None and not self.holders[p.prefix].healthy:
                raise TokensLost(f"generator {self.holders[p.prefix].index}, holding its previous turns, died")

        async def on(replica: Replica):
            self.served_by = replica
            sent = [p if p.prefix is None or self.holders[p.prefix] is replica
                    else dataclasses.replace(p, prefix_holder=self.holders[p.prefix].actor) for p in prompts]
            async with c.tracer.span("generator", self.what, version, replica.index, timeout=timeout) as span:
                answer: Generation = self.meter(await replica.actor.generate.call_one(
                    sent, sampling=sampling, min_version=version, text=text, grading=grading))
                c.report(replica.index, answer.report)
                # the version served (its first tokens'), not the one asked for
                span["min_version"], span["policy_version"] = version, min(
                    (g.policy_version for g in answer.completions), default=version)
                return answer, span

        answer, span = await c.generators.call(on, prefer=self.served_by)
        self.spans.append(span)
        out = answer.completions
        for g in out:
            self.holders[g.key] = self.served_by
        self.tokens += sum(g.num_tokens for g in out)
        self.oldest = min(self.oldest, *(g.sampled_version(c.staleness) for g in out))
        return answer

    async def sessions(self, sample: Sample, sampling: Sampling) -> tuple[list[ScoredCompletion], int]:
        """A session environment's group: a session per conversation, all on one grader replica (they live
        there: its death costs the group, TokensLost, which is generated again), stepped with each model turn
        and closed there on every path (ended, truncated, stopped, failed)."""
        c = self.c
        await c.session_room.take(sampling.n)  # the task's max_sessions, if it has one
        try:
            replica = await c.graders.pick()
        except BaseException:
            await c.session_room.give(sampling.n)
            raise
        sessions = [f"{self.index}-{uuid.uuid4().hex}" for _ in range(sampling.n)]

        def step(conversations: list[list[dict]], last: bool, ids: list[str]):
            # a conversation whose last message is the environment's (out of context) ends with no new turn
            replies = [m[-1]["content"] if m[-1]["role"] == "assistant" else None for m in conversations]
            return self.grade("step_sessions", ids, replies, last, on=replica)

        try:
            opening = await self.grade("open_sessions", sample, sessions, on=replica)
            tokenizer = c.tokenizer.offering(opening.tools) if opening.tools else c.tokenizer  # tools= in every render
            return await converse(self.index, opening.messages, dataclasses.replace(sampling, stop=list(c.task.stop)),
                                  c.controller.max_turns, c.generator.max_model_len, tokenizer,
                                  self.turns, step, sessions=sessions)
        finally:  # those ended are closed already: closing again is a no-op
            task = asyncio.ensure_future(close_on(replica, sessions, c.timeouts, c.session_room))
            LETTING_GO.add(task)
            task.add_done_callback(LETTING_GO.discard)

    def grade(self, endpoint: str, *args, on: Replica | None = None):
        """A reward (score) or an environment's answer (step) from a grader replica (`on`: that one alone, which
        holds the group's sessions): a "grade" span."""
        c = self.c

        async def call(replica: Replica):
            async with c.tracer.span("grader", "grade", replica=replica.index, timeout=c.timeouts.grade,
                                     lock=replica.calls):
                return self.meter(await getattr(replica.actor, endpoint).call_one(*args))
        return c.graders.call(call) if on is None else c.graders.call_on(on, call)

    async def stage(self, scored: list[ScoredCompletion]) -> None:
        """The scored sequences' completions into the replay buffer, which takes them from their generators;
        TokensLost if a generator holding them died (or the buffer could not take them)."""
        sequences = [[(self.holders[t.key].actor, t.key) for t in model_turns(s.completion)] for s in scored]
        buffer = self.c.buffer()
        try:  # with the other groups graded while a stage is on its way (meshrl/buffer_calls.py's Stages)
            taken = self.meter(await self.c.stages.stage(self.index, self.id, sequences))
        except (ActorError, SupervisionError, CallTimeout) as e:
            # the buffer failed, not the group: the training loop has it restarted (which stops this group, its
            # prompt started again); past the buffer's timeout with no restart, the group is generated again
            self.c.buffer_error = self.c.buffer_error or (e, buffer)
            self.c.batch_ready.set()
            timeout = self.c.timeouts.buffer
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.c.replaced(buffer), timeout.seconds if timeout and timeout.seconds > 0
                                       else None)
            raise TokensLost(f"the replay buffer could not take them: {str(e).splitlines()[0]}") from None
        if not taken:
            raise TokensLost("a generator holding them died before the replay buffer took them")
        self.staged = {key for turns in sequences for _, key in turns}

    async def example(self, completion: Generated | Trajectory) -> None:
        """An eval example's text, taken from its generator (the controller prints it); TokensLost if that
        generator died meanwhile (the eval group is generated again)."""
        if completion.text is None:
            [whole] = await take_held(self.holders[completion.key].actor, [completion.key])
            completion.text = whole.text

    def let_go(self) -> None:
        """Every completion the buffer did not take is forgotten by its generator (not awaited)."""
        keys: dict[Replica, list[int]] = {}
        for key, replica in self.holders.items():
            if key not in self.staged and replica.healthy:
                keys.setdefault(replica, []).append(key)
        for replica, forget in keys.items():
            task = asyncio.ensure_future(forget_on(replica, forget, self.c.timeouts))
            LETTING_GO.add(task)
            task.add_done_callback(LETTING_GO.discard)


async def close_on(replica: Replica, sessions: list[str], timeouts: Timeouts, room: SessionRoom) -> None:
    """A group's sessions closed on their replica (if it still serves), then their room given back."""
    try:
        if replica.healthy:
            async with deadline(timeouts.grade, "grader", "close_sessions"):
                await replica.actor.close_sessions.call_one(sessions)
    except Exception:  # a replica failing now is the pool's to find
        pass
    finally:
        await room.give(len(sessions))


async def forget_on(replica: Replica, keys: list[int], timeouts: Timeouts) -> None:
    try:
        async with deadline(timeouts.generate, "generator", "forget"):
            await replica.actor.forget.call_one(keys)
    except Exception:  # a replica failing now is the pool's to find
        pass
