"""The fast tier's guard (tests/process_guard.py): inside it each way of starting a process raises, so a test
of `make test-fast` that starts one fails instead of slowing the tier; outside it everything is as before."""
import multiprocessing
import os
import subprocess
import sys

import pytest

import process_guard
from process_guard import ProcessInFastTier

pytest_plugins = ["pytester"]


def test_the_guard_refuses_a_subprocess_a_multiprocessing_child_a_fork_and_a_monarch_proc_mesh():
    from monarch.actor import this_host

    host = this_host()  # Monarch's client context starts no process; its proc meshes do
    with process_guard.process_guard("tests/test_x.py::test_y"):
        with pytest.raises(ProcessInFastTier, match=r"test_x.py::test_y starts a real process \(subprocess.Popen\)"):
            subprocess.run(["true"])
        with pytest.raises(ProcessInFastTier, match="multiprocessing"):
            multiprocessing.get_context("spawn").Process(target=print).start()
        with pytest.raises(ProcessInFastTier, match="os.fork"):
            os.fork()
        with pytest.raises(ProcessInFastTier, match="os.system"):
            os.system("true")
        with pytest.raises(ProcessInFastTier, match="HostMesh._spawn_nonblocking"):
            host.spawn_procs(per_host={"procs": 1})


def test_a_library_imported_inside_the_guard_is_guarded_there_and_restored_after(tmp_path, monkeypatch):
    (tmp_path / "fake_engine_library.py").write_text("class Engine:\n    def __init__(self):\n        self.up = True\n")
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.setattr(process_guard, "LIBRARY_STARTS", [("fake_engine_library", "Engine", "__init__")])
    monkeypatch.delitem(sys.modules, "fake_engine_library", raising=False)
    popen, finders = subprocess.Popen.__init__, list(sys.meta_path)
    with process_guard.process_guard():
        import fake_engine_library  # first imported here, as a test imports vLLM

        with pytest.raises(ProcessInFastTier, match=r"fake_engine_library.Engine.__init__"):
            fake_engine_library.Engine()
    assert fake_engine_library.Engine().up
    assert subprocess.Popen.__init__ is popen
    assert sys.meta_path == finders


@pytest.mark.processes  # its marked inner test starts `true`
def test_an_unmarked_test_whose_body_or_module_fixture_starts_a_process_fails_and_a_marked_one_runs(pytester):
    pytester.makeconftest("import process_guard\n\npytest_runtest_setup = process_guard.pytest_runtest_setup\n"
                          "pytest_runtest_call = process_guard.pytest_runtest_call\n")
    pytester.makeini("[pytest]\nmarkers =\n    processes: starts real processes\n")
    pytester.makepyfile(test_inner="""
        import subprocess

        import pytest


        @pytest.fixture(scope="module")
        def started():
            return subprocess.run(["true"]).returncode


        def test_body_starts_one():
            subprocess.run(["true"])


        def test_module_fixture_starts_one(started):
            pass


        @pytest.mark.processes
        def test_marked_starts_one():
            assert subprocess.run(["true"]).returncode == 0
        """)
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(passed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at setup of test_module_fixture_starts_one*",  # errors come first
                                 "*test_inner.py::test_module_fixture_starts_one starts a real process (subprocess.Popen)*",
                                 "*test_inner.py::test_body_starts_one starts a real process (subprocess.Popen)*"])
