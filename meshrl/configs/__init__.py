"""The run's config: one section per role and component, composed; named configs chosen by name and overridden
with dotted flags; `resolve`, the one step that fills in every value computed from others.

Each section is defined beside its owner, with its checks and its choices: each role's in its
meshrl/actors/<role>_config.py (beside the actor, which imports Monarch), the engine's in
meshrl/actors/engine.py, the loss's in meshrl/losses.py, the lr schedule's in meshrl/lr_schedule.py, LoRA's
and the model's in meshrl/models/, the weight ring's in meshrl/weight_sync/, the checkpoints' in
meshrl/checkpoint.py, each task's in its module. What belongs to the run as a whole is here: its loop
(`controller`), where its metrics go (`logging`), its hosts (configs/job.py) and its generate endpoint
(configs/serve.py).

The named configs and their registry are in configs/named.py: `meshrl train --config smoke --trainer.lr 1e-5
--controller.steps=3` (parsed by tyro, overrides.py); `meshrl train --config smoke --help` lists every field
with the comment beside it. Each actor role names its implementation ("module:Class"), so one can be swapped
from the command line without touching the controller."""

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

from meshrl.actors.generator_config import IMPLEMENTATIONS, GeneratorConfig, generator_impl
from meshrl.actors.grader_config import GraderConfig
from meshrl.actors.reference_config import ReferenceConfig
from meshrl.actors.replay_buffer_config import ReplayBufferConfig
from meshrl.actors.trainer_config import TrainerConfig
from meshrl.advantages import ESTIMATORS, STEP_WISE
from meshrl.checkpoint import CheckpointConfig
from meshrl.checks import at_least, one_of
from meshrl.configs.job import JobConfig
from meshrl.configs.overrides import ConfigError
from meshrl.configs.serve import ServeConfig
from meshrl.models import ModelConfig
from meshrl.tasks.dataset import DatasetConfig
from meshrl.tasks.openenv import OpenEnvConfig
from meshrl.tasks.reasoning_gym import ReasoningGymConfig
from meshrl.tasks.sum_digits import SumDigitsConfig
from meshrl.tasks.zorplex import ZorplexConfig
from meshrl.weight_sync import WeightSyncConfig

__all__ = ["Config", "ConfigError", "ControllerConfig", "LoggingConfig", "from_dict", "from_saved", "resolve",
           "resumable_overrides", "to_dict"]


@dataclass
class ControllerConfig:
    """The training loop. Eval rates are means over eval_samples completions per held-out prompt."""

    steps: int = 20  # steps (each publishes one policy version)
    prompts_per_step: int = 8  # prompts (groups) per step
    group_size: int = 8  # completions per prompt
    max_policy_age: int = 0  # the staleness bound, in steps: episodes of batch b come from versions b - max_policy_age to b (0: synchronous; 1: generation one step ahead)
    generate_ahead: int = -1  # versions generation may run ahead of the trainer (a group for batch b starts once version b - generate_ahead is out); -1: max_policy_age, or 0 with replay_buffer.impl replay (fewer than the bound leaves room to train groups again within it)
    staleness: str = "oldest_token"  # the token a sequence's staleness is counted from: oldest_token | newest_token (weights may change while it is generated)
    max_failed_fraction: float = 0.5  # the run stops once more than this share of a batch's prompts_per_step groups failed (a call of theirs raised, or none of their completions was scored)
    stop_timeout_s: float = 120.0  # each call made while stopping (the stop's checkpoint, the save, stopping meshes): past it the stop goes on without it
    restart_window_s: float = 300.0  # a process that fails within this many seconds of its start counts toward its role's max_restarts (a crash loop); one that served longer starts its count afresh
    advantage: str = "grpo"  # grpo | dr_grpo | rloo (meshrl/advantages.py); step_wise_<one of them>: an Episode per turn
    divide_by_turns: bool = False  # step_wise_*: each turn's advantage divided by its trajectory's turns
    max_turns: int = 4  # multi-turn tasks (environments): model turns per conversation at most
    drop_equal_reward_groups: bool = False  # DAPO's dynamic sampling: groups without signal are not trained
    max_sample_rounds: int = 4  # with drop_equal_reward_groups: prompt blocks sampled at most to fill a batch
    eval_every: int = 0  # 0: evaluate only before the first and after the last step
    eval_temperature: float = 0.0  # 0: greedy; e.g. 1.0 with eval_samples 4 for the mean@4 of sampled answers
    eval_samples: int = 1  # completions per eval prompt
    eval_top_p: float = 1.0  # nucleus sampling of eval completions (training samples the whole distribution)
    advantage_eps: float = 1e-6  # added to the group std (grpo)

    def check(self) -> None:
        at_least(self, "controller", steps=1, prompts_per_step=1, eval_samples=1, max_policy_age=0, max_turns=1,
                 max_sample_rounds=1, restart_window_s=0)
        if self.group_size < 2:
            raise ValueError("controller.group_size must be at least 2: a group of one has no advantage to learn from")
        if self.generate_ahead > self.max_policy_age:
            raise ValueError(f"controller.generate_ahead ({self.generate_ahead}) cannot be more than "
                             f"controller.max_policy_age ({self.max_policy_age}): its groups would be stale when trained")
        if not 0 <= self.max_failed_fraction <= 1:
            raise ValueError("controller.max_failed_fraction must be between 0 and 1")
        one_of(self, "controller", staleness=("oldest_token", "newest_token"))
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ValueError("controller.eval_temperature must be above 0 when eval_samples is above 1: greedy "
                             "sampling gives one answer per prompt")
        if self.advantage.removeprefix(STEP_WISE) not in ESTIMATORS:
            raise ValueError(f"unknown controller.advantage {self.advantage!r}; known: {', '.join(ESTIMATORS)}, "
                             f"or {STEP_WISE}<one of them>")


@dataclass
class LoggingConfig:
    """Where metrics go besides metrics.jsonl (meshrl/runtime/loggers.py)."""

    tensorboard: bool = True  # event files in the run directory: tensorboard --logdir runs
    wandb: bool = False  # Weights & Biases, opt-in
    wandb_project: str = "meshrl"  # W&B project
    wandb_run_name: str = ""  # W&B run name; "": the run directory's name
    wandb_mode: str = "auto"  # auto (online with an API key and a reachable server, else offline) | online | offline
    rollouts_fraction: float = 1.0  # share of trained completions written to rollouts.jsonl (0: none)

    def check(self) -> None:
        one_of(self, "logging", wandb_mode=("auto", "online", "offline"))
        if not 0 <= self.rollouts_fraction <= 1:
            raise ValueError("logging.rollouts_fraction must be between 0 and 1")


@dataclass
class Config:
    """A whole run: one section per role, the task and its own section, logging, and where the roles run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: str = "sum_digits"  # sum_digits | dataset | zorplex | reasoning_gym | openenv (settings: the section of the same name) | module:Class
    task_args: str = ""  # a module:Class task's settings, as JSON for its Config dataclass ('{"size": 100}')
    sum_digits: SumDigitsConfig = field(default_factory=SumDigitsConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    zorplex: ZorplexConfig = field(default_factory=ZorplexConfig)
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    openenv: OpenEnvConfig = field(default_factory=OpenEnvConfig)  # an OpenEnv environment, as sessions (--task openenv)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    grader: GraderConfig = field(default_factory=GraderConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    replay_buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    job: JobConfig = field(default_factory=JobConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)  # the generate endpoint for harnesses that drive their own loop (off)

    def check(self) -> None:
        """ValueError (one line, naming the field) for values that cannot work, before anything starts: each
        section checks its own fields, then what spans sections."""
        for section in (self.generator, self.grader, self.trainer, self.reference, self.replay_buffer,
                        self.weight_sync, self.controller, self.logging, self.checkpoint, self.serve):
            section.check()
        if self.task == "openenv":
            self.openenv.check()
            if 0 < self.openenv.max_sessions < max(self.controller.group_size, self.controller.eval_samples):
                raise ValueError(f"openenv.max_sessions {self.openenv.max_sessions} leaves no room for a group's "
                                 f"sessions (controller.group_size {self.controller.group_size}, eval_samples "
                                 f"{self.controller.eval_samples}): 0 or at least both")
        if self.replay_buffer.impl == "replay" and self.controller.max_policy_age < 1:
            raise ValueError("replay_buffer.impl replay trains groups again in later steps, which the staleness bound "
                             "must allow: set controller.max_policy_age to 1 or more")
        if self.weight_sync.verify and self.generator.tensor_parallel_size > 1:
            raise ValueError("weight_sync.verify compares the tensors of a generator's own vLLM worker: it needs "
                             "generator.tensor_parallel_size 1")
        if self.generator.exact and self.weight_sync.dtype not in ("auto", "float32"):
            raise ValueError(f"generator.exact serves the trainer's float32 master weights: weight_sync.dtype auto or "
                             f"float32, not {self.weight_sync.dtype}")
        if self.weight_sync.verify and generator_impl(self.generator.impl) == IMPLEMENTATIONS["torch"]:
            raise ValueError("weight_sync.verify compares the tensors vLLM holds: not with generator.impl torch")
        if self.weight_sync.verify and self.trainer.lora.rank:
            raise ValueError("weight_sync.verify compares the base weights vLLM holds, which an adapter leaves as "
                             "they are: not with trainer.lora")


def resolve(config: Config, run_dir: Path | None = None) -> Config:
    """A copy of the checked `config` with every setting computed from other sections filled in, once, before
    anything is spawned: the roles and the controller read these and derive no setting themselves (the
    replay buffer's share of fresh groups is its section's `fresh_groups`, not a setting).
    - `generator.weight_update` auto: drain when training is synchronous (controller.max_policy_age 0:
      nothing may span two versions) or with generator.exact (a completion is re-scored under the weights that
      sampled all of it), else in_flight;
    - `controller.generate_ahead` -1: the whole staleness bound, or none with `replay_buffer.impl replay`,
      whose groups trained again need the bound's room (docs/studies.md#replay);
    - `trainer.lr_schedule.total_updates` 0: the run's optimizer updates, steps x trainer.mini_batches;
    - `trainer.loss.constant_norm` 0: generator.max_tokens, the most tokens a sequence has;
    - `trainer.per_sequence` on with `generator.exact`, whose re-scoring it must match (meshrl/exact.py);
    - `weight_sync.disk_dir` "": RUN_DIR/weights, where the disk path or verify writes versions.
    What depends on the hosts (the GPU plan and the dtypes measured at the start: meshrl/runtime/gpu_plan.py
    and dtypes.py) is written into the same resolved config by the run before the roles are spawned.
    Resolving twice changes nothing."""
    config = copy.deepcopy(config)
    g, c, t, w = config.generator, config.controller, config.trainer, config.weight_sync
    if g.weight_update == "auto":
        g.weight_update = "drain" if c.max_policy_age == 0 or g.exact else "in_flight"
    if c.generate_ahead < 0:
        c.generate_ahead = 0 if config.replay_buffer.impl == "replay" else c.max_policy_age
    if t.lr_schedule.total_updates == 0:
        t.lr_schedule.total_updates = c.steps * t.mini_batches
    if t.loss.constant_norm == 0:
        t.loss.constant_norm = g.max_tokens
    if g.exact:
        t.per_sequence = True
    if (w.transport == "disk" or w.verify) and not w.disk_dir and run_dir is not None:
        w.disk_dir = str((run_dir / "weights").absolute())
    return config


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


# What a resumed run may change: how long it runs, where and how it is placed, watched and bounded; not
# what it computes (the model, the task, the losses, the batch shapes, the staleness bound, ...).
RESUMABLE = ("controller.steps", "controller.eval_every", "checkpoint.", "logging.", "job.", "weight_sync.transport",
             "weight_sync.checksums", "weight_sync.chunk_mb", "weight_sync.poll_s", "weight_sync.verify", ".hosts", ".cpus", ".num_threads", ".timeout_s",
             ".max_restarts", "trainer.max_bad_steps", "trainer.activation_checkpointing", "trainer.logprob_chunk_tokens", "generator.replicas", "grader.replicas", "controller.stop_timeout_s", "controller.restart_window_s",
             "controller.max_failed_fraction", "trainer.ranks", "reference.ranks", "serve.", "openenv.url",
             "openenv.max_sessions")


def resumable_overrides(saved: Config, config: Config) -> None:
    """ConfigError naming the first field `config` changes from `saved` that a resume must keep."""
    before, after = _flat(to_dict(saved)), _flat(to_dict(config))
    for key in sorted(k for k in after if after[k] != before.get(k)):
        if not any(key.startswith(p) if p.endswith(".") else key.endswith(p) if p.startswith(".") else key == p
                   for p in RESUMABLE):
            raise ConfigError(f"--{key} cannot change on resume: it would change what the run computes "
                              f"(it was {before.get(key)!r}); a resume may change controller.steps and eval_every, "
                              "the job and placement (hosts, cpus, threads, replicas, trainer and reference ranks), "
                              "logging, checkpoints, timeouts and restart limits")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


# What a run's config.json may hold from before 2026-11-27 (issue 56), read as it trains now: generator.top_p could
# only be 1 (the whole distribution, as every run samples); the task grader's and the reusing buffer's classes
# were renamed. (trainer.loss.constant_norm was written out as 48, which trains as it did.)
RETIRED = {("generator", "top_p"): 1.0}
RENAMED = {"meshrl.actors.grader:Grader": "meshrl.actors.grader:TaskGrader",
           "meshrl.actors.replay_buffer:ReplayBuffer": "meshrl.actors.replay_buffer:ReuseBuffer"}


def from_saved(data: dict) -> Config:
    """A run's config.json back into its Config (`--resume`, `meshrl eval`), one written before a setting was
    retired or a class renamed included."""
    data = copy.deepcopy(data)
    for (section, name), only in RETIRED.items():
        if data.get(section, {}).get(name, only) == only:
            data.get(section, {}).pop(name, None)
    for section in data.values():
        if isinstance(section, dict) and section.get("impl") in RENAMED:
            section["impl"] = RENAMED[section["impl"]]
    return from_dict(Config, data)


def from_dict(cls, data: dict):
    """The inverse of `to_dict` (a run's config.json back into its Config); unknown keys are an error."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := set(data) - set(fields):
        raise ConfigError(f"unknown config keys {sorted(unknown)} in {cls.__name__}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: from_dict(hints[k], v) if dataclasses.is_dataclass(hints[k]) else v for k, v in data.items()})

