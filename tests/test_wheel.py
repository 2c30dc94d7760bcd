"""What the wheel built from this repository ships: meshrl and its subpackages, and no test code (no fake,
simulation or stress module, nothing from tests/). Test support lives in tests/support/, outside the wheel,
and a bench that runs it says in one line, run from the wheel's files, that it needs a checkout.

The files are listed by setuptools itself, from pyproject.toml: its build_py step, the step of building a
wheel that collects the packages' modules and data files, into a temporary directory. A whole wheel needs
setuptools' bdist_wheel, which the CPU install's setuptools (the venv's own, 65.5) does not have without the
`wheel` package; build_py needs nothing more and no network, and the wheel adds only its metadata to it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # setuptools, and a bench from the wheel's files, run in processes of their own

ROOT = Path(__file__).resolve().parents[1]
TEST_CODE = ("fake", "simulation", "stress")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The files setuptools puts in the wheel, laid out as an install puts them (a directory for sys.path)."""
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q",
                            "egg_info", "--egg-base", str(out), "build_py", "--build-lib", str(out / "lib")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    return out / "lib"


def test_the_wheel_holds_meshrl_alone_and_no_test_code(wheel):
    files = sorted(p.relative_to(wheel) for p in wheel.rglob("*") if p.is_file())
    assert Path("meshrl/__init__.py") in files and Path("meshrl/tools/cli.py") in files  # the package is there
    assert {f.parts[0] for f in files} == {"meshrl"}, "only meshrl and its subpackages"
    test_code = [str(f) for f in files if f.suffix == ".py" and any(word in f.stem for word in TEST_CODE)]
    assert not test_code, f"test code in the wheel (it belongs in tests/support/): {test_code}"


def test_the_controller_bench_from_the_wheel_says_in_one_line_that_it_needs_a_checkout(wheel, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "meshrl", "bench", "controller", "--replicas", "1", "--groups", "1",
                             "--json", str(out)], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(wheel)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and not out.exists()
    [line] = result.stderr.strip().splitlines()
    assert "needs a repository checkout" in line and str(wheel / "meshrl") in line, line  # the wheel's meshrl ran
