"""Benches that drive test support code from a repository checkout.

`meshrl bench controller` runs the real controller over the fake actors of the in-process simulation,
and `meshrl bench weight-sync`'s stress phase runs the weight-ring stress driver: both live in the
checkout's tests/support/ (a package the wheel leaves out, as it does every test fake). Run from a
checkout (an editable install, or `python -m meshrl` in the repository), these benches find it there;
meshrl installed from a wheel has no tests/, and they stop with one line saying so.
"""

import importlib
import sys
from pathlib import Path
from types import ModuleType

import meshrl

CHECKOUT = Path(meshrl.__file__).resolve().parents[1]  # the repository, when meshrl runs from one


def from_checkout(module: str) -> ModuleType:
    """`support.<module>` from the checkout's tests/ (put on sys.path, after what is there); exits with
    one line when meshrl does not run from a repository checkout."""
    tests = CHECKOUT / "tests"
    if not ((CHECKOUT / "pyproject.toml").is_file() and (tests / "support" / "__init__.py").is_file()):
        raise SystemExit(f"meshrl: this bench needs a repository checkout of meshrl (it runs test support code "
                         f"from tests/support/, which the wheel does not ship); meshrl runs from {CHECKOUT / 'meshrl'}")
    if str(tests) not in sys.path:
        sys.path.append(str(tests))
    return importlib.import_module(f"support.{module}")
