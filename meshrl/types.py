"""The data that flows between actors: a task's Sample -> Prompt -> Completion -> ScoredCompletion -> Episode -> TrainBatch.
A multi-turn rollout's Completions (one per model turn) make a Trajectory, scored as one.

Each stage adds only what its producer knows: the generator knows tokens and logprobs, the grader
knows rewards, the controller knows groups and advantages. The trainer sees only TrainBatch.

Tokens travel actor to actor, not through the controller: a generator keeps each Completion it made
and answers with a `Generated` (its key there and what the controller decides with: lengths, finish
reason, versions); it sends the grader what a reward reads (a `Reply`), and the replay buffer takes the
Completion from that generator by key.
The controller's own answers stay the same size however long the sequences grow.

A Completion's and an Episode's token sequences are `array.array`s (token ids int32, logprobs float32: the
sampler's own precision and the trainer's; a loss mask int8), whatever they were made from: a message carries
each as one block of bytes, and the replay buffer, which takes thousands of them a second, joins, counts and
collates them without a Python object per token (a 1,024-token completion's two lists unpickle in 47 us, their
arrays in 3 us). A take's Completions travel in columns (`Completions`).
"""

from __future__ import annotations

import dataclasses
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a TrainBatch is made: a grader's process never loads torch
    import torch


TOKEN, LOGPROB, MASK = "i", "f", "b"  # the array typecodes of token ids (int32), logprobs (float32), loss masks (int8)


def as_array(typecode: str, values) -> array:
    """`values` as an array of `typecode`: itself if it is one already."""
    return values if isinstance(values, array) and values.typecode == typecode else array(typecode, values)


@dataclass
class Sample:
    """One question of a task (meshrl/tasks/__init__.py), as the controller, the graders and the task itself pass it:
    its text, its reference answer and whatever else scoring it needs."""

    prompt: str  # the user's message; the chat template is applied by the controller
    answer: str
    info: dict = field(default_factory=dict)  # what an environment needs besides the answer (its hidden state)


@dataclass
class Prompt:
    """A tokenized prompt. `index` ties its completions back to the task's sample (and its answer). A
    multi-turn conversation's later turn sends only its new tokens: `prefix` names the earlier turn
    (its prompt and tokens come first), held by the generator called or by `prefix_holder`."""

    index: int
    token_ids: list[int]  # the prompt's tokens; with a prefix, those after it
    prefix: int | None = None  # the key of the held Completion whose prompt and tokens come first
    prefix_holder: object = None  # the generator (actor mesh) holding it, when not the one called


@dataclass
class Sampling:
    """How a call samples (training's is `generator.sampling()`: meshrl/actors/generator_config.py; eval's is the
    controller's)."""

    temperature: float
    max_tokens: int
    n: int = 1  # completions per prompt
    top_p: float = 1.0  # 1: the whole distribution, which the trainer's logprobs are of (eval may narrow it)
    stop: list[str] = field(default_factory=list)  # strings that end a turn (kept in its text), e.g. a tool call's end


@dataclass
class Completion:
    """One sampled response, exactly as the generator produced it."""

    prompt_index: int
    prompt_token_ids: array  # int32 (a list given is made one)
    token_ids: array  # int32
    logprobs: array  # float32: the behaviour logprob of each generated token
    text: str
    policy_version: int  # the oldest version any of its tokens was sampled from
    finish_reason: str  # "stop" or "length"
    # [token offset, version] wherever the version its tokens were sampled from changes (weights loaded
    # while it was generated); [] when every token came from `policy_version`
    versions: list[list[int]] = field(default_factory=list)
    logprob_sum: float | None = None  # the sum of `logprobs`, summed by the generator (None: not given)

    def __post_init__(self):
        self.prompt_token_ids = as_array(TOKEN, self.prompt_token_ids)
        self.token_ids = as_array(TOKEN, self.token_ids)
        self.logprobs = as_array(LOGPROB, self.logprobs)

    def sampled_version(self, rule: str) -> int:
        """The version its staleness is counted from: its oldest token's, or (`newest_token`) its newest's."""
        return self.versions[-1][1] if rule == "newest_token" and self.versions else self.policy_version


class Completions(list):
    """Completions as one message carries them (a generator's answer to a take: meshrl/actors/held.py): pickled
    in columns, every token id of them in one array, every logprob in another, so a message of a thousand costs
    a few objects to pickle, not four each (a Completion and its three arrays: Monarch's pickler calls back into
    Python for each, 16-18 us a completion against 3 in columns). Unpickled, a plain list of Completions."""

    def __reduce__(self):
        prompts, tokens, logprobs, changes = array(TOKEN), array(TOKEN), array(LOGPROB), array("q")
        for c in self:
            prompts.extend(c.prompt_token_ids)
            tokens.extend(c.token_ids)
            logprobs.extend(c.logprobs)
            changes.extend(x for change in c.versions for x in change)
        counts = array("q", [x for c in self for x in (c.prompt_index, len(c.prompt_token_ids), len(c.token_ids),
                                                       c.policy_version, len(c.versions))])
        return unpacked, (prompts, tokens, logprobs, changes, counts, [c.text for c in self],
                          [c.finish_reason for c in self], [c.logprob_sum for c in self])


def unpacked(prompts: array, tokens: array, logprobs: array, changes: array, counts: array, texts: list[str],
             reasons: list[str], sums: list[float | None]) -> list[Completion]:
    """`Completions` from its columns: each completion's (prompt index, prompt length, length, policy version,
    number of version changes) in `counts`, its sequences cut from the others in turn."""
    out, p, t, v = [], 0, 0, 0
    for i, (text, reason, total) in enumerate(zip(texts, reasons, sums)):
        index, prompt, length, version, changed = counts[5 * i:5 * i + 5]
        out.append(Completion(index, prompts[p:p + prompt], tokens[t:t + length], logprobs[t:t + length], text,
                              version, reason, [changes[j:j + 2].tolist() for j in range(v, v + 2 * changed, 2)],
                              total))
        p, t, v = p + prompt, t + length, v + 2 * changed
    return out


@dataclass
class Generated:
    """A generator's answer for one Completion it made and keeps (under `key`, until the replay buffer
    takes it or the controller lets it go): what the controller decides with, no token list. `tail`:
    its last few tokens (how its turn ended, which the chat template's continuation needs); `text`:
    only when asked for (an environment's turn, which the controller hands to the environment)."""

    key: int
    prompt_index: int
    prompt_tokens: int  # its whole prompt's length (a later turn's: the conversation before it)
    num_tokens: int
    policy_version: int
    finish_reason: str
    versions: list[list[int]] = field(default_factory=list)  # as Completion.versions
    logprob_sum: float = 0.0
    tail: list[int] = field(default_factory=list)
    text: str | None = None

    def sampled_version(self, rule: str) -> int:
        return self.versions[-1][1] if rule == "newest_token" and self.versions else self.policy_version

    @staticmethod
    def of(key: int, c: Completion, text: bool = False, tail: int = 8) -> "Generated":
        """What a generator answers for Completion `c`, kept under `key`."""
        return Generated(key, c.prompt_index, len(c.prompt_token_ids), len(c.token_ids), c.policy_version,
                         c.finish_reason, c.versions,
                         sum(c.logprobs) if c.logprob_sum is None else c.logprob_sum, c.token_ids[-tail:].tolist(),
                         c.text if text else None)


@dataclass
class Reply:
    """What a reward function reads of a completion: all a generator sends the grader of it."""

    text: str
    finish_reason: str


@dataclass
class Grading:
    """A single-turn group's grading, carried by its generate call: the generator sends the grader replica the
    controller picked the completions' `Reply`s itself and answers their scores with them, so the controller
    sends no score message and no token leaves the generator twice."""

    grader: object  # the grader replica's actor mesh
    sample: Sample
    timeout_s: float = 0.0  # how long the generator waits for the grader's answer (0: no limit)


@dataclass
class Generation:
    """A generate call's answer: its Completions, each held by the generator and answered as a Generated, and
    the generator's report since its previous answer or report (roles.Generator.weight_updates' dict: its
    loads, busy seconds, prompt tokens): the step's generator figures ride on the answers the controller
    waits for anyway, not on a call to every replica every step. With a `Grading`, their scores too."""

    completions: list[Generated]
    report: dict
    # with a Grading: the grader's answer, each completion's (reward, checks) or None where its reward function
    # raised; None if not graded, and then `grade_error` says why: the grader failed (`grader_failed`: it died,
    # hung or said it is broken; the controller replaces it and has the group graded on another), or the call did
    # (its reward function raised on most completions: the group fails)
    scores: list[tuple[float, dict[str, float]] | None] | None = None
    grade_error: str = ""
    grader_failed: bool = False
    graded: tuple[float, float] | None = None  # when the grader was asked, and answered (time.time() here)


@dataclass
class Trajectory:
    """A multi-turn rollout, as the controller assembled it: the model's turns in order, each generated
    from everything before it (its prompt_token_ids are the previous turn's prompt and tokens, then the
    environment's messages in the chat template's tokens)."""

    turns: list[Generated]
    text: str  # the conversation after the opening prompt: each turn's text and the template's tokens between

    @property
    def prompt_index(self) -> int:
        return self.turns[0].prompt_index

    @property
    def policy_version(self) -> int:
        return min(t.policy_version for t in self.turns)  # the oldest policy any of its turns sampled from

    @property
    def finish_reason(self) -> str:
        return self.turns[-1].finish_reason

    def sampled_version(self, rule: str) -> int:
        return self.turns[-1].sampled_version(rule) if rule == "newest_token" else self.policy_version

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.turns)


def model_turns(completion: "Generated | Trajectory") -> list[Generated]:
    """The model's turns: a trajectory's, or the one completion."""
    return completion.turns if isinstance(completion, Trajectory) else [completion]


@dataclass
class ScoredCompletion:
    completion: Generated | Trajectory
    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)  # a session environment's episode metadata (JSON): rollouts.jsonl keeps it


@dataclass
class GroupEpisodes:
    """A kept group's episodes as the controller hands them to the replay buffer, which holds its
    sequences' Completions already (`stage`): for each episode, which sequence and which of its model
    turns it trains on, its advantage and its policy version; and the group's rollouts.jsonl records,
    whose completion text the buffer fills in (it holds the text). The buffer flattens them
    (meshrl/episodes.py's `episode`) in its own process: no token list passes through the controller."""

    group_id: int
    turns: list[tuple[int, int, int]]  # each episode's (sequence, first turn, end turn)
    advantages: list[float]
    versions: list[int]
    rewards: list[float]  # the group's rewards (the replay buffer's priority)
    temperature: float  # the one its tokens were sampled at
    records: list[dict] = field(default_factory=list)  # one per sequence, for rollouts.jsonl
    attempt: int = 0  # the try at the group whose staged sequences these are (the buffer's `stage`)


@dataclass
class Episode:
    """One trainer-ready sequence: prompt + response tokens, with per-token training data."""

    tokens: array  # int32 (lists given are made arrays)
    loss_mask: array  # int8: 1 on response tokens (those the loss trains)
    behaviour_logprobs: array  # float32, aligned with tokens; 0.0 where loss_mask is 0
    advantage: float
    policy_version: int
    group_id: int
    temperature: float = 1.0  # the sampling temperature its tokens were drawn at: the trainer's logits are divided by it

    def __post_init__(self):
        self.tokens = as_array(TOKEN, self.tokens)
        self.loss_mask = as_array(MASK, self.loss_mask)
        self.behaviour_logprobs = as_array(LOGPROB, self.behaviour_logprobs)

    @property
    def num_response_tokens(self) -> int:
        return bytes(self.loss_mask).count(1)


@dataclass(frozen=True)
class BatchRef:
    """A micro-batch the replay buffer holds (meshrl/actors/replay_buffer.py): batch `batch`'s
    optimizer update `update`, micro-batch `micro`. An actor given one takes the micro-batch from the
    buffer itself; what it computes for it (`into`: "old_logprobs", "ref_logprobs") it puts back there."""

    batch: int
    update: int
    micro: int
    into: str = ""
    idle: bool = False  # a rank's turn in a round short of micro-batches: the micro-batch, training nothing


@dataclass
class TrainBatch:
    """Right-padded tensors for one micro-batch.

    Position t holds the target token t+1 of each sequence, so `target_ids`, `loss_mask`,
    `behaviour_logprobs` line up with the logits the model emits at position t.
    `loss_tokens` and `loss_sequences` count the whole optimizer step, so micro-batches accumulate
    to one mean. `ref_logprobs` are the reference model's, when a KL penalty needs them;
    `old_logprobs` the trainer's own at the start of the step, for every update but the step's first.
    `temperature` is each sequence's sampling temperature: logprobs are taken from logits / temperature,
    the distribution the generator sampled from.
    """

    input_ids: torch.Tensor  # [B, T] int64
    target_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] bool
    behaviour_logprobs: torch.Tensor  # [B, T] float32
    advantages: torch.Tensor  # [B] float32
    loss_tokens: int
    loss_sequences: int
    ref_logprobs: torch.Tensor | None = None  # [B, T] float32
    old_logprobs: torch.Tensor | None = None  # [B, T] float32
    temperature: torch.Tensor | None = None  # [B] float32; None: 1

    @staticmethod
    def collate(episodes: list[Episode], loss_tokens: int, loss_sequences: int, pad_id: int = 0) -> "TrainBatch":
        import torch

        length = max(len(e.tokens) for e in episodes) - 1
        kinds = {TOKEN: torch.int32, MASK: torch.int8, LOGPROB: torch.float32}

        def rows(field: str, start: int, pad, dtype) -> torch.Tensor:  # right-padded; each row one copy of its bytes
            out = torch.full((len(episodes), length), pad, dtype=dtype)
            for i, e in enumerate(episodes):
                values, n = getattr(e, field), len(e.tokens) - 1
                if n > 0:
                    out[i, :n] = torch.frombuffer(values, dtype=kinds[values.typecode])[start:start + n]
            return out

        input_ids = rows("tokens", 0, pad_id, torch.long)
        target_ids = rows("tokens", 1, pad_id, torch.long)
        loss_mask = rows("loss_mask", 1, False, torch.bool)
        behaviour = rows("behaviour_logprobs", 1, 0.0, torch.float32)
        advantages = torch.tensor([e.advantage for e in episodes], dtype=torch.float32)
        temperature = torch.tensor([e.temperature for e in episodes], dtype=torch.float32)
        return TrainBatch(input_ids, target_ids, loss_mask, behaviour, advantages, loss_tokens, loss_sequences,
                          temperature=temperature)

    def to(self, device: torch.device) -> "TrainBatch":
        """The same batch with every tensor on `device`."""
        import torch

        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})
