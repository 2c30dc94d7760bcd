"""Named training configs: nested dataclasses, chosen by name and overridden with dotted flags.

`meshrl train --config smoke --trainer.lr 1e-5 --controller.steps=3` (parsed by tyro, overrides.py);
`meshrl train --config smoke --help` lists every field with the comment beside it here.
Each actor role names its implementation ("module:Class"), so one can be swapped from the
command line without touching the controller.
"""

import dataclasses
import importlib
import typing
from dataclasses import dataclass, field
from typing import Callable

from meshrl.advantages import ESTIMATORS, STEP_WISE
from meshrl.configs.engine import EngineConfig
from meshrl.configs.job import JobConfig
from meshrl.configs.lr_schedule import LrScheduleConfig
from meshrl.configs.overrides import ConfigError, apply_overrides
from meshrl.configs.serve import ServeConfig
from meshrl.models.lora import LoraConfig
from meshrl.models.memory import CHECKPOINTING, ON_OFF, REFERENCE_DTYPES
from meshrl.tasks.dataset import DatasetConfig
from meshrl.tasks.openenv import OpenEnvConfig
from meshrl.tasks.reasoning_gym import ReasoningGymConfig
from meshrl.tasks.sum_digits import SumDigitsConfig
from meshrl.tasks.zorplex import ZorplexConfig

__all__ = ["CONFIGS", "Config", "ConfigError", "from_dict", "load_config", "register", "resumable_overrides",
           "to_dict"]


def at_least(section, name: str, **minimums) -> None:
    """ValueError naming the first of `section`'s fields below its minimum."""
    for field_name, minimum in minimums.items():
        if getattr(section, field_name) < minimum:
            raise ValueError(f"{name}.{field_name} must be at least {minimum}, not {getattr(section, field_name)}")


def one_of(section, name: str, **choices) -> None:
    """ValueError naming the first of `section`'s fields that is not one of its choices."""
    for field_name, known in choices.items():
        if getattr(section, field_name) not in known:
            raise ValueError(f"unknown {name}.{field_name} {getattr(section, field_name)!r}; known: {', '.join(known)}")


@dataclass
class ModelConfig:
    """The policy's starting checkpoint."""

    source: str = "smollm2"  # smollm2 (embedded SmolLM2-135M-Instruct) | tiny, tiny_qwen3, tiny_qwen3_moe (random, tests) | an HF checkpoint dir (Llama, Qwen3, Qwen3-MoE)
    chat_template: str = "auto"  # auto (the checkpoint's own) | hermes (meshrl's Hermes-style template with tools, for SmolLM2 and other ChatML models) | qwen3_training (Qwen3's, keeping every <think>: prefix-preserving) | a .jinja file
    tool_parser: str = "auto"  # vLLM's tool-call parser that reads the model's tool calls (hermes, qwen3_xml, llama3_json, ...); auto: the model family's (hermes)


@dataclass
class GeneratorConfig:
    """The rollout generator (vLLM in process)."""

    impl: str = "meshrl.actors.generator:VLLMGenerator"  # the actor class, module:Class
    max_tokens: int = 48  # tokens per completion at most
    temperature: float = 1.0  # sampling temperature of training rollouts
    top_p: float = 1.0  # nucleus sampling of training rollouts: must stay 1 (the trainer's logprobs are of the whole distribution at `temperature`)
    max_model_len: int = 512  # vLLM's context length
    dtype: str = "auto"  # vLLM's weight dtype: auto (bfloat16 on a GPU with bf16, and on a CPU whose bf16 matmuls measure faster than float32 at the run's start; else float32) | bfloat16 | float32
    memory_fraction: float = 0.0  # vLLM's gpu_memory_utilization; 0: from the GPU plan (0.9 of a GPU to itself, a share of one it shares), on the CPU 0.2 of host memory
    kv_cache_gib: int = 1  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
    num_threads: int = 2  # torch/OpenMP threads of each replica
    cpus: str = ""  # pin to these cores ("0", "0-1", "0,2"; per replica: "0;1"); "" leaves placement to the OS
    tensor_parallel_size: int = 1  # GPUs of each replica (vLLM's tensor parallelism)
    devices: str = ""  # each replica's CUDA_VISIBLE_DEVICES ("0,1;2,3": per replica); "": planned from tensor_parallel_size and job.gpus_per_host (meshrl/runtime/gpu_plan.py)
    seed: int = 0  # vLLM's engine seed (replica i uses seed + i; with request_seeds every replica uses seed)
    request_seeds: bool = False  # seed each request from `seed`, its prompt and the policy version: the same samples whatever else is batched with it (reproducible runs; single-turn tasks only: a multi-turn group's conversations would all sample alike); off by default because vLLM on the CPU fails on a seeded request whose prompt it prefills in parts (more prompt tokens waiting than one engine step takes)
    replicas: int = 1  # generator actors, each on its own proc mesh; groups go to the least loaded
    routing: str = "sticky"  # where a multi-turn group's later turns go: sticky (to the replica of its previous turn, whose prefix cache holds the conversation, while it serves and is at most sticky_slack calls busier than the least loaded) | least_loaded
    sticky_slack: int = 2  # sticky routing: calls in flight a group's replica may have beyond the least-loaded replica's before the group moves on
    max_restarts: int = 3  # a replica failing more than this many times in a row, each within controller.restart_window_s of its start, stops the run (a crash loop)
    hosts: str = ""  # the job.hosts group the replicas go on, round-robin over its hosts; "": the controller's host
    timeout_s: float = 600.0  # one group's generation: past it the replica is replaced
    start_timeout_s: float = 1800.0  # a replica's start (vLLM loading the model, from shared storage for a big one, and capturing CUDA graphs): past it the replica is replaced (0: no limit)
    weight_update: str = "auto"  # how a replica loads a new version: drain (waits for its running requests) | in_flight (between engine steps, requests go on) | recompute (in flight, running prefixes recomputed); auto: drain when controller.max_policy_age is 0, else in_flight
    engine: EngineConfig = field(default_factory=EngineConfig)  # vLLM's options per device (meshrl/configs/engine.py)

    def check(self) -> None:
        at_least(self, "generator", replicas=1, max_tokens=1, num_threads=1, tensor_parallel_size=1, max_restarts=0,
                 sticky_slack=0)
        if self.top_p != 1:
            raise ValueError(f"generator.top_p {self.top_p:g}: training samples must come from the whole "
                             "distribution at generator.temperature, which the trainer's logprobs follow; keep it 1 "
                             "(controller.eval_top_p sets eval's)")
        one_of(self, "generator", weight_update=("auto", "drain", "in_flight", "recompute"),
               routing=("sticky", "least_loaded"))
        if not 0 <= self.memory_fraction <= 1:
            raise ValueError(f"generator.memory_fraction must be in [0, 1] (0: planned), not {self.memory_fraction:g}")
        self.engine.check()
        if self.temperature <= 0:
            raise ValueError("generator.temperature must be above 0: greedy sampling gives one answer per prompt")
        if ";" in self.cpus and len(self.cpus.split(";")) != self.replicas:
            raise ValueError(f"generator.cpus {self.cpus!r} names one set of cores per replica: it needs "
                             f"{self.replicas} sets separated by ';'")


@dataclass
class JudgeConfig:
    """The model-judged grader (grader.impl meshrl.actors.judge:JudgeGrader): a language model, served
    by vLLM in each grader replica, says whether a reply answers the question."""

    model: str = "smollm2"  # the judge: smollm2 (embedded) | an HF checkpoint directory
    rubric: str = ""  # its prompt, with {question}, {reference} and {reply}, asking for a yes or no; "": the built-in one
    rule_weight: float = 0.0  # the task's own reward mixed in: reward = (1 - w) * P(yes) + w * task reward
    max_model_len: int = 1024  # vLLM's context length for the judge
    dtype: str = "auto"  # as generator.dtype
    memory_fraction: float = 0.2  # vLLM's gpu_memory_utilization
    kv_cache_gib: int = 1  # vLLM's CPU KV cache
    num_threads: int = 1  # torch/OpenMP threads of each replica's judge
    cpus: str = ""  # pin each grader replica to these cores; "" leaves placement to the OS
    devices: str = ""  # CUDA_VISIBLE_DEVICES of the grader replicas ("": what the process sees)

    def check(self) -> None:
        if not 0 <= self.rule_weight <= 1:
            raise ValueError(f"grader.judge.rule_weight must be in [0, 1], not {self.rule_weight:g}")
        if self.rubric:
            from meshrl.actors.judge import check_rubric

            check_rubric(self.rubric)


@dataclass
class GraderConfig:
    """Scores completions with the task's reward function (or a judge model, with JudgeGrader)."""

    impl: str = "meshrl.actors.grader:Grader"  # the actor class, module:Class
    replicas: int = 1  # grader actors; groups go to the least loaded
    max_restarts: int = 3  # a replica failing more than this many times in a row, each within controller.restart_window_s of its start, stops the run (a crash loop)
    hosts: str = ""  # the job.hosts group the replicas go on, round-robin over its hosts; "": the controller's host
    timeout_s: float = 300.0  # one group's grading: past it the replica is replaced
    zero_truncated: bool = False  # a completion cut off at generator.max_tokens scores 0 (its checks stay the task's): the model learns to end its reply (single-turn tasks)
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    def check(self) -> None:
        at_least(self, "grader", replicas=1, max_restarts=0)
        self.judge.check()


@dataclass
class LossConfig:
    """The policy loss (meshrl/losses.py, the table in docs/training.md). Each loss clips the ratio to the
    trainer's own pi_old and is weighted by pi_old / pi_behaviour, truncated at tis_cap."""

    name: str = "ppo_clip"  # ppo_clip | dapo | gspo | cispo
    clip_eps: float = 0.2  # ppo_clip: symmetric clip range of the ratio
    clip_eps_low: float = 0.2  # dapo: lower clip range
    clip_eps_high: float = 0.28  # dapo (clip-higher) and cispo (upper bound of the ratio)
    gspo_clip_eps_low: float = 3e-4  # gspo clips the sequence ratio, which stays close to 1
    gspo_clip_eps_high: float = 4e-4  # gspo: upper clip range of the sequence ratio
    tis_cap: float = 2.0  # truncate the behaviour weight pi_old / pi_behaviour here (0: not truncated)
    tis_level: str = "token"  # the behaviour weight per token | sequence (the product over its tokens)
    aggregation: str = "token_mean"  # token_mean | seq_mean | constant (Dr. GRPO); gspo is always seq_mean
    constant_norm: int = 48  # aggregation=constant: the tokens per sequence to divide by
    kl_coef: float = 0.0  # k3 KL penalty to the frozen reference model (starts a ReferenceModel actor)
    entropy_coef: float = 0.0  # entropy bonus

    def check(self) -> None:
        from meshrl.losses import check  # the menu of losses lives with them

        check(self)


@dataclass
class TrainerConfig:
    """The trainer (the checkpoint family's torchtitan model, AdamW)."""

    impl: str = "meshrl.actors.trainer:TitanTrainer"  # the actor class, module:Class
    lr: float = 1e-5  # AdamW learning rate (the peak, with a warmup or decay in lr_schedule)
    lr_schedule: LrScheduleConfig = field(default_factory=LrScheduleConfig)
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping by global norm
    loss: LossConfig = field(default_factory=LossConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    micro_batch_size: int = 16  # sequences per forward/backward pass (gradients accumulate)
    micro_batch_tokens: int = 0  # > 0: micro-batches filled up to this many padded positions instead, sequences sorted by length (less padding); 0: micro_batch_size sequences each
    mini_batches: int = 1  # optimizer updates per step: the step's episodes split in this many mini-batches
    bf16_autocast: bool = True  # forward in bf16 autocast where bf16 pays (a GPU with bf16; a CPU whose bf16 matmuls measure faster than fp32 at the run's start, as generator.dtype auto; fp32 elsewhere); master weights stay fp32
    activation_checkpointing: str = "auto"  # torchtitan's, per layer: off | full (recompute each layer's forward in the backward) | selective (keep every second matmul's output); auto: full on CUDA, off on the CPU (meshrl/models/memory.py)
    bf16_all_gather: str = "auto"  # FSDP2 all-gathers parameters in bf16 (gradients reduced in fp32, master weights fp32; ranks > 1): on | off; auto: on CUDA where the forward runs in bf16 autocast (it casts the norms and embedding too), off on the CPU
    logprob_chunk_tokens: int = 1024  # the LM head, log-softmax and entropy this many positions at a time, each chunk recomputed in the backward (no [tokens, vocabulary] fp32 logits); 0: all at once
    device: str = "auto"  # auto (planned GPUs if the hosts have some, else the CPU) | cpu | cuda | cuda:N (per local rank: "cuda:4;cuda:5")
    ranks: int = 1  # trainer processes (data parallel, the model sharded with FSDP2 over them)
    num_threads: int = 2  # torch threads of each rank
    cpus: str = ""  # pin to these cores ("1", "2-3"; per rank: "0;1"); "" leaves placement to the OS
    seed: int = 0  # torch seed
    hosts: str = ""  # the job.hosts group the ranks go on, spread evenly over its hosts; "": the controller's host
    timeout_s: float = 1800.0  # one trainer call (a micro-batch, an optimizer step, a publish, the save): past it the trainer is restarted
    max_bad_steps: int = 3  # steps in a row with a NaN or infinite loss or gradient norm (not applied) before the run stops
    max_restarts: int = 3  # a dead or hung trainer is restarted from the newest checkpoint and the batches trained since (meshrl/restarts.py); more failures than this in a row, each within controller.restart_window_s of its start, stop the run

    def check(self) -> None:
        at_least(self, "trainer", mini_batches=1, micro_batch_size=1, micro_batch_tokens=0, ranks=1, num_threads=1,
                 max_bad_steps=1, max_restarts=0, logprob_chunk_tokens=0)
        one_of(self, "trainer", activation_checkpointing=CHECKPOINTING, bf16_all_gather=ON_OFF)
        self.loss.check()
        self.lora.check()
        self.lr_schedule.check()


@dataclass
class WeightSyncConfig:
    """The versioned weight ring from the trainer to the generators."""

    slots: int = 2  # versions the trainer's ring holds; readers of the newest never race the writer
    transport: str = "auto"  # auto (shared memory on the trainer's host, else rdma) | shm | rdma | disk (no ring: the plain path, each version saved as a file and loaded from it; a baseline)
    chunk_mb: int = 16  # RDMA reads a slot in chunks of this size, concurrently
    checksums: bool = False  # CRC32 every published version and verify the generator's copy before loading it (stress tests); forced on where the ring's seqlock cannot be ordered (no libatomic fence on a CPU other than x86: meshrl/weight_sync/ordering.py)
    timeout_s: float = 300.0  # one generator's pull of a version (read and load): past it the replica is replaced
    dtype: str = "auto"  # what versions are published in: auto (the dtype the generators serve) | bfloat16 | float32
    poll_s: float = 0.05  # in_flight and recompute: how often a generating replica looks for a newer version
    verify: bool = False  # also write each version to disk_dir and have every generator load it a second time from there and compare every tensor vLLM holds (meshrl/weight_sync/verify.py)
    disk_dir: str = ""  # disk and verify: where the versions' files go, on a filesystem the trainer and the generators share; "": RUN_DIR/weights
    relay: str = "auto"  # a relay on each generator host pulls each version once from the trainer's rings and its replicas read it there over shared memory (meshrl/weight_sync/relay.py): auto (on where a generator host runs 2+ replicas and the generators are not on the trainer's hosts) | on | off
    staging: str = "auto"  # how a trainer rank's shard reaches its ring: auto (pinned on CUDA, pageable on the CPU) | pinned (device-to-host on a side CUDA stream into pinned memory, then a memcpy: the next forward and backward run meanwhile) | pageable (straight from the weights into the ring's memory, in the copy thread)

    def check(self) -> None:
        at_least(self, "weight_sync", slots=1, chunk_mb=1)
        one_of(self, "weight_sync", transport=("auto", "shm", "rdma", "disk"),
               dtype=("auto", "bfloat16", "float32", "float16"), staging=("auto", "pinned", "pageable"),
               relay=("auto", "on", "off"))
        if self.transport == "disk" and self.relay == "on":
            raise ValueError("weight_sync.relay republishes the trainer's ring: it needs one (weight_sync.transport "
                             "auto, shm or rdma)")
        if self.transport == "disk" and self.verify:
            raise ValueError("weight_sync.verify checks the ring's loads against the disk path: it needs a ring "
                             "(weight_sync.transport auto, shm or rdma)")


@dataclass
class ReferenceConfig:
    """The frozen initial policy that the KL penalty pulls toward (used when trainer.loss.kl_coef > 0)."""

    impl: str = "meshrl.actors.reference:ReferenceModel"  # the actor class, module:Class
    bf16_autocast: bool = True  # forward in bf16 autocast where bf16 pays (as the trainer's)
    dtype: str = "auto"  # its frozen weights: bfloat16 | float32; auto: bfloat16 where its forward runs in bf16 autocast
    device: str = "auto"  # auto (planned GPUs if the hosts have some, else the CPU) | cpu | cuda | cuda:N (per local rank: "cuda:4;cuda:5")
    ranks: int = 1  # processes, the model sharded with FSDP2 over them (as the trainer's)
    num_threads: int = 2  # torch threads of each rank
    cpus: str = ""  # pin to these cores ("1"; per rank: "0;1"); "" leaves placement to the OS
    hosts: str = ""  # the job.hosts group the ranks go on, spread evenly over its hosts; "": the controller's host
    timeout_s: float = 1800.0  # one call (a micro-batch's logprobs): past it the reference is restarted
    max_restarts: int = 3  # a dead or hung reference is restarted (meshrl/restarts.py); more failures than this in a row, each within controller.restart_window_s of its start, stop the run

    def check(self) -> None:
        at_least(self, "reference", ranks=1, num_threads=1, max_restarts=0)
        one_of(self, "reference", dtype=REFERENCE_DTYPES)


@dataclass
class ReplayBufferConfig:
    """The replay buffer between the controller and the trainer (meshrl/actors/replay_buffer.py): it
    holds the episodes of finished groups, collates each step's micro-batches, and hands them to the
    trainer's ranks."""

    impl: str = "fifo"  # fifo (each group trained once, in the batch it was generated for) | replay (groups trained again, see below) | module:Class
    max_reuse: int = 2  # replay: times a group may be trained again after its first, while within controller.max_policy_age
    fresh_fraction: float = 0.5  # replay: the share of each batch's prompts_per_step groups generated for it; old groups fill the rest
    priority: str = "reward_std"  # replay: which old groups first: reward_std (the widest spread of rewards: the most to learn) | newest
    cpus: str = ""  # pin its process to these cores; "" leaves placement to the OS
    hosts: str = ""  # the job.hosts group its process goes on; "": the controller's host
    timeout_s: float = 600.0  # one call (adding a group, a step's plan, a micro-batch): past it the buffer is restarted
    max_restarts: int = 3  # a dead or hung buffer is restarted empty, the groups it held for untrained batches generated again (meshrl/restarts.py); more failures than this in a row, each within controller.restart_window_s of its start, stop the run

    def check(self) -> None:
        at_least(self, "replay_buffer", max_restarts=0)
        if self.impl == "replay":
            if not 0 < self.fresh_fraction <= 1 or self.max_reuse < 1:
                raise ValueError("replay_buffer.fresh_fraction must be in (0, 1] and replay_buffer.max_reuse at least 1")
            one_of(self, "replay_buffer", priority=("reward_std", "newest"))


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
class CheckpointConfig:
    """Checkpoints for exact resume (meshrl/checkpoint.py; `meshrl train --resume RUN_DIR`)."""

    every: int = 10  # steps between checkpoints; one is also written after the last step and on Ctrl-C/SIGTERM (0: only those)
    keep: int = 1  # the newest checkpoints kept (0: all); a new one is complete before an old one goes

    def check(self) -> None:
        at_least(self, "checkpoint", every=0, keep=0)


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
        if self.weight_sync.verify and self.trainer.lora.rank:
            raise ValueError("weight_sync.verify compares the base weights vLLM holds, which an adapter leaves as "
                             "they are: not with trainer.lora")


CONFIGS: dict[str, Callable[[], Config]] = {}


def register(fn: Callable[[], Config]) -> Callable[[], Config]:
    CONFIGS[fn.__name__] = fn
    return fn


def load_config(name: str, overrides: list[str]) -> Config:
    """The named config with `--section.key VALUE` overrides applied (tyro: see overrides.py)."""
    if name not in CONFIGS:
        raise ConfigError(f"unknown config {name!r}; known: {', '.join(sorted(CONFIGS))}")
    return apply_overrides(CONFIGS[name](), overrides)


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


def from_dict(cls, data: dict):
    """The inverse of `to_dict` (a run's config.json back into its Config); unknown keys are an error."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := set(data) - set(fields):
        raise ConfigError(f"unknown config keys {sorted(unknown)} in {cls.__name__}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: from_dict(hints[k], v) if dataclasses.is_dataclass(hints[k]) else v for k, v in data.items()})


for _module in ("named", "qwen3"):
    importlib.import_module(f"meshrl.configs.{_module}")  # registers their configs
