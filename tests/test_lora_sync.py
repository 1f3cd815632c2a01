"""``tandem lora sync``: a replica's LoRA adapters kept in step with a file.

The file is the inference extension's LoRA syncer ConfigMap format (its own example parses).
Against a real replica (``--allow-runtime-lora-updating``) and the real ``tandem lora sync``
process: what the file lists is loaded and answers what the offline engine answers with that
adapter; a name dropped into ensureNotExist is unloaded; a name whose source changes is
reloaded from the new directory; a replica that restarts (and forgot its adapters) gets them
back; a file that does not parse keeps the adapters as they were and says why; ``--once``
exits 1 naming an adapter it could not load.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.lora_sync import WantedAdapters, parse_wanted_adapters, render_config
from engine_common.sampling_params import SamplingParams
from tandem import Client
from tests.model_factory import write_serving_adapters
from tests.openai_http import offline_engine
from tests.replica_process import (
    REPO_ROOT,
    ReplicaProcess,
    restart_replica,
    spawn_module,
    start_replicas,
    stop_all,
    wait_until,
)

PROMPT = "the river runs to the sea and"
MAX_TOKENS = 8
REPLICA_ARGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--served-model-name",
                "tiny", "--allow-runtime-lora-updating", "--role", "both"]

# The inference extension's example ConfigMap entry (site-src/guides/adapter-rollout.md),
# sources being directories here.
EXTENSION_EXAMPLE = """
vLLMLoRAConfig:
  name: vllm-llama3-8b-instruct-adapters
  port: 8000
  defaultBaseModel: meta-llama/Llama-3.1-8B-Instruct
  ensureExist:
    models:
    - base-model: meta-llama/Llama-3.1-8B-Instruct
      id: food-review-1
      source: /adapters/food-review-1
    - base-model: meta-llama/Llama-3.1-8B-Instruct
      id: food-review-2
      source: /adapters/food-review-2
  ensureNotExist:
    models:
    - base-model: meta-llama/Llama-3.1-8B-Instruct
      id: food-review-0
      source: /adapters/food-review-0
"""


def test_the_inference_extensions_format_parses_and_round_trips() -> None:
    wanted = parse_wanted_adapters(EXTENSION_EXAMPLE)
    assert wanted == WantedAdapters(
        {"food-review-1": "/adapters/food-review-1", "food-review-2": "/adapters/food-review-2"},
        frozenset({"food-review-0"}))
    assert parse_wanted_adapters(render_config(wanted.present, wanted.absent)) == wanted
    assert parse_wanted_adapters(render_config()) == WantedAdapters({}, frozenset())


@pytest.mark.parametrize(("text", "message"), [
    ("- a list", "a mapping with the key vLLMLoRAConfig"),
    ("loras: {}", "a mapping with the key vLLMLoRAConfig"),
    ("vLLMLoRAConfig: [1]", "vLLMLoRAConfig must be a mapping"),
    ("vLLMLoRAConfig: {ensureExists: {}}", "unknown keys under vLLMLoRAConfig: ensureExists"),
    ("vLLMLoRAConfig: {ensureExist: [a]}", "ensureExist must be a mapping with one key, models"),
    ("vLLMLoRAConfig: {ensureExist: {models: [a]}}", "ensureExist.models must be a list"),
    ("vLLMLoRAConfig: {ensureExist: {models: [{source: /a}]}}", "needs an id"),
    ("vLLMLoRAConfig: {ensureExist: {models: [{id: a}]}}", "'a' in ensureExist needs a source"),
    ("vLLMLoRAConfig: {ensureExist: {models: [{id: a, source: /a}, {id: a, source: /b}]}}",
     "'a' is listed twice"),
    ("vLLMLoRAConfig: {ensureExist: {models: [{id: a, source: /a}]}, "
     "ensureNotExist: {models: [{id: a}]}}", "in both ensureExist and ensureNotExist: a"),
    ("vLLMLoRAConfig: {ensureExist: {models: [{id: a, source: /a}]", "not YAML"),
])
def test_a_wrong_file_is_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_wanted_adapters(text)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_serving_adapters(tiny_llama_dir, tmp_path_factory.mktemp("sync-adapters"))


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path, adapters: dict[str, str]) -> dict[str, str]:
    """Each adapter's greedy text from the offline engine that serves it from the start."""
    offline = offline_engine(tiny_llama_dir, adapters)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = {name: offline.generate([PROMPT], params, lora_name=name)[0].text
             for name in adapters}
    assert len(set(texts.values())) == len(texts)  # the adapters answer differently
    return texts


@pytest.fixture
def replica(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[ReplicaProcess]:
    replicas = start_replicas(tiny_llama_dir, tmp_path, {"replica": REPLICA_ARGS})
    yield replicas["replica"]
    stop_all([], replicas)


def served(target: str) -> set[str]:
    with Client(target, timeout=10) as client:
        return {model.id for model in client.models() if model.parent is not None}


def answer(target: str, model: str) -> str:
    with Client(target, timeout=60) as client:
        return client.complete(PROMPT, model=model, max_tokens=MAX_TOKENS, temperature=0,
                               ignore_eos=True).text


def test_the_syncer_follows_the_file_and_a_restarted_replica(
        replica: ReplicaProcess, tiny_llama_dir: Path, adapters: dict[str, str],
        expected: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "configmap.yaml"
    config.write_text(render_config({"sql": adapters["sql"]}))
    syncer = spawn_module(tmp_path, "lora-syncer", [
        "deploy.cli", "lora", "sync", "--config", str(config), "--target", replica.target,
        "--interval", "0.2"])
    processes = {"replica": replica}

    def until(wanted: set[str], what: str) -> None:
        wait_until(lambda: served(processes["replica"].target) == wanted,
                   time.monotonic() + 60, what, tmp_path)

    try:
        until({"sql"}, "the syncer loads sql")
        assert answer(replica.target, "sql") == expected["sql"]

        # "poet" first from sql's directory, then from its own: reloaded from the new one.
        config.write_text(render_config({"poet": adapters["sql"]}, frozenset({"sql"})))
        until({"poet"}, "sql unloaded, poet loaded")
        assert answer(replica.target, "poet") == expected["sql"]
        config.write_text(render_config({"poet": adapters["poet"]}, frozenset({"sql"})))
        wait_until(lambda: answer(replica.target, "poet") == expected["poet"],
                   time.monotonic() + 60, "poet reloaded from its new source", tmp_path)

        processes["replica"] = restart_replica(replica, tiny_llama_dir, tmp_path, "replica",
                                               REPLICA_ARGS)
        until({"poet"}, "the restarted replica gets poet back")
        assert answer(replica.target, "poet") == expected["poet"]

        config.write_text("vLLMLoRAConfig: {ensureExist: {models: [{id: sql}]}}")
        wait_until(lambda: "'sql' in ensureExist needs a source" in
                   (tmp_path / "lora-syncer.log").read_text(),
                   time.monotonic() + 30, "the syncer reports the broken file", tmp_path)
        assert served(replica.target) == {"poet"}  # kept as it was
    finally:
        stop_all([syncer], processes)
    assert "keeping the previous adapters" in (tmp_path / "lora-syncer.log").read_text()


def test_once_exits_with_what_failed(replica: ReplicaProcess, adapters: dict[str, str],
                                     tmp_path: Path) -> None:
    config = tmp_path / "configmap.yaml"
    config.write_text(render_config({"sql": adapters["sql"],
                                     "broken": str(tmp_path / "no-such-adapter")}))
    command = [sys.executable, "-m", "deploy.cli", "lora", "sync", "--once", "--config",
               str(config), "--target", replica.target]
    first = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert first.returncode == 1, first.stderr
    assert "loaded: sql; unloaded: none" in first.stdout
    assert "error: broken:" in first.stderr and "no-such-adapter" in first.stderr
    assert "INVALID_ARGUMENT" in first.stderr
    assert served(replica.target) == {"sql"}

    config.write_text(render_config({}, frozenset({"sql", "never-loaded"})))
    second = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert (second.returncode, second.stdout.strip()) == (0, "loaded: none; unloaded: sql")
    assert served(replica.target) == set()
