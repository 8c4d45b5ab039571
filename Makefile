# Two commands do all the set-up on a fresh machine:
#   make demo   – create the environment if needed, then run the main job end to end on bundled data
#   make test   – create the environment if needed, then run the test suite
# Both are idempotent: a second run reuses .venv (reinstalled only when pyproject.toml changes).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ckray-installed
# torch goes in first so a CPU machine never pulls a CUDA build. On a CPU-only machine elsewhere,
# TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" picks the CPU wheel.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
WORKDIR ?= work/demo
PYTEST_ARGS ?=

.PHONY: env demo test test-quick bench clean

env: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) jobs/pipeline.py --workdir $(WORKDIR)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf work/demo .pytest_cache
