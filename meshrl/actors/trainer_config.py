"""The trainer role's config section (`trainer`, with its loss, lr schedule and LoRA sections): what any trainer
implementation is given, its checks and choices. A module of its own beside meshrl/actors/trainer.py, which
imports Monarch. A run's config (meshrl/configs) composes it; values that depend on other sections are filled
in once by meshrl.configs.resolve before anything is spawned."""

from dataclasses import dataclass, field

from meshrl.checks import AUTO_ON_OFF, at_least, one_of
from meshrl.losses import LossConfig
from meshrl.lr_schedule import LrScheduleConfig
from meshrl.models.lora import LoraConfig
from meshrl.models.memory import CHECKPOINTING


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
    per_sequence: bool = False  # score each sequence alone at its own length (meshrl/exact.py): its logprobs independent of what it is batched with, as generator.exact re-scores them (set on by it); slower: no batching
    logprob_chunk_tokens: int = 1024  # the LM head, log-softmax and entropy this many positions at a time, each chunk recomputed in the backward (no [tokens, vocabulary] fp32 logits); 0: all at once
    device: str = "auto"  # auto (planned GPUs if the hosts have some, else the CPU) | cpu | cuda | cuda:N (per local rank: "cuda:4;cuda:5")
    ranks: int = 1  # trainer processes (data parallel, the model sharded with FSDP2 over them)
    num_threads: int = 2  # torch threads of each rank
    cpus: str = ""  # pin to these cores ("1", "2-3"; per rank: "0;1"); "" leaves placement to the OS
    seed: int = 0  # torch seed
    hosts: str = ""  # the job.hosts group the ranks go on, spread evenly over its hosts; "": the controller's host
    timeout_s: float = 1800.0  # one trainer call (per micro-batch it carries, an optimizer step, a publish, the save): past it the trainer is restarted
    max_bad_steps: int = 3  # steps in a row with a NaN or infinite loss or gradient norm (not applied) before the run stops
    max_restarts: int = 3  # a dead or hung trainer is restarted from the newest checkpoint and the batches trained since (meshrl/restarts.py); more failures than this in a row, each within controller.restart_window_s of its start, stop the run

    def check(self) -> None:
        at_least(self, "trainer", mini_batches=1, micro_batch_size=1, micro_batch_tokens=0, ranks=1, num_threads=1,
                 max_bad_steps=1, max_restarts=0, logprob_chunk_tokens=0)
        one_of(self, "trainer", activation_checkpointing=CHECKPOINTING, bf16_all_gather=AUTO_ON_OFF)
        self.loss.check()
        self.lora.check()
        self.lr_schedule.check()
