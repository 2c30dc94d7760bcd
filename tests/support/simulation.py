"""Fake actors for the controller's tests and its benchmark, in one process: a fake generator, grader
and trainer that follow their role contracts (meshrl/actors/roles.py) behind Monarch's actor handles
as tests/support/fake_monarch.py fakes them (each actor's plain endpoints one call at a time, its concurrent
ones together, as Monarch runs them), a fake task and tokenizer, and `run_fake`, which drives the real Controller,
RolloutCollector, WorkBuffer, ReplicaPools, Checkpointer and metric rows with them.

A `Script` sees every fake actor call before it runs (each one an await point of the loops) and can
delay it (by yielding to the event loop: deterministic), fail it (the call's own error, or the
replica's process dying), or ask for a stop there, as a signal would. `Costs` give generation and
training simulated durations (meshrl/tools/bench/controller.py); zero by default."""

import asyncio
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

from meshrl import checkpoint
from meshrl.actors import load_actor_class
from meshrl.actors.distributed import each_micro_batch, to_buffer
from meshrl.actors.held import HeldCompletions, graded
from meshrl.actors.replay_buffer import buffer_impl
from meshrl.actors.replicas import Replica, ReplicaPool, sticky_slack
from meshrl.actors.roles import ReplicaBroken
from meshrl.actors.timeouts import StopSignals, Timeout, Timeouts
from meshrl.actors.trace import ActorClock, Tracer
from meshrl.actors.weight_updates import WeightUpdates
from meshrl.configs import Config, ControllerConfig, resolve
from meshrl.controller import Controller
from meshrl.restarts import Respawner
from meshrl.runtime.loggers import MetricLoggers
from meshrl.runtime.metric_rows import MetricRows
from meshrl.tasks import Sample
from meshrl.tools.bench.standins import text_rewards
from meshrl.types import Completion, Generation

from support.fake_monarch import FakeMesh, FakeProcs, concurrent

PROMPT_ID = 100  # FakeTokenizer: a prompt's first token is PROMPT_ID + its index, so the trainer can tell


@dataclass
class Costs:
    """Simulated seconds: a group's generation per token of its completions (decoded together), training
    per token of a micro-batch (each rank its own), a publish and a generator's pull; and the spread of
    generation times (`tail`: the slowest groups take 1 + tail times as long as the fastest, the prompts
    spread evenly between)."""

    generate_per_token: float = 0.0
    train_per_token: float = 0.0
    publish: float = 0.0
    pull: float = 0.0
    tail: float = 0.0

    def faster(self, factor: float) -> "Costs":
        """The same costs, every time divided by `factor`."""
        return Costs(self.generate_per_token / factor, self.train_per_token / factor, self.publish / factor,
                     self.pull / factor, self.tail)


async def take(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


@dataclass
class Script:
    """What happens at each fake actor call (`calls` counts them, in the order they are made)."""

    stop_at: int = 0  # ask for a stop (as a first SIGINT) at this call
    yields: dict[str, int] = field(default_factory=dict)  # "generate": yield this often before answering
    reject: set[int] = field(default_factory=set)  # prompts whose generate call raises an error of its own
    equal: set[int] = field(default_factory=set)  # prompts whose completions all get reward 1: no signal
    late: dict[int, int] = field(default_factory=dict)  # prompt -> its first generation ends once this version is out (and loaded in flight)
    behind: set[int] = field(default_factory=set)  # prompts whose first generation says it served the version before the one asked for
    unscorable: set[int] = field(default_factory=set)  # training prompts whose reward function raises on every completion
    die_at: dict[str, int] = field(default_factory=dict)  # "generate": the replica dies at this call of it
    hang_at: dict[str, int] = field(default_factory=dict)  # "generate": this call never answers
    calls: list[str] = field(default_factory=list)
    sent: list[tuple[str, tuple]] = field(default_factory=list)  # each call's (endpoint, arguments), in order
    counts: Counter = field(default_factory=Counter)
    signals: StopSignals | None = None

    async def point(self, endpoint: str, replica, args: tuple = ()) -> None:
        self.calls.append(endpoint)
        self.sent.append((endpoint, args))
        self.counts[endpoint] += 1
        count = self.counts[endpoint]
        if len(self.calls) == self.stop_at and self.signals:
            self.signals.request("SIGINT")
        for _ in range(self.yields.get(endpoint, 0)):
            await asyncio.sleep(0)
        if getattr(replica, "dead", False) or self.die_at.get(endpoint) == count:
            replica.dead = True
            raise SupervisionError(f"Endpoint call {endpoint}() failed: the process exited with code 1 (fake)")
        if self.hang_at.get(endpoint) == count:
            await asyncio.sleep(3600)


@dataclass
class FakeWeights:
    """What the fake trainer published: the fake generators' weight ring."""

    version: int = 0


class FakeGenerator:
    """roles.Generator: `sampling.n` completions of `sampling.max_tokens` tokens; a completion's text is
    its reward ("1" or "0", alternating within a group so that it has a learning signal). It loads a
    newer version when a call asks for one (`min_version`), as `weight_update` says: `drain` waits for
    the calls running; `in_flight` (and `recompute`) load at once, the running calls' later tokens
    carrying the new version (split in proportion to the time generated under each)."""

    def __init__(self, weights: FakeWeights, script: Script, costs: Costs = Costs(), weight_update: str = "drain"):
        self.weights, self.script, self.costs, self.update = weights, script, costs, weight_update
        self.version, self.running = 0, 0
        self.loading, self.book = asyncio.Lock(), WeightUpdates()
        self.swaps: list[tuple[float, int]] = []  # (time, version) of every load
        self.poller: asyncio.Task | None = None
        self.held = HeldCompletions()  # as the real generator's: until taken or forgotten

    @concurrent
    async def completions(self, keys: list[int], forget: bool = False) -> list[Completion]:
        return self.held.take(keys, forget)

    @concurrent
    async def forget(self, keys: list[int]) -> None:
        self.held.forget(keys)

    @concurrent
    async def generate(self, prompts, *, sampling=None, min_version: int = 0, text: bool = False,
                       grading=None) -> Generation:
        if self.version < min_version:
            await self._load()
        if self.version < min_version:  # as the real generator: it cannot serve what it was asked for
            raise ReplicaBroken(f"serves version {self.version}, asked for {min_version} or newer (fake)")
        await self.book.admitting.wait()
        self.running += 1
        self.book.running()
        if self.update != "drain" and self.running == 1:
            self.poller = asyncio.create_task(self._poll())
        start, first = time.monotonic(), self.version
        try:
            length = sampling.max_tokens
            spread = 1 + self.costs.tail * ((prompts[0].token_ids[0] * 0.6180339887) % 1)  # evenly, by prompt
            await take(length * self.costs.generate_per_token * spread)
            for p in prompts:  # a late prompt's call ends once its version is out, and, loading in flight,
                # once this replica has loaded it (an event, not the poller's timing: under load the call
                # could otherwise end between the publish and the load, and span no versions)
                late = self.script.late.get(p.token_ids[0] - PROMPT_ID, 0)
                while self.weights.version < late or (self.update != "drain" and self.version < late):
                    await asyncio.sleep(0)
        finally:
            self.running -= 1
            if not self.running:
                self.book.done()
        versions = self._versions(start, time.monotonic(), first, length)
        made = []
        for p in prompts:
            index = p.token_ids[0] - PROMPT_ID
            self.script.late.pop(index, None)
            if index in self.script.reject:
                raise ValueError(f"prompt {index} is longer than the model's context (fake)")
            # a generator that served an older version than it was asked for (the controller finds the group stale)
            served = min_version - 1 if index in self.script.behind else first
            self.script.behind.discard(index)
            made += [Completion(p.index, p.token_ids, list(range(7, 7 + length)), [-0.5] * length,
                                "1" if index in self.script.equal else str(j % 2), served, "stop",
                                versions if served == first else [], -0.5 * length) for j in range(sampling.n)]
        return await graded(Generation([self.held.keep(c, text) for c in made], self.book.report()), made, grading)

    def _versions(self, start: float, end: float, first: int, length: int) -> list[list[int]]:
        """[token offset, version] of each load during [start, end]; [] if none."""
        versions = [[0, first]]
        for at, version in self.swaps:
            if not start <= at <= end or version == versions[-1][1]:
                continue
            # a load during the call reaches at least its last token, however late it came
            offset = min(round(length * (at - start) / (end - start)) if end > start else length // 2, length - 1)
            if offset == versions[-1][0] and len(versions) > 1:  # two loads between the same tokens: the newer
                versions[-1][1] = version
            elif offset > versions[-1][0]:
                versions.append([offset, version])
        return versions if len(versions) > 1 else []

    async def _poll(self) -> None:
        """While calls run, load newer versions between two of the engine's steps (one token's time)."""
        while self.running:
            if self.weights.version > self.version:
                await self._load()
            await asyncio.sleep(self.costs.generate_per_token)

    async def _load(self) -> None:
        async with self.loading:
            if self.weights.version <= self.version:
                return
            async with self.book.loading(drain=self.update == "drain"):
                start = time.time()
                await take(self.costs.pull)
                self.version = self.weights.version
                self.swaps.append((time.monotonic(), self.version))
                self.book.loaded(start, self.version, in_flight=self.running > 0)

    async def attach_weights(self, rings: list) -> str:
        self.weights = rings[0]  # a restarted trainer's
        return "fake"

    async def pull_weights(self) -> int:
        await self._load()
        return self.version

    async def weight_updates(self) -> dict:
        return self.book.report()

    async def weight_sync_stats(self) -> dict:
        return {"transport": "fake", "torn_reads": 0, "corrupt_reads": 0}

    async def sleep(self) -> bool:
        """vLLM's sleep mode while a synchronous step trains: a fake has no GPU memory to free."""
        return False


class FakeGrader:
    """roles.Grader: a completion's reward is the number its text is; the Script's `unscorable` prompts' reward
    function raises on each (the real grader's UserCodeFailed)."""

    def __init__(self, script: Script):
        self.script = script

    async def score(self, sample, replies: list) -> list[tuple[float, dict[str, float]] | None]:
        if sample.prompt in {f"prompt {i}" for i in self.script.unscorable}:
            raise RuntimeError(f"the reward function raised on {len(replies)} of {len(replies)} completions (fake)")
        return text_rewards(replies)


class FakeTrainer:
    """roles.Trainer: trains nothing; returns the loss's metric sums as a policy that is the behaviour
    policy would (meshrl/losses.py), and notes which prompts each optimizer update trained
    (`trained`: one list per update)."""

    def __init__(self, weights: FakeWeights, costs: Costs = Costs()):
        self.weights, self.costs = weights, costs
        self.version, self.updates, self.trained, self.pending = 0, 0, [], []
        self.copying: asyncio.Future | None = None  # a publish's copy into the ring, as the real trainer's
        self.clock = ActorClock()
        self.buffer = None
        self.received: Counter = Counter()  # what the caller sent forward_backward and logprobs for each micro-batch, by type

    async def attach_buffer(self, buffer) -> None:
        self.buffer = buffer

    async def ping(self) -> None:
        pass

    async def forward_backward(self, refs) -> list[dict]:
        self.received.update(type(ref).__name__ for ref in refs)
        return await each_micro_batch(self.buffer, refs, self._train_on)

    async def _train_on(self, ref, batch) -> dict:
        rows = batch.loss_mask.any(-1)
        self.pending += [int(i) - PROMPT_ID for i in batch.input_ids[rows, 0]]
        tokens = int(batch.loss_mask.sum())
        with self.clock.span("train", self.version):
            await take(tokens * self.costs.train_per_token)
        return {"loss": 0.0, "tokens": tokens, "logprob_mismatch": 0.0, "ratio": float(tokens), "ratio_max": 1.0,
                "clip_low": 0, "clip_high": 0, "behaviour_weight": float(tokens), "tis_truncated": 0,
                "behaviour_kl": 0.0, "entropy": 0.0}

    async def logprobs(self, refs) -> None:
        self.received.update(type(ref).__name__ for ref in refs)
        await each_micro_batch(self.buffer, refs, lambda ref, batch: to_buffer(self.buffer, ref, batch.behaviour_logprobs))

    async def drop_gradients(self) -> None:
        self.pending = []

    async def optim_step(self, skip: bool = False) -> dict:
        with self.clock.span("optim_step", self.version):
            if self.copying:  # the update changes the weights a publish is copying
                await asyncio.shield(self.copying)
        self.updates += 1
        self.trained.append(sorted(self.pending))
        self.pending = []
        return {"updates": self.updates, "grad_norm": 1.0, "skipped": skip}

    async def weight_ring(self):
        return self.weights  # what the generators attached to it load from

    @concurrent
    async def publish_weights(self) -> int:
        self.version = version = self.version + 1
        self.copying = asyncio.ensure_future(self._copy(self.copying, version))
        await asyncio.shield(self.copying)
        return version

    async def _copy(self, previous: asyncio.Future | None, version: int) -> None:
        if previous:
            await previous
        with self.clock.span("publish", version):
            await take(self.costs.publish)
        self.weights.version = version

    async def spans(self) -> list[dict]:
        return self.clock.take()

    async def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    async def save_state(self, path: str) -> None:
        if self.copying:
            await asyncio.shield(self.copying)
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "rank0.json").write_text(json.dumps({"version": self.version, "updates": self.updates}))

    async def load_state(self, path: str) -> int:
        state = json.loads((Path(path) / "rank0.json").read_text())
        self.version, self.updates = state["version"] - 1, state["updates"]
        return await self.publish_weights()


class FakeTask:
    accuracy = "correct"

    def train_sample(self, index: int) -> Sample:
        return Sample(f"prompt {index}", "1")

    def eval_samples(self, split: str = "validation") -> list[Sample]:
        return [Sample(f"{split} prompt {i}", "1") for i in range(2)]


class FakeTokenizer:
    pad_id = 0

    def encode_chat(self, prompt: str) -> list[int]:
        return [PROMPT_ID + int(prompt.split()[-1]), 5, 6]


def fake_config(steps: int = 4, prompts: int = 3, group: int = 2, max_policy_age: int = 0, replicas: int = 2,
                **controller) -> Config:
    """A small run for the fakes: completions of 3 tokens, micro-batches of 2, no TensorBoard, no
    checkpoints but the last (or a stop's)."""
    config = Config()
    config.controller = ControllerConfig(steps=steps, prompts_per_step=prompts, group_size=group,
                                         max_policy_age=max_policy_age, **controller)
    config.generator.replicas, config.generator.max_tokens = replicas, 3
    config.trainer.micro_batch_size = 2
    config.logging.tensorboard = False
    config.checkpoint.every = 0
    return config


@dataclass
class FakeRun:
    """What one `run_fake` did."""

    controller: Controller
    trainer: FakeTrainer  # rank 0 of the last trainer mesh (a restarted one's)
    rows: list[dict]
    spawned: list[int]  # generator replicas started, by index (replacements too)
    graders: list[int]  # grader replicas started, likewise


async def run_fake(config: Config, run_dir: Path, script: Script | None = None, resume: bool = False,
                   stop_timeout: float = 5.0, call_timeout: float = 0, costs: Costs = Costs(),
                   progress: bool = True, restart: bool = True) -> FakeRun:
    """The real controller's loops over fake actors (`config.trainer.ranks` fake trainer ranks), from the
    newest checkpoint in `run_dir` with `resume`; generate and grade calls bounded by `call_timeout`; a
    trainer or replay buffer that dies is restarted (`restart`), on fresh fakes. `config` is resolved first,
    as a run's is (meshrl.configs.resolve)."""
    config = resolve(config, run_dir)
    script = script or Script()
    run_dir.mkdir(parents=True, exist_ok=True)
    state_dir = checkpoint.latest(run_dir) if resume else None
    state = checkpoint.load(state_dir) if state_dir else None
    spawned, graded = [], []
    signals = script.signals = StopSignals()

    def start_buffer() -> FakeMesh:  # the real replay buffer, in this process
        return FakeMesh([load_actor_class(buffer_impl(config.replay_buffer.impl))(
            config.replay_buffer, config.trainer, config.controller.prompts_per_step, config.controller.max_policy_age,
            FakeTokenizer.pad_id)], script)

    buffer = start_buffer()
    trainers: list[FakeTrainer] = []  # rank 0 of each trainer mesh started, restarts too

    async def start_trainer() -> FakeMesh:
        ring = FakeWeights()  # each mesh its own
        ranks = [FakeTrainer(ring, costs) for _ in range(config.trainer.ranks)]
        trainers.append(ranks[0])
        for fake in ranks:
            await fake.attach_buffer(buffer)
        return FakeMesh(ranks, script)

    async def respawn(role: str) -> FakeMesh:  # as meshrl/runtime/run.py's
        nonlocal buffer
        if role == "replay_buffer":
            buffer = start_buffer()
            return buffer
        return await start_trainer()

    trainer = await start_trainer()
    weights = trainers[0].weights  # what generators started from now on load from
    timeouts = Timeouts(stop=Timeout(stop_timeout, "controller.stop_timeout_s"),
                        generate=Timeout(call_timeout, "generator.timeout_s"),
                        grade=Timeout(call_timeout, "grader.timeout_s"))

    async def generator(index: int) -> Replica:
        spawned.append(index)
        generator = FakeGenerator(weights, script, costs, config.generator.weight_update)
        return Replica(index, FakeProcs(), FakeMesh([generator], script), "fake", os.getpid())

    async def grader(index: int) -> Replica:
        graded.append(index)
        return Replica(index, FakeProcs(), FakeMesh([FakeGrader(script)], script), "fake", os.getpid())

    generators = ReplicaPool("generator", generator, config.generator.replicas, config.generator.max_restarts,
                             restart_window_s=config.controller.restart_window_s,
                             sticky_slack=sticky_slack(config.generator))
    graders = ReplicaPool("grader", grader, config.grader.replicas, config.grader.max_restarts,
                          restart_window_s=config.controller.restart_window_s)
    await asyncio.gather(generators.start(), graders.start())
    tracer = Tracer(run_dir, resume=resume)
    rows = MetricRows(MetricLoggers(run_dir, config, "fake", resumed_rows=state.rows if state else ()),
                      progress=progress)

    async def attach(new_trainer: FakeMesh) -> None:  # as meshrl/runtime/run.py's: every generator, and those to come
        nonlocal weights
        rings = [r for _, r in (await new_trainer.weight_ring.call()).items()]
        weights = rings[0]
        for replica in generators.replicas:
            if replica.healthy:
                await replica.actor.attach_weights.call_one(rings)

    controller = Controller(config, FakeTask(), FakeTokenizer(), generators, graders, trainer, None, buffer, tracer,
                            signals, checkpoint.Checkpointer(run_dir, 0, trainer, tracer, timeouts, buffer), rows,
                            timeouts, Respawner(respawn, attach) if restart else None)
    try:
        if state:
            await controller.restore(state, state_dir)
        await controller.run()
    finally:
        rows.close()
        tracer.close(plot=False)
    return FakeRun(controller, trainers[-1], rows.rows, spawned, graded)
