# Two entry points for a new machine: `make demo` (main job) and `make test` (lint, docs, full suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.r3lightning-installed
# torch is installed first from its pinned CPU wheel so no dependency can pull a CUDA build;
# every install is held to constraints.txt, the exact versions the README's demo tables came from.
TORCH_PIN ?= torch==2.13.0
CONSTRAINTS ?= constraints.txt

.PHONY: setup demo test lint docs format bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) "$(TORCH_PIN)"
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[hf,megatron,data,dev]" "$(TORCH_PIN)"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m r3lightning.app.job.main experiment=compare $(ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# The documentation site, strictly (a warning fails the build), offline, into site/.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

test: lint docs
	$(PY) -m pytest -q $(ARGS)

bench: setup
	for b in benchmarks/bench_*.py; do $(PY) $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache site
