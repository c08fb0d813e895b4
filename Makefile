# Two commands on a fresh machine: `make run` (set up, run the default experiment offline) and
# `make test` (set up, run the test suite). The venv is rebuilt when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test test-gpu lint docs clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

run: $(VENV)/.installed
	$(PY) -m runner $(ARGS)

test: $(VENV)/.installed
	$(PY) -m ruff check runner tests scripts
	$(PY) scripts/check_imports.py
	$(PY) -m pytest -q $(ARGS)

# The GPU path on a CUDA machine: tests/test_gpu.py (skipped without CUDA), CPU vs GPU on the real model.
test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu $(ARGS)

# The import graph's layers, cycles and forbidden arrows (scripts/check_imports.py), then ruff.
lint: $(VENV)/.installed
	$(PY) scripts/check_imports.py
	$(PY) -m ruff check runner tests scripts
	$(PY) -m ruff format --check runner tests scripts

# docs/reference/*.md from the registries and the declared table schemas (tests/test_reference_docs.py checks them).
docs: $(VENV)/.installed
	$(PY) scripts/gen_reference.py

clean:
	rm -rf $(VENV) .pytest_cache
