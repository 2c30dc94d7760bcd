"""The reference role's config section (`reference`, the frozen initial policy of the KL penalty): what any
reference implementation is given, its checks. A module of its own beside meshrl/actors/reference.py, which
imports Monarch. A run's config (meshrl/configs) composes it; values that depend on other sections are filled
in once by meshrl.configs.resolve before anything is spawned."""

from dataclasses import dataclass

from meshrl.checks import at_least, one_of
from meshrl.models.memory import REFERENCE_DTYPES


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
    timeout_s: float = 1800.0  # one call, per micro-batch it carries (their logprobs): past it the reference is restarted
    max_restarts: int = 3  # a dead or hung reference is restarted (meshrl/restarts.py); more failures than this in a row, each within controller.restart_window_s of its start, stop the run

    def check(self) -> None:
        at_least(self, "reference", ranks=1, num_threads=1, max_restarts=0)
        one_of(self, "reference", dtype=REFERENCE_DTYPES)
