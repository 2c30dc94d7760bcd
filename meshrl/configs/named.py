"""The named configs `meshrl train --config NAME` starts from: the demos, the smoke run the tests train,
the cluster examples and the benches' workloads. Registered in meshrl/configs/__init__.py's CONFIGS."""

from meshrl.configs import Config, ControllerConfig, ModelConfig, register
from meshrl.configs.lr_schedule import LrScheduleConfig
from meshrl.models.lora import LoraConfig


@register
def sum_digits_smollm2_v1() -> Config:
    """The demo's settings until 2026-11-26 (lr 2e-5, 0.2 of reward for the format alone): the base whose
    settings `meshrl study demo-settings` changes one at a time, and of the SmolLM2 demos of other tasks."""
    config = Config()
    config.trainer.lr = 2e-5
    config.trainer.mini_batches = 2  # two updates per step: the format is learnt in about half the steps
    config.controller.eval_every = 5
    return config


@register
def sum_digits_smollm2() -> Config:
    """The demo: SmolLM2-135M learns to answer one-digit sums in the requested 'Answer: N' format. Its
    settings come from `meshrl study demo-settings` (docs/studies.md): no reward for the format alone, so
    only a right sum pays and a tagged number of the question does not; a learning rate of 7e-5 for the
    first half, decaying linearly to 7e-6 over the second (a constant one overshoots once the format is
    learnt); a reply cut off at max_tokens scores 0, so the model stops after its answer; and a step
    trains only groups with a learning signal, more prompts sampled in place of the others (DAPO's dynamic
    sampling): while the untrained model tags a right sum in 1 sampled reply of 100, a step of 8 prompts
    has 0 to 2 such groups."""
    config = sum_digits_smollm2_v1()
    config.sum_digits.format_weight = 0.0
    config.trainer.lr = 7e-5
    config.trainer.lr_schedule = LrScheduleConfig(decay="linear", decay_ratio=0.5, min_lr_factor=0.1)
    config.grader.zero_truncated = True
    config.controller.drop_equal_reward_groups = True
    return config


@register
def sum_digits_smollm2_lora() -> Config:
    """The demo with a LoRA adapter of rank 16 on the frozen base (docs/training.md: LoRA): 10 times the
    full fine-tune's learning rate, as LoRA usually needs; only the adapter is published."""
    config = sum_digits_smollm2_v1()
    config.trainer.lora = LoraConfig(rank=16, alpha=32.0)
    config.trainer.lr = 2e-4
    return config


@register
def zorplex_smollm2() -> Config:
    """The tool-use demo: SmolLM2-135M looks up made-up words' values over several turns (level 1, one
    worked example in the opening) and learns to do it reliably. Evaluated on sampled answers (mean@4
    at temperature 1): greedy, the untrained model already gets most of them right."""
    config = sum_digits_smollm2_v1()
    config.task = "zorplex"
    config.generator.max_tokens = 32
    config.controller.max_turns = 3
    config.controller.eval_temperature, config.controller.eval_samples = 1.0, 4
    config.checkpoint.every = 0
    return config


@register
def reasoning_gym_smollm2() -> Config:
    """SmolLM2-135M on reasoning-gym's chain_sum (two one-digit terms), its answer after "Answer:": the
    untrained model never gave one in <answer> tags (0 of 704 sampled replies over 11 steps of this
    config with the tags, once the instruction's own tags repeated were not counted), and the format
    pays at first, as in the demo."""
    config = sum_digits_smollm2_v1()
    config.task = "reasoning_gym"
    config.reasoning_gym.datasets = "chain_sum"
    config.reasoning_gym.dataset_args = '{"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}'
    config.reasoning_gym.answer_format = "line"
    config.reasoning_gym.format_weight = 0.2
    return config


def _async(config: Config) -> Config:
    """Generation on core 0, training on core 1, the generator sampling one step ahead of the trainer."""
    config.controller.max_policy_age = 1
    config.generator.cpus, config.generator.num_threads = "0", 1
    config.trainer.cpus, config.trainer.num_threads = "1", 1
    return config


@register
def sum_digits_smollm2_async() -> Config:
    """The demo, trained asynchronously: staleness at most one step, one core per role."""
    return _async(sum_digits_smollm2())


@register
def smoke() -> Config:
    """Two steps of a tiny random model: the whole loop, fast (one thread a process: the tiny model gains
    nothing from more, and two runs side by side on two cores spend 7% less CPU)."""
    config = Config(model=ModelConfig(source="tiny"))
    config.controller = ControllerConfig(steps=2, prompts_per_step=2, group_size=4)
    config.generator.max_tokens = 16
    config.generator.num_threads = config.trainer.num_threads = config.reference.num_threads = 1
    config.sum_digits.eval_size = 8
    config.trainer.lr = 1e-3
    return config


def _two_hosts(config: Config, kind: str) -> Config:
    """The trainer on one host and the generator on another, weights over RDMA between them; the
    generator samples one step ahead (max_policy_age 1). The grader stays beside the controller. The model path and the run directory must be on a filesystem every host sees."""
    config.job.kind, config.job.hosts = kind, "trainer:1,generators:1"
    config.trainer.hosts, config.generator.hosts = "trainer", "generators"
    config.controller.max_policy_age = 1
    return config


@register
def sum_digits_smollm2_slurm() -> Config:
    """The demo on a Slurm cluster: trainer and generator on a GPU node each (Monarch's SlurmJob)."""
    config = _two_hosts(sum_digits_smollm2(), "slurm")
    config.job.slurm.gpus_per_node = 1
    config.job.slurm.time_limit = "01:00:00"
    return config


@register
def sum_digits_smollm2_kubernetes() -> Config:
    """The demo on Kubernetes: trainer and generator in a pod each (Monarch's KubernetesJob)."""
    config = _two_hosts(sum_digits_smollm2(), "kubernetes")
    config.job.kubernetes.gpus_per_pod = 1
    return config


@register
def bench_smoke() -> Config:
    """`meshrl bench sync-vs-async` on the tiny model: both modes in a few minutes."""
    config = smoke()
    config.controller = ControllerConfig(steps=8, prompts_per_step=4, group_size=8)
    config = _async(config)
    config.generator.max_tokens = 32
    config.sum_digits.eval_size = 8
    return config


@register
def bench_smollm2() -> Config:
    """`meshrl bench sync-vs-async` on the demo workload."""
    config = _async(sum_digits_smollm2())
    config.controller.eval_every = 0
    return config
