"""Rollout collection, one prompt's group at a time: each group is generated on the least-loaded
generator replica, a multi-turn group's later turns on the replica of its previous turn while the pool's
sticky routing allows (`generator.routing`: that replica's prefix cache holds the conversation), each
call from the newest published version on (the replica loads it first if need be), and
graded as soon as it is complete; the work buffer (meshrl/work_buffer.py) decides which prompts start and what each finished
group does to its batch. The same on the eval split.

A group whose call raised an error of its own (vLLM rejecting its prompt, an environment raising)
fails: it is counted, its prompt named once in the log, and the run goes on. An eval's failed prompts
are told in one line per distinct error, with their count; a first eval (before training) whose every
prompt failed with one same error stops the run there (TooManyFailures): nothing would be learnt. A
replica that died or hung is replaced by its pool and the call redone elsewhere (meshrl/actors/replicas.py).

Each try at a group is an `Attempt` (meshrl/attempt.py: its calls, and the tokens it leaves with the
generators until the replay buffer takes them). A try whose tokens died with their generator (or a
session environment's replica) before the buffer took them costs the group: it is generated again (the
step's `groups_regenerated`), up to MAX_REGENERATIONS times.
"""

import asyncio
import itertools
import logging
from typing import Callable

from tqdm import tqdm

from meshrl.actors.generator_config import GeneratorConfig
from meshrl.actors.grader import failed_counts
from meshrl.actors.replicas import CallFailed, ReplicaPool
from meshrl.actors.roles import TokensLost
from meshrl.actors.timeouts import Timeouts, deadline
from meshrl.attempt import EXAMPLES, LETTING_GO, Attempt
from meshrl.buffer_calls import Stages
from meshrl.configs import ControllerConfig
from meshrl.episodes import bootstrap_interval, check_rates
from meshrl.tasks import Sample
from meshrl.tasks.conversation import SessionRoom
from meshrl.types import Sampling
from meshrl.work_buffer import Group, TooManyFailures, WorkBuffer

logger = logging.getLogger(__name__)
MAX_REGENERATIONS = 2  # times a group whose tokens died with their generator is generated again


def eval_failures(error: str, prompts: list[int], total: int) -> str:
    """One line for the eval prompts (of `total`) that failed with `error`."""
    if len(prompts) == 1:
        return f"eval prompt {prompts[0]} failed (counted as wrong): {error}"
    return f"{len(prompts)} of {total} eval prompts failed (counted as wrong; the first, {prompts[0]}) with: {error}"


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
                self.work.fail(index, str(e), e.tokens, failed_counts(str(e)))
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

    async def first_reward_error(self) -> str:
        """The first error a serving grader replica saw its reward function raise ("" if none says): bookkeeping
        for a warning, bounded; a replica failing now is the pool's to find."""
        async def ask(replica) -> str:
            async with deadline(self.timeouts.grade, "grader", "first_error"):
                return await replica.actor.first_error.call_one()

        asked = [ask(r) for r in self.graders.replicas if r.healthy and hasattr(r.actor, "first_error")]
        answers = await asyncio.gather(*asked, return_exceptions=True)
        return next((a for a in answers if isinstance(a, str) and a), "")

    def cancel(self) -> None:
        """Ask every group in flight to stop (each puts its prompt back, first, as it stops)."""
        for task in list(self.groups.values()):
            task.cancel()

    async def evaluate(self, step: int | None, split: str = "validation") -> dict[str, float]:
        """The newest policy on the task's held-out `split` (`eval_samples` per prompt at `eval_temperature`;
        greedy by default): each reward check's mean as `eval_<check>` (the task's accuracy check as
        `eval_accuracy`); a group that failed counts as wrong. Prints the rates and three example completions;
        a line per distinct error of its failed prompts. TooManyFailures if the first eval (`step` 0, before
        training) failed on every prompt with one same error."""
        cfg = self.controller
        samples = self.task.eval_samples(split)
        sampling = Sampling(n=cfg.eval_samples, temperature=cfg.eval_temperature, top_p=cfg.eval_top_p,
                            max_tokens=self.generator.max_tokens)
        failed: dict[str, list[int]] = {}  # each distinct error -> the prompts that failed with it

        async def one(i: int, sample: Sample) -> Group:
            try:
                return await self.run_group(i, sample, sampling, "evaluate")
            except CallFailed as e:
                failed.setdefault(str(e), []).append(i)
                return Group(i, [], sampling.n, 0, self.latest)

        groups = await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
        for error, prompts in failed.items():
            logger.warning(eval_failures(error, sorted(prompts), len(samples)))
        if step == 0 and samples and [len(p) for p in failed.values()] == [len(samples)]:
            raise TooManyFailures(f"every one of the {len(samples)} {split} eval prompts failed before training, "
                                  f"with the same error: {next(iter(failed))}")
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
