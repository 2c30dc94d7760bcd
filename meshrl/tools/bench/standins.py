"""Light stand-ins for the generator, grader and trainer, as real Monarch actors, for `meshrl bench
controller --real` (meshrl/tools/bench/controller_real.py): they follow their role contracts
(meshrl/actors/roles.py) and do no model work, so what the bench measures is the controller, the
replay buffer and Monarch's messages between processes, at hundreds of actors (many to a process).

- StandInGenerator answers each prompt with `sampling.n` canned completions of `sampling.max_tokens`
  tokens (rewards alternating 0 and 1 in their text, so every group has a learning signal; random ones of
  their own with `distinct`), keeps them under run-unique keys as the real generator does, and hands them
  to whoever asks by key; a call carrying a Grading has them scored as the real generator does. It
  "loads" any version asked for at once (no weights move).
- StandInGrader scores the replies a generator sends it, as the real grader does.
- StandInTrainer takes each micro-batch from the replay buffer by its BatchRef (as the real trainer,
  meshrl/actors/distributed.py) and trains nothing.
"""

import random
import time
from array import array
from pathlib import Path

from monarch.actor import Actor, concurrent_endpoint, endpoint

from meshrl.actors import for_throughput
from meshrl.actors.distributed import each_micro_batch, to_buffer
from meshrl.actors.held import HeldCompletions, graded
from meshrl.actors.trace import ActorClock
from meshrl.actors.weight_updates import WeightUpdates
from meshrl.types import LOGPROB, TOKEN, Completion, Generation, Reply


def text_rewards(completions: list[Completion]) -> list[tuple[float, dict[str, float]]]:
    """The stand-in grader's scores (and the fake grader's, tests/support/simulation.py): a completion's
    reward (and `correct`) is the number its text is."""
    return [(float(c.text), {"correct": float(c.text)}) for c in completions]


class StandInGenerator(Actor):
    """roles.Generator with canned completions (one token array and one logprob array per length, made once and
    shared); `index` makes its keys unique in the run. With `distinct`, each completion's tokens and logprobs are
    its own, random, as real ones are."""

    def __init__(self, index: int, distinct: bool = False):
        for_throughput()  # as the real generator's process
        self.held = HeldCompletions(index << 32)
        self.version, self.running, self.book = 0, 0, WeightUpdates()
        self.canned: dict[int, tuple[array, array]] = {}  # length -> (tokens, logprobs), made once
        self.random = random.Random(index) if distinct else None

    def _sampled(self, tokens: array, logprobs: array) -> tuple[array, array | list[float]]:
        """A completion's tokens and logprobs: the canned ones, or (`distinct`) random ones of the same length."""
        if self.random is None:
            return tokens, logprobs
        ids = array(TOKEN, array("H", self.random.randbytes(2 * len(tokens))))  # 0 to 65535, drawn at once
        return ids, [-3 * self.random.random() for _ in logprobs]

    @concurrent_endpoint
    async def generate(self, prompts, *, sampling=None, min_version: int = 0, text: bool = False,
                       grading=None) -> Generation:
        if self.version < min_version:  # as if the version had been read at once
            start, self.version = time.time(), min_version
            self.book.loaded(start, min_version, in_flight=self.running > 0)
        self.running += 1
        self.book.running()
        try:
            length = sampling.max_tokens
            if length not in self.canned:
                self.canned[length] = (array(TOKEN, range(7, 7 + length)), array(LOGPROB, [-0.5]) * length)
            tokens, logprobs = self.canned[length]
            made = [Completion(p.index, p.token_ids, *self._sampled(tokens, logprobs), str(j % 2), self.version,
                               "length", [], -0.5 * length) for p in prompts for j in range(sampling.n)]
        finally:
            self.running -= 1
            if not self.running:
                self.book.done()
        return await graded(Generation([self.held.keep(c, text) for c in made], self.book.report()), made, grading)

    @concurrent_endpoint
    async def completions(self, keys: list[int], forget: bool = False) -> list[Completion]:
        return self.held.take(keys, forget)

    @concurrent_endpoint
    async def forget(self, keys: list[int]) -> None:
        self.held.forget(keys)

    @endpoint
    async def attach_weights(self, rings: list) -> str:
        return "stand-in"

    @endpoint
    async def pull_weights(self) -> int:
        return self.version

    @endpoint
    async def weight_updates(self) -> dict:
        return self.book.report()

    @endpoint
    async def weight_sync_stats(self) -> dict:
        return {"transport": "stand-in", "torn_reads": 0, "corrupt_reads": 0, "held": len(self.held)}


class StandInGrader(Actor):
    """roles.Grader: a completion's reward is the number its text is."""

    @endpoint
    async def score(self, sample, replies: list[Reply]) -> list[tuple[float, dict[str, float]] | None]:
        return text_rewards(replies)


class StandInTrainer(Actor):
    """roles.Trainer that fetches every micro-batch from the replay buffer and trains nothing; `fetched`
    counts the micro-batches and tokens it took (`spans` reports them)."""

    def __init__(self):
        self.version, self.updates, self.buffer = 0, 0, None
        self.clock = ActorClock()
        self.fetched = {"micro_batches": 0, "tokens": 0}

    @endpoint
    async def attach_buffer(self, buffer) -> None:
        self.buffer = buffer

    @endpoint
    async def ping(self) -> None:
        pass

    @endpoint
    async def forward_backward(self, refs) -> list[dict]:
        return await each_micro_batch(self.buffer, refs, self._train_on, self.clock, self.version)

    async def _train_on(self, ref, batch) -> dict:
        tokens = int(batch.loss_mask.sum())
        self.fetched["micro_batches"] += 1
        self.fetched["tokens"] += int(batch.input_ids.numel())
        return {"loss": 0.0, "tokens": tokens, "logprob_mismatch": 0.0, "ratio": float(tokens), "ratio_max": 1.0,
                "clip_low": 0, "clip_high": 0, "behaviour_weight": float(tokens), "tis_truncated": 0,
                "behaviour_kl": 0.0, "entropy": 0.0}

    @endpoint
    async def logprobs(self, refs) -> None:
        await each_micro_batch(self.buffer, refs, lambda ref, batch: to_buffer(self.buffer, ref, batch.behaviour_logprobs))

    @endpoint
    async def drop_gradients(self) -> None:
        pass

    @endpoint
    async def optim_step(self, skip: bool = False) -> dict:
        self.updates += 1
        return {"updates": self.updates, "grad_norm": 1.0, "skipped": skip}

    @endpoint
    async def weight_ring(self):
        return None

    @concurrent_endpoint
    async def publish_weights(self) -> int:
        self.version += 1
        return self.version

    @endpoint
    async def spans(self) -> list[dict]:
        return self.clock.take()

    @endpoint
    async def stats(self) -> dict:
        return dict(self.fetched)

    @endpoint
    async def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    @endpoint
    async def save_state(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "rank0.txt").write_text(f"{self.version} {self.updates}")

    @endpoint
    async def load_state(self, path: str) -> int:
        self.version, self.updates = map(int, (Path(path) / "rank0.txt").read_text().split())
        return self.version

