import os
from pathlib import Path

import pytest

# Each actor pins its own threads; keep the test process from competing with them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Actor processes import the test modules that define stand-in actors.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """The tiny random Llama with SmolLM2's tokenizer (built once, cached)."""
    from meshrl.model import resolve_checkpoint

    return resolve_checkpoint("tiny")


def pytest_addoption(parser):
    parser.addoption("--stress-seconds", type=float, default=6.0,
                     help="how long the weight-ring stress test publishes and pulls (30 for the full run)")


@pytest.fixture
def stress_seconds(request):
    return request.config.getoption("--stress-seconds")
