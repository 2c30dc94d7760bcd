"""What each role must offer: the endpoints the controller calls and what they return.

A second implementation of a role (`--generator.impl mypkg.gen:MyGenerator`) is a Monarch `Actor`
whose endpoints (all `async`, decorated with `@endpoint`) match its role's Protocol here; the
controller checks the names before it spawns anything. The constructor takes the arguments that
`meshrl.runtime.launch.spawn_actors` passes to that role.

Errors are work's, not replicas': an exception a generator's or grader's endpoint raises fails that
call's group (counted in `groups_failed`, the run goes on). A replica is replaced only when its
process dies, a call to it times out, or it raises `ReplicaBroken` (its engine can serve no more).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from meshrl.types import BatchRef, Completion, Generation, Grading, GroupEpisodes, Prompt, Sampling, TrainBatch

if TYPE_CHECKING:  # the contracts name tensors; a grader's process (which reads this module) never loads torch
    import torch


class ReplicaBroken(RuntimeError):
    """Raised by a generator or grader endpoint when the replica itself can no longer serve (its
    engine failed): the controller replaces it and redoes the call elsewhere."""


class TokensLost(RuntimeError):
    """Raised by a generator or grader endpoint when the generator holding the completions it needs (a
    later turn's prefix, those to score) is gone: the group is generated again, nobody is replaced."""


class Generator(Protocol):
    """Makes Completions (tokens, behaviour logprobs, the policy version of every token); knows nothing of
    rewards. Loads new weights itself, between engine steps, as `generator.weight_update` says.
    Constructed with (GeneratorConfig, WeightSyncConfig, checkpoint path). Optionally a `sleep` endpoint,
    called before each synchronous step trains: free the device's memory until the next call or load."""

    async def generate(self, prompts: list[Prompt], *, sampling: Sampling | None = None,
                       min_version: int = 0, text: bool = False, grading: Grading | None = None) -> Generation:
        """`sampling.n` completions per prompt, their first tokens sampled from version `min_version` or newer
        (loaded first if need be), each with the versions its tokens were sampled from (`Completion.versions`)
        and the logprob of each sampled token under the distribution it was sampled from (at
        `sampling.temperature`: vLLM's processed logprobs). Each Completion is kept here under a key unique to
        the run, and answered as a `Generated` (with its text if `text`); a prompt with a `prefix` starts with
        the held Completion it names (its `prefix_holder`'s, taken from that generator, when not this one's).
        The answer is a `Generation`, with the replica's report since its last. With `grading`, the completions'
        `Reply`s go to its grader and its scores ride on the answer (meshrl/actors/held.py's `graded` does it).
        The controller sends one prompt's group per call, many calls at once: make it a
        `concurrent_endpoint` that batches them, or throughput falls to one group at a time."""

    async def completions(self, keys: list[int], forget: bool = False) -> list[Completion]:
        """The held Completions `keys` name (the replay buffer trains them), forgotten
        here with `forget`. A concurrent endpoint: it must answer while generation runs. `KeyError` for a key
        not held."""

    async def forget(self, keys: list[int]) -> None:
        """Let the held Completions `keys` go (a group dropped, failed or evaluated); keys not held are ignored."""

    async def attach_weights(self, rings: list) -> str:
        """Pull weights from the trainer's rings (a `RingHandle` per trainer rank, in rank order) from now on:
        each version assembled from every rank's shard; or, with weight_sync.transport disk, from the
        directory a `DiskHandle` names (meshrl/weight_sync/disk.py); returns the transport."""

    async def pull_weights(self) -> int:
        """Load the newest published version now if newer than the one served; returns the version served
        (benchmarks and tests; training runs leave the loading to the generator)."""

    async def weight_updates(self) -> dict:
        """Since the last call: {"pulls": [{"start", "end" (wall clock), "version", "in_flight",
        "read_s" (of the load, the seconds spent reading the rings)}, ...],
        "weight_swaps_in_flight", "prefix_cache_resets_refused"}; optionally the finished requests'
        "prompt_tokens" and "cached_prompt_tokens" (those its prefix cache served), and "trainer_bytes" (read
        from the trainer's rings, the step's `weight_bytes_egress`)."""

    async def weight_sync_stats(self) -> dict:
        """{"transport", "torn_reads", "corrupt_reads"}."""


class Grader(Protocol):
    """Scores one prompt's group. Constructed with (task name, task config, GraderConfig). Raising
    (rather than leaving a completion out) fails the group."""

    async def score(self, sample, replies: list) -> list[tuple[float, dict[str, float]] | None]:
        """Scores the completions of one prompt (`sample`: the task's Sample, with the prompt and the
        reference answer), each given as a `Reply` (its text and finish reason; the generator holding them
        sends them): one (reward, checks) each, None where the reward function raised (the caller counts
        them)."""

    async def step(self, sample, conversations: list[list[dict]], last: bool) -> list:
        """Needed only for a multi-turn task (an `Environment`): one `EnvReply` per conversation, the environment's
        next messages or, once it ends the conversation or `last`, its reward and checks."""

    async def open_sessions(self, sample, sessions: list[str]):
        """Needed only for a session environment (`SessionEnvironment`): opens a session per conversation of
        `sample`'s group, held by this replica until closed; an `Opening` (meshrl.actors.grader): the messages
        that open them and the tools offered to the model."""

    async def step_sessions(self, sessions: list[str], replies: list[str | None], last: bool) -> list:
        """Session environments: one `EnvReply` per session for its model turn (None: it ends where it is); an
        ended session is scored and closed."""

    async def close_sessions(self, sessions: list[str]) -> None:
        """Session environments: closes these sessions (any not open is ignored)."""


class Trainer(Protocol):
    """Trains on micro-batches it takes from the replay buffer by `BatchRef` and publishes weights; computes
    no advantages.
    Constructed with (TrainerConfig, WeightSyncConfig, checkpoint path)."""

    async def attach_buffer(self, buffer) -> None:
        """Take micro-batches from this replay buffer (an actor mesh following ReplayBuffer) from now on."""

    async def ping(self) -> None:
        """Answer at once, changing nothing: a restart's probe of whether it is still there (meshrl/restarts.py)."""

    async def forward_backward(self, refs: list[BatchRef]) -> list[dict]:
        """Accumulate the loss's gradient over each micro-batch `refs` names, in order (taken from the replay
        buffer: a rank's share of a mini-batch in one call); returns each one's metric sums (meshrl/losses.py).
        Logprobs are taken from logits / `batch.temperature`: the distribution the tokens were sampled from."""

    async def logprobs(self, refs: list[BatchRef]) -> None:
        """The current policy's logprob of every target token [B, T] of each micro-batch `refs` names, without
        training, attached to it in the replay buffer (as `ref.into`)."""

    async def base_logprobs(self, refs: list[BatchRef]) -> None:
        """Needed only for a KL penalty with LoRA (no reference process then): as `logprobs`, of the frozen
        base with the adapter switched off, the initial policy."""

    async def optim_step(self, skip: bool = False) -> dict:
        """One optimizer update: {"updates", "grad_norm", "skipped"}, and optionally "lr" (the learning rate
        it applied, or would have), "memory_gb" (the process's resident memory after it, the step's
        `trainer_memory_gb`), and "publish_s" and "publish_blocked_s" (the seconds of the last publish's copy
        into the ring, once, and those this update waited for it: the step's `weight_publish_s` and
        `weight_publish_hidden`). Not applied (the gradients dropped, `skipped` true) when `skip` says the loss
        was NaN or infinite, or the gradient norm is."""

    async def drop_gradients(self) -> None:
        """Forget the gradients accumulated since the last optim_step (a step that failed part-way is
        trained again from its start)."""

    async def weight_ring(self):
        """The `RingHandle` of the ring this rank's rows are published in, which generators pull from (None
        from a rank whose rows are in another rank's ring); with weight_sync.transport disk, rank 0's
        `DiskHandle` (the others None)."""

    async def publish_weights(self) -> int:
        """Publish the current weights as the next policy version; returns it once generators can read it.
        Its first part (the version, a gather) runs in its message's turn, before the next call; it answers
        later (an explicit response port): forward_backward and logprobs calls may come and run while it
        copies; an optim_step or save_state that comes meanwhile waits for the copy to end before it changes
        or saves the weights."""

    async def spans(self) -> list[dict]:
        """What this rank did since the last call, timed on the actor (meshrl/actors/trace.py's ActorClock):
        [{"what", "start", "end" (wall clock, `time.time()`), "policy_version"}]."""

    async def save(self, path: str) -> None:
        """Write the current policy as an HF checkpoint (every rank is called; one writes)."""

    async def save_state(self, path: str) -> None:
        """Write the policy, the optimizer and the counters for an exact resume (every rank is called)."""

    async def load_state(self, path: str) -> int:
        """Restore what `save_state` wrote and publish that policy under its version; returns the version."""


class Reference(Protocol):
    """The frozen initial policy for the KL penalty. Constructed with (ReferenceConfig, checkpoint path)."""

    async def attach_buffer(self, buffer) -> None:
        """As the trainer's: take micro-batches from this replay buffer."""

    async def ping(self) -> None:
        """As the trainer's: answer, changing nothing."""

    async def logprobs(self, refs: list[BatchRef]) -> None:
        """log p_ref of every target token [B, T] of each micro-batch `refs` names, attached to it in the replay
        buffer."""


class ReplayBuffer(Protocol):
    """Holds the kept groups' Episodes between the controller and the trainer, composes each batch,
    collates its micro-batches and hands them to the trainer's and reference's ranks; logs the batches
    handed out since the newest checkpoint. Constructed with (ReplayBufferConfig, TrainerConfig,
    prompts_per_step, max_policy_age, pad token id). meshrl/actors/replay_buffer.py has two."""

    async def stage(self, groups: list[tuple[int, int, list[list[tuple[int, int]]]]], holders: list) -> list[bool]:
        """Take graded groups' Completions from the generators holding them, forgetting them there: each group
        is (group id, attempt, its sequences' model turns as (index into `holders`, key)), staged under
        (group id, attempt): the controller's tries at one prompt are kept apart. For each group, False if a
        holder of its turns is gone (that group is generated again). Concurrent with the other endpoints."""

    async def discard(self, tries: list[tuple[int, int]]) -> None:
        """Staged tries that are not trained (dropped, stale), each (group id, attempt): let them go; another
        try at the same group stays."""

    async def add(self, batch: int, groups: list[GroupEpisodes], discard: list[tuple[int, int]] = ()) -> None:
        """Kept groups' episodes (which staged sequence and turns each trains, of the try `GroupEpisodes.attempt`
        names; its advantage, with the group's rewards and records), generated for batch `batch`, to flatten
        (meshrl/episodes.py's `flatten`); and the tries `discard` names let go, as `discard` does."""

    async def record_rollouts(self, run_dir: str, fraction: float, resumed_step: int | None) -> None:
        """Write rollouts.jsonl in `run_dir` from now on (meshrl/episodes.py's RolloutRecorder): each
        trained batch's records, their completion text filled in here (a resumed run's `resumed_step`: the
        records of the steps after it go)."""

    async def sample(self, batch: int, fresh: list[int]) -> dict:
        """Compose batch `batch` (its fresh groups `fresh`, in order, and whatever else the buffer trains),
        its episodes within the staleness bound (raise otherwise); split it into micro-batches; return
        {"micro_batches": [count per optimizer update], "episodes_trained", "episodes_reused", "groups_reused",
        "tokens_trained", "tokens_processed", "padding_fraction", "staleness_mean", "staleness_max", "episodes_by_age"}.
        A batch handed out before (since the newest checkpoint) is handed out again exactly."""

    async def micro_batch(self, ref: BatchRef) -> TrainBatch:
        """The micro-batch `ref` names, with what was attached to it (no loss token if `ref.idle`). Every
        trainer and reference rank fetches at once: a concurrent endpoint."""

    async def attach(self, ref: BatchRef, values: torch.Tensor) -> None:
        """Set `ref.into` of the micro-batch `ref` names."""

    async def trained(self, batch: int, step: int) -> None:
        """Batch `batch` is trained and step `step` logged: its fresh groups' records go to rollouts.jsonl
        (again, for a batch a restarted trainer trained again: no new use is counted, nothing is written)."""

    async def checkpointed(self, step: int) -> None:
        """A checkpoint of every step up to `step` is written: drop the log of the batches they trained."""

    async def logged(self) -> list[int]:
        """The batches handed out since the newest checkpoint, in order."""

    async def save_state(self, path: str) -> None:
        """The buffer's state (what it holds, its counts) into directory `path`."""

    async def load_state(self, path: str) -> int:
        """Restore what `save_state` wrote."""


ROLES: dict[str, type] = {"generator": Generator, "grader": Grader, "trainer": Trainer, "reference": Reference,
                          "replay_buffer": ReplayBuffer}


MULTI_TURN_ONLY = {"step"}  # a grader for single-turn tasks need not answer conversations
SESSION_ONLY = {"open_sessions", "step_sessions", "close_sessions"}  # nor hold sessions, for other tasks
BASE_REFERENCE_ONLY = {"base_logprobs"}  # a trainer that is not its own reference (no LoRA, no KL) need not


def missing_endpoints(role: str, cls: type, multi_turn: bool = True, base_reference: bool = False,
                      sessions: bool = False) -> list[str]:
    """The endpoints of `role`'s contract that `cls` does not define (those only multi-turn tasks
    call, only when `multi_turn`; those only session environments call, only when `sessions`; the trainer's base
    as the reference, only when `base_reference`)."""
    wanted = [name for name in vars(ROLES[role]) if not name.startswith("_")
              and (multi_turn or name not in MULTI_TURN_ONLY) and (sessions or name not in SESSION_ONLY)
              and (base_reference or name not in BASE_REFERENCE_ONLY)]
    return [name for name in wanted if not hasattr(cls, name)]
