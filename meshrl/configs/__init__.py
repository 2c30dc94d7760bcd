"""Named training configs: nested dataclasses, chosen by name and overridden with dotted flags.

`meshrl train --config smoke --trainer.lr 1e-5 --controller.steps=3`
Each actor role names its implementation ("module:Class"), so one can be swapped from the
command line without touching the controller.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Callable

from meshrl.tasks.sum_digits import SumDigitsConfig


class ConfigError(ValueError):
    pass


@dataclass
class ModelConfig:
    # "smollm2": the embedded SmolLM2-135M-Instruct; "tiny": a small random Llama with the same
    # tokenizer (for tests); anything else: a local HF checkpoint directory.
    source: str = "smollm2"


@dataclass
class GeneratorConfig:
    impl: str = "meshrl.actors.generator:VLLMGenerator"
    max_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    max_model_len: int = 512
    dtype: str = "bfloat16"
    memory_fraction: float = 0.2  # vLLM's gpu_memory_utilization; on CPU a share of host memory
    kv_cache_gib: int = 1
    num_threads: int = 2
    cpus: str = ""  # pin to these cores ("0", "0-1", "0,2"); "" leaves placement to the OS
    seed: int = 0


@dataclass
class GraderConfig:
    impl: str = "meshrl.actors.grader:Grader"


@dataclass
class LossConfig:
    """The policy loss (see meshrl/losses.py and the README's table)."""

    name: str = "ppo_clip"  # ppo_clip | dapo | gspo | cispo
    clip_eps: float = 0.2  # ppo_clip: symmetric clip range of the ratio
    clip_eps_low: float = 0.2  # dapo: lower clip range
    clip_eps_high: float = 0.28  # dapo (clip-higher) and cispo (upper bound of the IS weight)
    gspo_clip_eps_low: float = 3e-4  # gspo clips the sequence ratio, which stays close to 1
    gspo_clip_eps_high: float = 4e-4
    # The behaviour weight pi_old / pi_behaviour corrects for the generator's numerics and staleness:
    # per "token" or per "sequence" (the product over its tokens), truncated at tis_cap (0: not truncated).
    tis_cap: float = 2.0
    tis_level: str = "token"
    aggregation: str = "token_mean"  # token_mean | seq_mean | constant (Dr. GRPO); gspo is always seq_mean
    constant_norm: int = 48  # aggregation=constant: the tokens per sequence to divide by
    kl_coef: float = 0.0  # k3 KL penalty to the frozen reference model (starts a ReferenceModel actor)
    entropy_coef: float = 0.0  # entropy bonus


@dataclass
class TrainerConfig:
    impl: str = "meshrl.actors.trainer:TitanTrainer"
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    loss: LossConfig = field(default_factory=LossConfig)
    micro_batch_size: int = 16  # sequences per forward/backward pass (gradients accumulate)
    # Optimizer updates per step: the step's episodes are split into this many mini-batches, each its
    # own update, all clipped against the policy that started the step (verl's PPO mini-batches).
    mini_batches: int = 1
    bf16_autocast: bool = True
    num_threads: int = 2
    cpus: str = ""  # pin to these cores ("1", "2-3"); "" leaves placement to the OS
    seed: int = 0


@dataclass
class WeightSyncConfig:
    slots: int = 2  # versions the trainer's ring holds; readers of the newest never race the writer
    transport: str = "auto"  # "auto": shared memory on the trainer's host, else "rdma"
    chunk_mb: int = 16  # RDMA reads a slot in chunks of this size, concurrently
    checksums: bool = False  # CRC32 every published version and verify it on load (stress tests)


@dataclass
class ReferenceConfig:
    """The frozen initial policy that the KL penalty pulls toward (used when trainer.loss.kl_coef > 0)."""

    impl: str = "meshrl.actors.reference:ReferenceModel"
    bf16_autocast: bool = True
    num_threads: int = 2
    cpus: str = ""


@dataclass
class ReplayBufferConfig:
    impl: str = "meshrl.actors.replay_buffer:ReplayBuffer"
    # The staleness bound, in optimizer steps: episodes sampled from a policy more than this many
    # versions behind the trainer are evicted, never trained on. 0 is synchronous training; 1 lets
    # the generators sample the next batch while the trainer trains on this one.
    max_policy_age: int = 0


@dataclass
class ControllerConfig:
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8
    advantage: str = "grpo"  # grpo | dr_grpo | rloo (meshrl/advantages.py)
    drop_equal_reward_groups: bool = False  # DAPO's dynamic sampling: groups without signal are not trained
    max_sample_rounds: int = 4  # with drop_equal_reward_groups: prompt blocks sampled at most to fill a batch
    eval_every: int = 0  # 0: evaluate only before the first and after the last step
    # Eval rates are means over `eval_samples` completions per eval prompt at `eval_temperature`
    # (greedy by default; e.g. 1.0 and 4 for the mean@4 of sampled answers).
    eval_temperature: float = 0.0
    eval_samples: int = 1
    advantage_eps: float = 1e-6


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: str = "sum_digits"
    sum_digits: SumDigitsConfig = field(default_factory=SumDigitsConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    grader: GraderConfig = field(default_factory=GraderConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    replay_buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)

    @property
    def task_config(self):
        """The section named by `task`: each task has its own (e.g. `sum_digits`)."""
        return getattr(self, self.task, None)


CONFIGS: dict[str, Callable[[], Config]] = {}


def register(fn: Callable[[], Config]) -> Callable[[], Config]:
    CONFIGS[fn.__name__] = fn
    return fn


@register
def sum_digits_smollm2() -> Config:
    """The demo: SmolLM2-135M learns to answer two-digit sums in the requested 'Answer: N' format."""
    config = Config()
    config.trainer.lr = 2e-5
    config.trainer.mini_batches = 2  # two updates per step: the format is learnt in about half the steps
    config.controller.eval_every = 5
    return config


def _async(config: Config) -> Config:
    """Generation on core 0, training on core 1, the generator sampling one step ahead of the trainer."""
    config.replay_buffer.max_policy_age = 1
    config.generator.cpus, config.generator.num_threads = "0", 1
    config.trainer.cpus, config.trainer.num_threads = "1", 1
    return config


@register
def sum_digits_smollm2_async() -> Config:
    """The demo, trained asynchronously: staleness at most one step, one core per role."""
    return _async(sum_digits_smollm2())


@register
def smoke() -> Config:
    """Two steps of a tiny random model: the whole loop, fast."""
    config = Config(model=ModelConfig(source="tiny"))
    config.controller = ControllerConfig(steps=2, prompts_per_step=2, group_size=4)
    config.generator.max_tokens = 16
    config.sum_digits.eval_size = 8
    config.trainer.lr = 1e-3
    return config


def load_config(name: str, overrides: list[str]) -> Config:
    if name not in CONFIGS:
        raise ConfigError(f"unknown config {name!r}; known: {', '.join(sorted(CONFIGS))}")
    config = CONFIGS[name]()
    apply_overrides(config, overrides)
    return config


def apply_overrides(config: Config, args: list[str]) -> None:
    """Apply `--a.b value` / `--a.b=value` pairs in order."""
    args = list(args)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise ConfigError(f"bad override {arg!r}: expected --section.key VALUE")
        key, has_value, value = arg[2:].partition("=")
        if not has_value:
            if not args or args[0].startswith("--"):
                raise ConfigError(f"override --{key} has no value")
            value = args.pop(0)
        set_value(config, key, value)


def set_value(config, dotted: str, text: str) -> None:
    *path, name = dotted.split(".")
    target = config
    for part in path:
        target = getattr(target, part, None)
        if not dataclasses.is_dataclass(target):
            raise ConfigError(f"unknown config key {dotted!r}")
    fields = {f.name: f for f in dataclasses.fields(target)}
    if name not in fields or dataclasses.is_dataclass(getattr(target, name)):
        raise ConfigError(f"unknown config key {dotted!r}")
    kind = typing.get_type_hints(type(target))[name]
    setattr(target, name, _parse(dotted, text, kind))


def _parse(key: str, text: str, kind: type):
    if isinstance(kind, types.UnionType) or kind not in (bool, int, float, str):
        raise ConfigError(f"config key {key!r} cannot be set from the command line")
    if kind is bool:
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ConfigError(f"bad value for {key}: {text!r} is not a boolean")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"bad value for {key}: {text!r} is not {kind.__name__}") from None


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


@register
def bench_smoke() -> Config:
    """`meshrl bench sync-vs-async` on the tiny model: both modes in a few minutes."""
    config = _async(smoke())
    config.controller = ControllerConfig(steps=8, prompts_per_step=4, group_size=8)
    config.generator.max_tokens = 32
    config.sum_digits.eval_size = 8
    return config


@register
def bench_smollm2() -> Config:
    """`meshrl bench sync-vs-async` on the demo workload."""
    config = _async(sum_digits_smollm2())
    config.controller.eval_every = 0
    return config
