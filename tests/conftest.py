"""Shared pytest fixtures: tiny random Hugging Face model directories, built once a session,
the OpenAI HTTP cluster the Responses API modules share, and the one replica behind a gateway
that the gRPC API modules share."""

from __future__ import annotations

import os

import torch

# Triton kernels run under the interpreter on machines without a GPU. The variable must be
# set before anything imports triton (transformers does, through the model factory).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402

from tests.model_factory import build_tiny_model  # noqa: E402

if TYPE_CHECKING:
    from tests.openai_http import Stack
    from tests.replica_process import GatewayStack


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "mistral")


@pytest.fixture(scope="session")
def openai_stack(tiny_llama_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The OpenAI HTTP cluster (Envoy -> gateway -> prefill + decode replicas;
    ``tests.openai_http``), started once for the Responses API modules: each test leaves it
    idle and whole, as it found it (``test_envoy_e2e``, which stops a replica, has its own)."""
    # NOTE: imported here, not at the top, so that the engine-only tests also run where the
    # serving stack's client packages (openai, Envoy) are not installed: a GPU image.
    from tests.openai_http import running_stack

    with running_stack(tiny_llama_dir, tmp_path_factory.mktemp("openai-stack-logs")) as stack:
        yield stack


@pytest.fixture(scope="session")
def gateway_stack(tiny_llama_dir: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    """One replica (float32, 16 MiB of KV cache) behind a gateway, started once for the
    modules that send gRPC requests to either (``test_allowed_and_bad_words``,
    ``test_collateral_damage``, ``test_logit_bias``, ``test_structured_output``): each test
    leaves it serving and idle, as it found it, and asserts nothing about what came before
    (a module that counts metrics, reads logs or stops a process starts its own)."""
    from tests.replica_process import replica_behind_gateway  # see openai_stack's note

    with replica_behind_gateway(tiny_llama_dir, tmp_path_factory.mktemp("gateway-stack-logs"), [
            "--dtype", "float32", "--kv-cache-memory", "16MiB", "--log-level", "WARNING"]) as s:
        yield s
