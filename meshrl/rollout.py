"""Rollout collection, one prompt's group at a time: each group is generated on the least-loaded
generator replica, a multi-turn group's later turns on the replica of its previous turn while the pool's
sticky routing allows (`generator.routing`: that replica's prefix cache holds the conversation), each
call from the newest published version on (the replica loads it first if need be), and
graded as soon as it is complete; the work buffer (meshrl/work_buffer.py) decides which prompts start and what each finished
group does to its batch. The same on the eval split.

A group whose call raised an error of its own (vLLM rejecting its prompt, an environment raising)
fails: it is counted, its prompt named once in the log, and the run goes on. A replica that died or
hung is replaced by its pool and the call redone elsewhere (meshrl/actors/replicas.py).

No token passes through here: a generator answers each completion's key and what the rules need
(`Generated`); the grader takes the completions from that generator, and a training group's are
staged in the replay buffer (`stage`), which takes them from the generators itself. Every answer
the controller receives is counted (the step's `controller_bytes_in`). A generator that
dies holding a group's completions before the buffer took them costs the group: it is generated
again (the step's `groups_regenerated`). What the buffer does not take is let go.

Multi-turn rollouts: each conversation of a group is carried turn by turn by `converse` (meshrl/tasks/
conversation.py). A stateless environment's turns go to any grader replica; a session environment's group
(`Attempt.sessions`) opens its sessions on one replica, steps and closes them there: its death costs the group,
which is generated again (`groups_regenerated`), and its sessions are closed whichever way the group ends.
"""

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import pickle
import uuid
from typing import Callable

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError
from tqdm import tqdm

from meshrl.actors.generator_config import GeneratorConfig
from meshrl.actors.held import take_held
from meshrl.actors.replicas import CallFailed, Replica, ReplicaPool
from meshrl.actors.roles import TokensLost
from meshrl.actors.timeouts import CallTimeout, Timeouts, deadline
from meshrl.buffer_calls import Stages
from meshrl.configs import ControllerConfig
from meshrl.episodes import bootstrap_interval, check_rates
from meshrl.tasks import Sample, is_environment, is_session
from meshrl.tasks.conversation import SessionRoom, converse
from meshrl.types import Generated, Generation, Prompt, Sampling, ScoredCompletion, Trajectory, model_turns
from meshrl.work_buffer import Group, WorkBuffer

logger = logging.getLogger(__name__)
MAX_REGENERATIONS = 2  # times a group whose tokens died with their generator is generated again
EXAMPLES = 3  # eval prompts whose first reply is printed
LETTING_GO: set[asyncio.Task] = set()  # `forget` calls on their way (not awaited: bookkeeping)


class RolloutCollector:
    """Runs groups on the generator and grader pools; each finished group goes to the work buffer."""

    def __init__(self, controller: ControllerConfig, generator: GeneratorConfig, task, tokenizer,
                 generators: ReplicaPool, graders: ReplicaPool, tracer, work: WorkBuffer, buffer: Callable[[], object],
                 timeouts: Timeouts = Timeouts(), report: Callable[[int, dict], None] = lambda replica, report: None):
        """The controller's section (group size, turns, evals) and the generator's (sampling, context);
        `buffer()`: the replay buffer's mesh now (a restarted one replaces it); `report(replica, report)`: what
        each generate answer brings of its replica's loads and busy time (the controller's step figures)."""
        self.controller, self.generator, self.task, self.tokenizer = controller, generator, task, tokenizer
        self.generators, self.graders, self.work, self.timeouts, self.tracer = generators, graders, work, timeouts, tracer
        self.buffer, self.report = buffer, report
        self.stages = Stages(buffer, timeouts.buffer)  # graded groups into the buffer, several to a message
        # since the last `take_counts`: the pickled size of every answer a training group's calls received, and
        # the training groups generated again (their tokens died with their generator)
        self.counts = {"controller_bytes_in": 0, "groups_regenerated": 0}
        # the replay buffer failing a group's stage: (its error, that buffer), for the training loop to raise
        # (it has the buffer restarted, meshrl/restarts.py)
        self.buffer_error: tuple[BaseException, object] | None = None
        self.sampling = generator.sampling(n=controller.group_size)
        self.latest = 0  # the newest version the trainer published: a group's first tokens come from it or newer
        self.staleness = controller.staleness  # the token a sequence's staleness is counted from
        self.groups: dict[int, asyncio.Task] = {}  # prompt index -> its group, generating or grading
        self.changed = asyncio.Event()  # a group ended or a version was published: the gate may open
        self.batch_ready = asyncio.Event()  # a group completed a batch
        self.error: BaseException | None = None  # what ends the run (a role out of replicas, too many failures)
        self.session_room = SessionRoom(getattr(task, "max_sessions", 0))  # a session environment's bound
        self.attempts = itertools.count(1)  # each try at a group, numbered: what the replay buffer stages it as

    def start_groups(self, trainer_version: int) -> None:
        """Start a group for every prompt the work buffer lets start now."""
        while (index := self.work.start(trainer_version)) is not None:
            task = self.groups[index] = asyncio.create_task(self._group(index))
            task.add_done_callback(lambda t, i=index: self._never_started(i, t))

    def _never_started(self, index: int, task: asyncio.Task) -> None:
        """A group cancelled before its first step (a replay buffer restarted in the tick it was started in)
        never ran `_group`'s own clean-up: its prompt starts again, as a stopped one's."""
        if task.cancelled() and self.groups.get(index) is task:
            del self.groups[index]
            if index in self.work.running:
                self.work.stop(index)
            self.changed.set()

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
        except asyncio.CancelledError:  # stopped, or its replay buffer died: its prompt starts again
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
        """Stop every group in flight; their prompts start first again (work buffer). The completions their
        generators still hold are let go."""
        self.cancel()
        await asyncio.gather(*self.groups.values(), return_exceptions=True)
        await asyncio.gather(*LETTING_GO, return_exceptions=True)

    async def replaced(self, buffer) -> None:
        """Until the replay buffer is another than `buffer` (restarted)."""
        while self.buffer() is buffer:
            await asyncio.sleep(0.1)

    def failed_buffer(self) -> BaseException | None:
        """The error with which the replay buffer in use failed a group's stage, if it did."""
        if self.buffer_error is not None and self.buffer_error[1] is self.buffer():
            return self.buffer_error[0]
        return None

    def take_counts(self) -> dict[str, int]:
        """`controller_bytes_in` and `groups_regenerated` since the last call (a step's row)."""
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return counts

    def cancel(self) -> None:
        """Ask every group in flight to stop (each puts its prompt back, first, as it stops)."""
        for task in list(self.groups.values()):
            task.cancel()

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
        # the accuracy's 95% interval over prompts (each a prompt's mean over its samples; failed: 0)
        per_prompt = [sum(s.reward_components.get(self.task.accuracy, 0.0) for s in g.scored) / g.completions
                      if g.completions else 0.0 for g in groups]
        rates["eval_accuracy_low95"], rates["eval_accuracy_high95"] = bootstrap_interval(per_prompt)
        when = f" at step {step}" if step is not None else ""  # None: a finished run's policy (meshrl eval)
        lines = [f"{split} eval{when} ({len(samples)} prompts): "
                 + "  ".join(f"{k.removeprefix('eval_')} {v:.3f}" for k, v in rates.items() if not k.endswith("95"))
                 + f"  (accuracy's 95% interval {rates['eval_accuracy_low95']:.3f}-{rates['eval_accuracy_high95']:.3f})"]
        for g in groups[:EXAMPLES]:
            reply = g.scored[0].completion.text.strip() if g.scored else "(failed, or its reward function did)"
            lines += [f"  prompt: {samples[g.prompt_index].prompt}", f"  reply:  {reply!r}"]
        tqdm.write("\n".join(lines))
        return rates

    async def run_group(self, index: int, sample: Sample, sampling: Sampling, what: str) -> Group:
        """One prompt's completions (or, for an environment, conversations) from generator replicas (from the
        newest published version on), graded by grader replicas, and (training groups) staged in the replay
        buffer. A replica that fails is replaced and its call redone elsewhere; a group whose tokens died
        with their generator before the buffer took them is generated again (`groups_regenerated`), up to
        MAX_REGENERATIONS times; CallFailed if a call raised an error of its own. The group's policy version
        is its oldest sequence's, each counted by `controller.staleness`."""
        launched, lost = self.tracer.now(), 0  # the tokens of attempts lost
        for attempt in range(MAX_REGENERATIONS + 1):
            this = Attempt(self, index, what, launched)
            try:
                group = await this.run(sample, sampling)
                group.tokens, group.lost_tokens = group.tokens + lost, lost
                return group
            except TokensLost as e:
                self.counts["groups_regenerated"] += what == "generate"  # the training groups' only
                lost += this.tokens
                if attempt == MAX_REGENERATIONS:
                    failed = CallFailed(f"its tokens were lost {attempt + 1} times: {e}")
                    failed.tokens = lost
                    raise failed from None
                logger.warning("the group of prompt %d is generated again: %s", index, e)
            except CallFailed as e:
                e.tokens += lost
                raise


class Attempt:
    """One try at a group: its calls, timed and counted, and the generators holding what it made until
    the replay buffer takes it (or, at the end, it is let go)."""

    def __init__(self, collector: RolloutCollector, index: int, what: str, launched: float):
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
                    lambda prompts, s: self.generate(prompts, s, text=True),
                    lambda conversations, last: self.grade("step", sample, conversations, last))
                completions = len(scored) + failed
            else:
                first = await self.generate([Prompt(self.index, c.tokenizer.encode_chat(sample.prompt))], sampling)
                scores = await self.grade("score", sample, self.holders[first[0].key].actor, [g.key for g in first])
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

    async def generate(self, prompts: list[Prompt], sampling: Sampling, text: bool = False) -> list[Generated]:
        """Completions from a generator replica, from the newest published version on; a later turn's prompt
        names the earlier turn, and the replica holding it when that is not the one called."""
        c, version = self.c, self.c.latest
        for p in prompts:
            if p.prefix is not None and not self.holders[p.prefix].healthy:
                raise TokensLost(f"generator {self.holders[p.prefix].index}, holding its previous turns, died")

        async def on(replica: Replica):
            self.served_by = replica
            sent = [p if p.prefix is None or self.holders[p.prefix] is replica
                    else dataclasses.replace(p, prefix_holder=self.holders[p.prefix].actor) for p in prompts]
            async with c.tracer.span("generator", self.what, version, replica.index,
                                     timeout=c.timeouts.generate) as span:
                answer: Generation = self.meter(await replica.actor.generate.call_one(
                    sent, sampling=sampling, min_version=version, text=text))
                c.report(replica.index, answer.report)
                out = answer.completions
                # the version served (its first tokens'), not the one asked for
                span["min_version"], span["policy_version"] = version, min((g.policy_version for g in out),
                                                                           default=version)
                return out, span

        out, span = await c.generators.call(on, prefer=self.served_by)
        self.spans.append(span)
        for g in out:
            self.holders[g.key] = self.served_by
        self.tokens += sum(g.num_tokens for g in out)
        self.oldest = min(self.oldest, *(g.sampled_version(c.staleness) for g in out))
        return out

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
                                  lambda prompts, s: self.generate(prompts, s, text=True), step, sessions=sessions)
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
