"""Each actor role's config section: what any implementation of the role is given (`impl` names the
class, so one can be swapped without touching the rest), its fields' checks and its choices, defined
once. The implementations read theirs from here (meshrl/actors/generator.py, grader.py, judge.py,
trainer.py, reference.py, replay_buffer.py); the run's config (meshrl/configs) composes them.

A module of its own beside them, not inside them: the actors import Monarch (and the generator vLLM),
and the run's config is read where neither may load (the command line, `meshrl check gpu` on a machine
that stands in for Monarch). Values that depend on other sections (`generator.weight_update auto`, the lr
schedule's length, ...) are filled in once, by meshrl.configs.resolve, before anything is spawned.
"""

from dataclasses import dataclass, field

from meshrl.actors.engine import EngineConfig
from meshrl.checks import AUTO_ON_OFF, at_least, one_of
from meshrl.losses import LossConfig
from meshrl.lr_schedule import LrScheduleConfig
from meshrl.models.lora import LoraConfig
from meshrl.models.memory import CHECKPOINTING, REFERENCE_DTYPES
from meshrl.types import Sampling

WEIGHT_UPDATES = ("drain", "in_flight", "recompute")  # how a generator replica loads a new version


def check_rubric(rubric: str) -> None:
    """A judge's rubric must name the reply and only the fields a judge is given."""
    try:
        rubric.format(question="", reference="", reply="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"grader.judge.rubric may use only {{question}}, {{reference}} and {{reply}} ({e!r})") from None
    if "{reply}" not in rubric:
        raise ValueError("grader.judge.rubric must show the judge the {reply}")


@dataclass
class GeneratorConfig:
    """The rollout generator (vLLM in process)."""

    impl: str = "meshrl.actors.generator:VLLMGenerator"  # the actor class, module:Class
    max_tokens: int = 48  # tokens per completion at most
    temperature: float = 1.0  # sampling temperature of training rollouts
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
    weight_update: str = "auto"  # how a replica loads a new version: drain (waits for its running requests) | in_flight (between engine steps, requests go on) | recompute (in flight, running prefixes recomputed); auto: drain when controller.max_policy_age is 0, else in_flight (meshrl.configs.resolve)
    engine: EngineConfig = field(default_factory=EngineConfig)  # vLLM's options per device (meshrl/actors/engine.py)

    def check(self) -> None:
        at_least(self, "generator", replicas=1, max_tokens=1, num_threads=1, tensor_parallel_size=1, max_restarts=0,
                 sticky_slack=0)
        one_of(self, "generator", weight_update=("auto",) + WEIGHT_UPDATES,
               routing=("sticky", "least_loaded"))
        if not 0 <= self.memory_fraction <= 1:
            raise ValueError(f"generator.memory_fraction must be in [0, 1] (0: planned), not {self.memory_fraction:g}")
        self.engine.check()
        if self.temperature <= 0:
            raise ValueError("generator.temperature must be above 0: greedy sampling gives one answer per prompt")
        if ";" in self.cpus and len(self.cpus.split(";")) != self.replicas:
            raise ValueError(f"generator.cpus {self.cpus!r} names one set of cores per replica: it needs "
                             f"{self.replicas} sets separated by ';'")

    def sampling(self, n: int = 1) -> Sampling:
        """How training rollouts are sampled: `n` completions at `temperature` from the whole distribution
        (no top-p: the trainer's logprobs are of the whole distribution at that temperature)."""
        return Sampling(n=n, temperature=self.temperature, max_tokens=self.max_tokens)


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
            check_rubric(self.rubric)


@dataclass
class GraderConfig:
    """Scores completions with the task's reward function (or a judge model, with JudgeGrader)."""

    impl: str = "meshrl.actors.grader:TaskGrader"  # the actor class, module:Class
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
        one_of(self, "trainer", activation_checkpointing=CHECKPOINTING, bf16_all_gather=AUTO_ON_OFF)
        self.loss.check()
        self.lora.check()
        self.lr_schedule.check()


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

    def fresh_groups(self, prompts_per_step: int) -> int:
        """Groups generated for each batch: prompts_per_step, or with `replay` its fresh share (at least one)."""
        if self.impl != "replay":
            return prompts_per_step
        return max(1, round(prompts_per_step * self.fresh_fraction))
