import os

import pytest

# Each actor pins its own threads; keep the test process from competing with them.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """The tiny random Llama with SmolLM2's tokenizer (built once, cached)."""
    from meshrl.model import resolve_checkpoint

    return resolve_checkpoint("tiny")
