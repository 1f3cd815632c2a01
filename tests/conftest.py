"""Shared pytest fixtures: tiny random Hugging Face model directories, built once a session,
the OpenAI HTTP cluster the Responses API modules share, the one replica behind a gateway
that the gRPC API modules share, and the converted default model (SmolLM2), whose conversion
starts in the background as soon as a selected test is known to need it."""

from __future__ import annotations

import os

import torch

# Triton kernels run under the interpreter on machines without a GPU. The variable must be
# set before anything imports triton (transformers does, through the model factory).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402

from engine_common.default_model import (  # noqa: E402
    _is_complete,
    default_model_dir,
    ensure_default_model,
)
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


# The default model's conversion (~30 s of CPU, once per cache) runs in a process of its own,
# started when collection is done, at the lowest priority: it takes the CPU the suite leaves
# idle (most of a core: tests mostly wait on the servers they start) instead of holding up
# the first test that needs the model. SIGTERM ends it through ensure_default_model's own
# clean-up (the staging directory goes).
_CONVERTING = pytest.StashKey[subprocess.Popen[bytes]]()
_CONVERT = ("import signal, sys\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))\n"
            "from engine_common.default_model import ensure_default_model\n"
            "ensure_default_model()\n")


def pytest_collection_finish(session: pytest.Session) -> None:
    needed = any("smollm2_dir" in getattr(item, "fixturenames", ()) for item in session.items)
    if not needed or session.config.option.collectonly or _is_complete(default_model_dir()):
        return
    # Its output is dropped: on failure the fixture converts again here, and fails with the
    # error in the test's report.
    session.config.stash[_CONVERTING] = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-c", _CONVERT],
        cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)


def pytest_sessionfinish(session: pytest.Session) -> None:
    converting = session.config.stash.get(_CONVERTING, None)
    if converting is not None and converting.poll() is None:
        converting.send_signal(signal.SIGTERM)
        converting.wait(30)


@pytest.fixture(scope="session")
def smollm2_dir(request: pytest.FixtureRequest) -> Path:
    """The converted default model, in the cache every default-model user shares
    ($TANDEM_CACHE_DIR, which `make test` sets to the checkout's .cache/tandem): waits for the
    background conversion, then converts itself if that one failed (its error shows here)."""
    converting = request.config.stash.get(_CONVERTING, None)
    if converting is not None:
        converting.wait()
    return ensure_default_model()
