"""The generator role's config section (`generator`): what any generator implementation is given (`impl` names
the class), its checks, its choices and how training rollouts are sampled. A module of its own beside
meshrl/actors/generator.py, which imports Monarch and vLLM. A run's config (meshrl/configs) composes it;
values that depend on other sections are filled in once by meshrl.configs.resolve before anything is spawned."""

from dataclasses import dataclass, field

from meshrl.actors.engine import EngineConfig
from meshrl.checks import at_least, one_of
from meshrl.types import Sampling

WEIGHT_UPDATES = ("drain", "in_flight", "recompute")  # how a generator replica loads a new version
# `generator.impl`'s short names: vLLM, or the trainer's own torchtitan model (meshrl/actors/torch_generator.py)
IMPLEMENTATIONS = {"vllm": "meshrl.actors.generator:VLLMGenerator",
                   "torch": "meshrl.actors.torch_generator:TorchGenerator"}


def generator_impl(impl: str) -> str:
    """The "module:Class" `generator.impl` names: vllm, torch, or the user's own."""
    return IMPLEMENTATIONS.get(impl, impl)


@dataclass
class GeneratorConfig:
    """The rollout generator: vLLM in process, or the trainer's own model (`impl torch`)."""

    impl: str = "meshrl.actors.generator:VLLMGenerator"  # the actor class: vllm | torch (the trainer's torchtitan model, meshrl/actors/torch_generator.py) | module:Class
    max_tokens: int = 48  # tokens per completion at most
    temperature: float = 1.0  # sampling temperature of training rollouts
    max_model_len: int = 512  # the context length (prompt and completion)
    dtype: str = "auto"  # the generator's weight dtype (with impl torch and exact: its autocast, weights float32): auto (bfloat16 on a GPU with bf16, and on a CPU whose bf16 matmuls measure faster than float32 at the run's start; else float32) | bfloat16 | float32
    memory_fraction: float = 0.0  # vLLM's gpu_memory_utilization; 0: from the GPU plan (0.9 of a GPU to itself, a share of one it shares), on the CPU 0.2 of host memory
    kv_cache_gib: int = 1  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE); impl torch: its KV cache on any device, as many sequences as it holds at max_model_len (256 at most)
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
    exact: bool = False  # impl torch: each completion's behaviour logprobs re-scored in the trainer's numerics, one sequence at a time (meshrl/exact.py; turns trainer.per_sequence on, publishes float32): equal to the trainer's recomputation bit for bit; single-turn tasks
    prefill_tokens: int = 256  # impl torch: prompt tokens prefilled per engine step (chunked prefill; requests decoding meanwhile go on)

    def check(self) -> None:
        at_least(self, "generator", replicas=1, max_tokens=1, num_threads=1, tensor_parallel_size=1, max_restarts=0,
                 sticky_slack=0, prefill_tokens=1)
        torch_impl = generator_impl(self.impl) == IMPLEMENTATIONS["torch"]
        if self.exact and not torch_impl:
            raise ValueError("generator.exact samples in the trainer's own numerics: it needs generator.impl torch")
        if self.exact and self.weight_update not in ("auto", "drain"):
            raise ValueError("generator.exact re-scores a completion under the weights that sampled all of it: "
                             f"generator.weight_update drain (or auto), not {self.weight_update}")
        if torch_impl and self.tensor_parallel_size > 1:
            raise ValueError("generator.impl torch runs one device a replica: generator.tensor_parallel_size 1")
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
