"""The fast tier's guard: inside `process_guard()` every way a test could start a real process raises
ProcessInFastTier, so a test that `make test-fast` runs (one not marked `processes`) cannot start one by
accident and slow the fast tier down. conftest.py puts every unmarked test inside it.

Guarded: subprocess.Popen (subprocess.run, check_output and asyncio's subprocesses go through it),
os.fork / os.system / os.posix_spawn, multiprocessing's Process.start (and so its pools), Monarch's
HostMesh._spawn_nonblocking (what `this_host().spawn_procs` and every proc mesh start call: Monarch starts
its processes from Rust, out of Python's reach) and vLLM's engine (`vllm.LLM` and the EngineCore every
engine builds, in this process or another). Monarch and vLLM are patched when a test imports them, not
before: importing vLLM takes seconds, which a fast test that never uses it should not pay.

The hooks at the end put each test that is not marked `processes` inside the guard; conftest.py takes them."""
import contextlib
import importlib.abc
import importlib.machinery
import multiprocessing.process
import os
import subprocess
import sys
from contextlib import contextmanager

import pytest

# (module, class, attribute): what starts a Monarch proc mesh or a vLLM engine, patched once its module is imported
LIBRARY_STARTS = [("monarch._src.actor.host_mesh", "HostMesh", "_spawn_nonblocking"),
                  ("vllm.entrypoints.llm", "LLM", "__init__"),
                  ("vllm.v1.engine.core", "EngineCore", "__init__")]


class ProcessInFastTier(RuntimeError):
    """A test of the fast tier started (or tried to start) a real process."""


def _refusal(what: str, test: str):
    def refuse(*args, **kwargs):
        raise ProcessInFastTier(
            f"{test} starts a real process ({what}) but is not marked `processes`: mark it "
            "(`@pytest.mark.processes`, or `pytestmark = pytest.mark.processes` for its whole file) so that "
            "`make test-fast` leaves it to `make test` (tests/README.md: Running them)")
    return refuse


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `module` is first imported it lets the other finders find it, then runs
    `patch(module)` once the module has run."""

    def __init__(self, module: str, patch):
        self.module, self.patch = module, patch

    def find_spec(self, name, path, target=None):
        if name != self.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, patch = spec.loader.exec_module, self.patch

        def exec_module(module):
            run(module)
            patch(module)
        spec.loader.exec_module = exec_module  # this spec's loader only: made for this one import
        return spec


@contextmanager
def process_guard(test: str = "this test"):
    """Every way of starting a process raises ProcessInFastTier until the block ends (then all is as before)."""
    finders = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", _refusal("subprocess.Popen", test))
        mp.setattr(multiprocessing.process.BaseProcess, "start", _refusal("multiprocessing Process.start", test))
        for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                mp.setattr(os, name, _refusal(f"os.{name}", test))
        for module, cls, attr in LIBRARY_STARTS:
            def patch(loaded, cls=cls, attr=attr, module=module):
                mp.setattr(getattr(loaded, cls), attr, _refusal(f"{module}.{cls}.{attr}", test))
            if module in sys.modules:
                patch(sys.modules[module])
            else:
                finders.append(_PatchOnImport(module, patch))
        sys.meta_path[:0] = finders
        try:
            yield
        finally:
            for finder in finders:
                sys.meta_path.remove(finder)


def _guarded(item):
    """A test that is not marked `processes` (by `pytestmark` in its file or on itself) may start no process,
    in its body or in any fixture it sets up, module and session fixtures included (which an autouse fixture
    would miss: they are set up before it). Teardown is left out: a module fixture that a marked test started
    is torn down in whichever test of the file ends last."""
    return contextlib.nullcontext() if item.get_closest_marker("processes") else process_guard(item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _guarded(item):
        return (yield)
