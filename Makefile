# Two set-up commands (README): `make demo` runs the main job, `make test` runs the test suite.
# Both create/reuse .venv with python3 only; everything comes from PyPI (torch from the local wheel).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $(STAMP)

.PHONY: venv demo test test-slow bench
venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m ssd_jax "What is the capital of France?"

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow

bench: $(STAMP)
	$(VENV)/bin/python -m bench.ar_vs_torch
