"""What the wheel built from this repository ships: meshrl and its subpackages, and no test code (no fake,
simulation or stress module, nothing from tests/). Test support lives in tests/support/, outside the wheel.

The files are listed by setuptools itself, from pyproject.toml: its build_py step, the step of building a
wheel that collects the packages' modules and data files, into a temporary directory. A whole wheel needs
setuptools' bdist_wheel, which the CPU install's setuptools (the venv's own, 65.5) does not have without the
`wheel` package; build_py needs nothing more and no network, and the wheel adds only its metadata to it."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # setuptools runs in a process of its own (about a second)

ROOT = Path(__file__).resolve().parents[1]
TEST_CODE = ("fake", "simulation", "stress")


def packaged_files(out: Path) -> list[Path]:
    """The files setuptools puts in the wheel, relative to its root."""
    lib = out / "lib"
    build = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q",
                            "egg_info", "--egg-base", str(out), "build_py", "--build-lib", str(lib)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    return sorted(p.relative_to(lib) for p in lib.rglob("*") if p.is_file())


def test_the_wheel_holds_meshrl_alone_and_no_test_code(tmp_path):
    files = packaged_files(tmp_path)
    assert Path("meshrl/__init__.py") in files and Path("meshrl/tools/cli.py") in files  # the package is there
    assert {f.parts[0] for f in files} == {"meshrl"}, "only meshrl and its subpackages"
    test_code = [str(f) for f in files if f.suffix == ".py" and any(word in f.stem for word in TEST_CODE)]
    assert not test_code, f"test code in the wheel (it belongs in tests/support/): {test_code}"
