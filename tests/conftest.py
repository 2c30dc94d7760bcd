"""What every test shares: the environment the suite's processes inherit, the checkpoints and command-line
fixtures many files use, the order files go out to the workers, and the fast tier's guard (a test not
marked `processes` that starts a process, a Monarch proc mesh or a vLLM engine fails: `make test-fast`
runs exactly the unmarked tests, so the fast tier stays fast by construction)."""
import os
from pathlib import Path

import pytest

import process_guard

# Each actor pins its own threads; keep the test process from competing with them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# vLLM compiles two small sampler helpers (logprob ranks, top-k/top-p) with torch.compile at an engine's
# first request: about 1 s of CPU in every engine the suite starts, for helpers whose eager form gives the
# same counts and sorts. meshrl itself compiles nothing. Every process the tests start inherits this.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# matplotlib builds its font cache at its first import on a machine, running `fc-list`: a process, which the fast
# tier's guard refuses inside a test that imports it (reasoning-gym imports pyplot). Built here, before any test.
import matplotlib.font_manager  # noqa: E402,F401  (cached under ~/.cache/matplotlib from then on)

# Actor processes import the test modules that define stand-in actors.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """The tiny random Llama with SmolLM2's tokenizer (built once, cached)."""
    from meshrl.models.model import resolve_checkpoint

    return resolve_checkpoint("tiny")


def saved_by_transformers(out: Path, config_class: str, model_class: str) -> Path:
    """A tiny random model of a transformers class, saved by transformers, with SmolLM2's tokenizer."""
    import shutil

    import torch
    import transformers

    from meshrl.models.model import read_hf_config, resolve_checkpoint

    smollm2 = resolve_checkpoint("smollm2")
    ids = {k: v for k, v in read_hf_config(smollm2).items() if k in ("vocab_size", "bos_token_id", "eos_token_id",
                                                                      "pad_token_id")}
    config = getattr(transformers, config_class)(
        **ids, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.05)  # peaked next-token distributions, as a trained model's
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2 / name, out / name)
    return out


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory):
    """A Llama checkpoint directory as transformers writes one (not meshrl): `--model.source PATH`."""
    return saved_by_transformers(tmp_path_factory.mktemp("llama"), "LlamaConfig", "LlamaForCausalLM")


@pytest.fixture(scope="session")
def qwen2_checkpoint(tmp_path_factory):
    """A Qwen2 checkpoint directory: an architecture with no native family, trained through torchtitan's
    transformers backend (q, k and v projections with biases)."""
    return saved_by_transformers(tmp_path_factory.mktemp("qwen2"), "Qwen2Config", "Qwen2ForCausalLM")


def pytest_addoption(parser):
    parser.addoption("--stress-seconds", type=float, default=6.0,
                     help="how long the weight-ring stress test publishes and pulls (30 for the full run)")


@pytest.fixture
def stress_seconds(request):
    return request.config.getoption("--stress-seconds")


@pytest.fixture
def cli(capsys):
    """`meshrl ARGS...` run by its main() in this process (main() is the whole command; no start-up to
    pay): returns (exit code, stdout, stderr)."""
    from meshrl.tools.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


# The files that start real runs, slowest first (measured on 2 cores, 2026-11-25): pytest-xdist hands
# out whole files in collection order, so these start first and the quick files fill the last minutes
# of both workers instead of one worker finishing a long file alone.
SLOW_FIRST = ["test_checkpoint.py", "test_multihost.py", "test_train_smoke.py", "test_torch_generator.py", "test_lora.py",
              "test_chaos.py", "test_supervise.py", "test_reward_errors.py", "test_final_policy.py",
              "test_generator_pool.py", "test_multiturn.py", "test_openenv.py", "test_actors.py", "test_sync_vs_async.py",
              "test_weight_stress.py", "test_generate_server.py", "test_bench_weight_sync.py", "test_weight_updates.py", "test_bench_trainer.py",
              "test_check_gpu.py", "test_jobs.py", "test_trainer_ranks.py", "test_tasks.py", "test_decoupled_ratio.py",
              "test_clean_stop.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: each file's order kept


# The fast tier's guard around each test not marked `processes`: its setup and its call (tests/process_guard.py)
pytest_runtest_setup = process_guard.pytest_runtest_setup
pytest_runtest_call = process_guard.pytest_runtest_call
