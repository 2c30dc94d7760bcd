"""Qwen3 configs: the tiny stand-in that the tests train, and GPU-cluster examples that start from a
checkpoint the user downloads (docs/models.md). Registered with the others (meshrl/configs/named.py)."""

from meshrl.configs import Config, ControllerConfig, ModelConfig, register
from meshrl.configs.named import smoke


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
