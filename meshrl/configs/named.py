"""The named configs `meshrl train --config NAME` starts from (`CONFIGS`, `load_config`): the demos, the smoke
run the tests train, the cluster examples and the benches' workloads. Each is a fixed recipe
(tests/test_recipes.py pins them): a change of settings is a new name."""

from typing import Callable

from meshrl.configs import Config, ControllerConfig
from meshrl.configs.job import JobConfig
from meshrl.configs.overrides import ConfigError, apply_overrides
from meshrl.lr_schedule import LrScheduleConfig
from meshrl.models import ModelConfig
from meshrl.models.lora import LoraConfig

CONFIGS: dict[str, Callable[[], Config]] = {}


def register(fn: Callable[[], Config]) -> Callable[[], Config]:
    CONFIGS[fn.__name__] = fn
    return fn


def load_config(name: str, overrides: list[str]) -> Config:
    """The named config with `--section.key VALUE` overrides applied (tyro: see overrides.py)."""
    if name not in CONFIGS:
        raise ConfigError(f"unknown config {name!r}; known: {', '.join(sorted(CONFIGS))}")
    return apply_overrides(CONFIGS[name](), overrides)


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
    has 0 to 2 such groups. Chosen on validation by `meshrl study demo-heldout`."""
    return sum_digits_smollm2_v4()


@register
def sum_digits_smollm2_v2() -> Config:
    """The demo's settings on 2026-11-26 from 06:13 to 08:24 UTC (commits 7478ffa to e9c6ed4): v1 with a
    learning rate of 5e-5, constant, and no reward for the format alone. demo-settings' arm
    `lr_5e-5+format_0` trains this recipe; docs/performance.md's "constant-lr config" (516 s a run) is it."""
    config = sum_digits_smollm2_v1()
    config.trainer.lr = 5e-5
    config.sum_digits.format_weight = 0.0
    return config


@register
def sum_digits_smollm2_v3() -> Config:
    """The demo's settings on 2026-11-26 from 08:24 to 10:50 UTC (commits e9c6ed4 to f73a939): v1 with no
    reward for the format alone, a learning rate of 7e-5 decaying linearly over the second half of the
    updates to 0.1 of it, and a reply cut off at max_tokens scoring 0. demo-settings' arm
    `lr_7e-5+format_0+decay+zero_truncated` trains this recipe. Its figures (0.870 ± 0.057 at step 20,
    410-476 s a run) were measured before 2026-11-26 20:08 (dc3d144), when the schedule's last update
    was one decay step above the floor (1.0e-5, now 7e-6): a change of code, not of these settings."""
    config = sum_digits_smollm2_v1()
    config.sum_digits.format_weight = 0.0
    config.trainer.lr = 7e-5
    config.trainer.lr_schedule = LrScheduleConfig(decay="linear", decay_ratio=0.5, min_lr_factor=0.1)
    config.grader.zero_truncated = True
    return config


@register
def sum_digits_smollm2_v4() -> Config:
    """The demo's settings since 2026-11-26 10:50 UTC (f73a939): v3 training only groups with a learning
    signal (`controller.drop_equal_reward_groups`, DAPO's dynamic sampling). The same recipe as
    `sum_digits_smollm2` (the same recipe hash), spelt out here so that this name keeps it whatever the
    demo's name comes to hold; a figure of the demo cites this name. demo-settings' arm
    `demo_recipe+dynamic_sampling` trains it (0.966 ± 0.009 at step 20), measured before dc3d144's
    change of the schedule's last update (see v3). Built on v3, whose recipe tests/test_recipes.py pins."""
    config = sum_digits_smollm2_v3()
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
def zorplex_calc_smollm2() -> Config:
    """Zorplex level 2 with the calculator (issue 55): SmolLM2-135M looks up both words, adds their values
    with CALC[...] and answers, in at most five turns (four and one to spare). Untrained, it never looks
    both words up at level 2 (validation: 0 of 32 greedy conversations, 0 of 128 at temperature 0.7;
    greedy, it copies the example's last call, CALC, and loops on it), so a curriculum starts at level 1
    (train prompts 0-15, steps 1-2), level 2's share rising over prompts 16-63 (steps 3-8), level 2 only
    from step 9. No dynamic sampling: it draws more prompts a step, which would run the curriculum's
    prompt indices ahead of the steps (tried: level 2 took over by step 4, and no group had a signal).
    30 steps, evaluated at level 2 on 32 validation prompts (mean@4 at temperature 1) every 10; `meshrl
    study calculator` runs it on three seeds and scores the test split. A micro-batch of 8 conversations
    (16 four-turn ones took 7.8 GB of the trainer's memory)."""
    config = zorplex_smollm2()
    config.zorplex.level, config.zorplex.calculator, config.zorplex.eval_size = 2, True, 32
    config.zorplex.curriculum = "16-63"
    config.controller.max_turns, config.controller.steps, config.controller.eval_every = 5, 30, 10
    config.trainer.micro_batch_size = 8
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
    """The demo's first recipe (`sum_digits_smollm2_v1`), trained asynchronously: staleness at most one
    step, one core per role. v1 is the recipe of every figure measured with this name (2026-11-21 to 25:
    the sync-vs-async and replay studies, docs/training.md, docs/performance.md's publishing off the
    path); from 2026-11-26 06:13 until issue 52 it was built on whatever the demo then was, which no
    documented figure used."""
    return _async(sum_digits_smollm2_v1())


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
    """`meshrl bench sync-vs-async` on the demo's first recipe (`sum_digits_smollm2_v1`), the one the
    bench's figures in docs/training.md were measured with (2026-11-21 to 23), all but the one from
    before the decoupled loss, which ran the recipe before v1 (no config keeps it); from 2026-11-26
    06:13 until issue 52 it was built on whatever the demo then was, which no documented figure used."""
    config = _async(sum_digits_smollm2_v1())
    config.controller.eval_every = 0
    return config


# Qwen3: the tiny stand-in that the tests train, and GPU-cluster examples that start from a checkpoint the user
# downloads (docs/models.md).

@register
def qwen3_smoke() -> Config:
    """Two steps of a tiny random Qwen3 (dense): the whole loop on the Qwen3 family, fast."""
    config = smoke()
    config.model = ModelConfig(source="tiny_qwen3")
    return config


def _gsm8k(source: str) -> Config:
    """GSM8K (a JSONL of question and numeric answer, docs/models.md) on two 8-GPU Slurm nodes: one of generator
    replicas (vLLM), one of trainer ranks (FSDP2), weights over RDMA, sampling one step ahead."""
    config = Config(model=ModelConfig(source=source))
    config.task = "dataset"
    config.dataset.path, config.dataset.test_path = "gsm8k/train.jsonl", "gsm8k/test.jsonl"  # validation: 64 train rows
    config.dataset.prompt_field, config.dataset.answer_field, config.dataset.reward = "question", "answer", "numeric"
    config.controller = ControllerConfig(steps=200, prompts_per_step=64, group_size=16, max_policy_age=1,
                                         eval_every=20)
    config.generator.max_tokens, config.generator.max_model_len = 1024, 2048
    config.generator.memory_fraction = 0.85  # of each GPU
    config.generator.num_threads = config.trainer.num_threads = 4
    config.trainer.lr, config.trainer.micro_batch_size = 1e-6, 8
    config.job.kind, config.job.hosts = "slurm", "trainer:1,generators:1"
    config.trainer.hosts, config.generator.hosts = "trainer", "generators"
    config.job.slurm.gpus_per_node, config.job.slurm.time_limit = 8, "04:00:00"
    config.trainer.ranks = 8
    return config


@register
def qwen3_0_6b_gsm8k() -> Config:
    """Qwen3-0.6B on GSM8K: 8 generator replicas (one GPU each) and 8 trainer ranks."""
    config = _gsm8k("Qwen3-0.6B")
    config.generator.replicas = 8
    return config


@register
def qwen3_8b_gsm8k() -> Config:
    """Qwen3-8B on GSM8K: 4 generator replicas of tensor parallel size 2, and 8 trainer ranks, each
    reading only its shards of the checkpoint."""
    config = _gsm8k("Qwen3-8B")
    config.generator.replicas, config.generator.tensor_parallel_size = 4, 2
    config.controller.prompts_per_step = 32
    config.trainer.micro_batch_size = 2
    return config


def _one_node(config: Config) -> Config:
    """Every role on the one 8-GPU node `meshrl train` runs on (job.kind local): generator replicas from GPU 0 up,
    the trainer's ranks on the GPUs after them (meshrl/runtime/gpu_plan.py); `meshrl train --config NAME
    --plan-only` prints the placement and each GPU's memory (meshrl/runtime/memory_plan.py, docs/memory.md)."""
    config.job = JobConfig(kind="local", gpus_per_host=8, gpu_memory_gib=80.0, host_memory_gib=1024.0)
    config.trainer.hosts = config.generator.hosts = ""
    return config


@register
def qwen3_8b_gsm8k_one_node() -> Config:
    """Qwen3-8B on GSM8K on one node of 8 GPUs of 80 GB, fully fine-tuned: 4 generator replicas of tensor
    parallel size 1 on GPUs 0-3, 4 trainer ranks (FSDP2) on GPUs 4-7, the weight ring in the trainer's GPU
    memory (read by CUDA IPC). Expected memory per GPU (the memory plan, est.): GPUs 0-3 68.0 GiB (vLLM's
    0.85 of 80); GPUs 4-7 50.9 GiB (forward_backward 42.3 at the loss of a 16,384-token micro-batch with full
    checkpointing, optimizer step 39.5, weight ring 7.6, CUDA context 1). Seconds per version (est., docs/gpu.md:
    16.4 GB device to device by CUDA IPC): about 0.1 s; not measured yet."""
    config = _one_node(_gsm8k("Qwen3-8B"))
    config.generator.replicas, config.trainer.ranks = 4, 4
    config.controller.prompts_per_step = 32
    return config


@register
def qwen3_30b_a3b_gsm8k_one_node() -> Config:
    """Qwen3-30B-A3B on GSM8K on one node of 8 GPUs of 80 GB, as a LoRA adapter of rank 16 on the attention's
    projections (its experts are no linear layers): full fine-tuning does not fit beside the generators by the
    memory plan (30.5B parameters x 16 bytes of fp32 weights, gradients and AdamW moments is 455 GiB, 114 GiB
    a GPU over 4 trainer ranks; docs/memory.md shows the refusal). 2 generator replicas of tensor parallel
    size 2 on GPUs 0-3 (serving the adapter), 4 trainer ranks on GPUs 4-7 holding the frozen base in fp32.
    Expected memory per GPU (the memory plan, est.): GPUs 0-3 68.0 GiB (vLLM's 0.85 of 80); GPUs 4-7 40.9 GiB
    (forward_backward 39.9 at the last layer's backward of a 16,384-token micro-batch, CUDA context 1).
    Seconds per version (est., docs/gpu.md): the 27 MB adapter through the host ring, about 10 ms of copies and
    vLLM's adapter load; not measured yet."""
    config = _one_node(_gsm8k("Qwen3-30B-A3B"))
    config.generator.replicas, config.generator.tensor_parallel_size, config.trainer.ranks = 2, 2, 4
    config.controller.prompts_per_step = 32
    config.trainer.lora = LoraConfig(rank=16, alpha=32.0, targets="q_proj,k_proj,v_proj,o_proj")
    config.trainer.lr = 1e-5  # 10 times the full fine-tune's, as LoRA usually needs
    return config
