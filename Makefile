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

.PHONY: venv demo test test-slow bench draft
venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m ssd_jax "What is the capital of France?"

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow

bench: $(STAMP)
	$(VENV)/bin/python -m bench.ar_vs_torch

# The draft's whole training pipeline (checkpoints/smollm2-draft/README.md): target responses,
# a bootstrap draft, on-policy data (the bootstrap answers, the target labels), final training.
DRAFT_WORK ?= $(HOME)/.cache/ssd_jax/draft-pipeline
DRAFT_OUT ?= checkpoints/smollm2-draft
draft: $(STAMP)
	$(VENV)/bin/python -m ssd_jax.distill data --out $(DRAFT_WORK)/data --gen-batches 22
	$(VENV)/bin/python -m ssd_jax.distill train --data $(DRAFT_WORK)/data/dataset.npz \
		--work $(DRAFT_WORK)/boot-train --out $(DRAFT_WORK)/boot --minutes 6
	$(VENV)/bin/python -m ssd_jax.distill onpolicy --base $(DRAFT_WORK)/data/dataset.npz \
		--draft $(DRAFT_WORK)/boot --out $(DRAFT_WORK)/onpolicy --batches 36
	$(VENV)/bin/python -m ssd_jax.distill train --data $(DRAFT_WORK)/onpolicy/dataset.npz \
		--init $(DRAFT_WORK)/boot --work $(DRAFT_WORK)/train --out $(DRAFT_OUT) --minutes 13
