"""The ``tandem`` command as a person meets it: ``tandem up`` takes the engine flags of
``tandem serve`` (one definition) and gives them to every replica it starts, ``--help`` shows
defaults, and a wrong model path or an unreachable target is one line, not a traceback.

The flags are checked by reading the planned processes' argv back with the parsers the
replica and the gateway really run; the errors by running the real command.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from deploy.cli import add_suite_args, suite_config
from deploy.cli import build_parser as tandem_parser
from deploy.suite_plan import plan_suite
from gateway.__main__ import build_parser as gateway_parser
from gateway.__main__ import options_from_args as gateway_options
from services.frontend.errors import NotFound
from services.frontend.served_model import ServedModel
from services.replica.engine_flags import engine_argv
from services.replica.main import build_parser as replica_parser
from services.replica.main import options_from_args as replica_options
from services.replica.main import resolve_engine_cpus
from services.replica.options import ReplicaOptions

REPO = Path(__file__).resolve().parents[1]

# A value other than the default for every engine flag tandem up passes on.
ENGINE_FLAGS = [
    "--dtype", "float32", "--device", "cpu", "--attention-backend", "torch", "--enforce-eager",
    "--cuda-graph-max-batch-size", "8", "--max-model-len", "512", "--seed", "7",
    "--block-size", "32", "--gpu-memory-utilization", "0.5", "--num-kv-blocks", "99",
    "--no-prefix-caching", "--max-num-batched-tokens", "1024", "--max-num-seqs", "3",
    "--max-waiting", "5", "--max-stored-responses", "6", "--scheduling-policy", "priority",
    "--shutdown-grace", "2.5", "--speculative-ngram", "3", "--speculative-ngram-range", "1:5",
    "--speculative-max-batch", "2", "--kv-lease-seconds", "9", "--kv-pull-timeout", "4",
    "--kv-max-pinned-fraction", "0.5", "--kv-fallback", "fail", "--kv-transport", "tcp",
]


def up_argvs(*args: str) -> tuple[list[list[str]], list[str]]:
    """The replicas' argvs and the gateway's, as ``tandem up ARGS`` plans them."""
    parser = argparse.ArgumentParser()
    add_suite_args(parser)
    specs = plan_suite(suite_config(parser.parse_args(list(args)))).specs
    replicas = [s.argv[s.argv.index("services.replica") + 1:] for s in specs
                if "services.replica" in s.argv]
    gateway = next(s.argv for s in specs if s.name == "gateway")
    return replicas, gateway[gateway.index("gateway") + 1:]


def test_every_replica_gets_up_s_engine_flags(tiny_llama_dir) -> None:
    replicas, _ = up_argvs("--model", str(tiny_llama_dir), "--prefill", "1", "--decode", "2",
                           "--kv-cache-memory", "64MiB", *ENGINE_FLAGS)
    expected = replica_options(replica_parser().parse_args(
        ["--model", str(tiny_llama_dir), "--kv-cache-memory", "64MiB", *ENGINE_FLAGS]))
    assert len(replicas) == 3
    for argv in replicas:
        options = replica_options(replica_parser().parse_args(argv))
        # Everything but what differs per replica by design (role, engine id, transfer role).
        assert options.engine.cache == expected.engine.cache
        # By role: the prompt caps' policy (fixed on a decode replica) and a prefill
        # replica's chunk of a long prompt (with --kv-overlap on, it announces KV chunk by
        # chunk).
        role_free = {"prefill_caps_scale_with_queue": None, "long_prefill_token_threshold": 0}
        assert (replace(options.engine.scheduler, **role_free)
                == replace(expected.engine.scheduler, **role_free))
        scheduler = options.engine.scheduler
        assert scheduler.prefill_caps_scale_with_queue == (options.role != "decode")
        assert (scheduler.long_prefill_token_threshold > 0) == (
            options.role == "prefill" and options.kv_overlap)
        assert options.engine.speculative == expected.engine.speculative
        for name in ("dtype", "device", "attention_backend", "enforce_eager", "seed",
                     "cuda_graph_max_batch_size", "max_model_len"):
            assert getattr(options.engine, name) == getattr(expected.engine, name), name
        kv, want = options.engine.kv_transfer, expected.engine.kv_transfer
        assert (kv.lease_seconds, kv.pull_timeout_seconds, kv.fallback, kv.transport) == (
            want.lease_seconds, want.pull_timeout_seconds, want.fallback, "tcp")
        for name in ("max_waiting", "max_stored_responses", "shutdown_grace_s",
                     "max_pinned_fraction"):
            assert getattr(options, name) == getattr(expected, name), name


def test_up_gives_prefill_replicas_their_own_parallel_size(tiny_llama_dir) -> None:
    """``--prefill-tensor-parallel-size`` (as ``tandem render k8s`` has): P/D across parallel
    sizes moves the KV per rank. An engine core of several ranks that shares its replica's
    CPUs is handed them all, so that its ranks split them (rank 0 its first share)."""
    replicas, _ = up_argvs("--model", str(tiny_llama_dir), "--device", "cpu",
                           "--tensor-parallel-size", "2", "--prefill-tensor-parallel-size", "1",
                           "--cpu-layout", "shared")
    def options(argv: list[str]) -> ReplicaOptions:  # as ``main`` resolves --engine-cpus
        args = replica_parser().parse_args(argv)
        args.engine_cpus = resolve_engine_cpus(args)
        return replica_options(args)
    prefill, decode = (options(argv) for argv in replicas)
    assert (prefill.engine.tensor_parallel_size, decode.engine.tensor_parallel_size) == (1, 2)
    assert "--tensor-parallel-size" not in replicas[0]
    assert decode.engine.cpus is not None and prefill.engine.cpus is None
    shared = options([*replicas[1], "--engine-cpus", "none"])
    assert shared.engine.cpus == sorted(os.sched_getaffinity(0))


def test_up_passes_only_what_differs_and_its_own_kv_budget(tiny_llama_dir) -> None:
    replicas, _ = up_argvs("--model", str(tiny_llama_dir))
    for argv in replicas:
        assert "--dtype" not in argv and "--max-model-len" not in argv
        assert replica_options(replica_parser().parse_args(argv)).engine.cache \
            .kv_cache_memory_bytes == 512 * 2**20


def test_engine_argv_reads_back_as_the_same_flags() -> None:
    args = replica_parser().parse_args(ENGINE_FLAGS)
    again = replica_parser().parse_args(engine_argv(args))
    assert vars(again) == vars(args)
    assert engine_argv(replica_parser().parse_args([])) == []


def test_served_names_logs_and_traces_reach_the_replicas_and_the_gateway(tiny_llama_dir) -> None:
    replicas, gateway = up_argvs(
        "--model", str(tiny_llama_dir), "--served-model-name", "tiny", "tiny-alias",
        "--log-format", "json", "--log-level", "WARNING",
        "--otlp-traces-endpoint", "localhost:4317")
    for argv in [*replicas, gateway]:
        parser = replica_parser() if argv is not gateway else gateway_parser()
        args = parser.parse_args(argv)
        assert args.served_model_name == ["tiny", "tiny-alias"]
        assert (args.log_format, args.log_level, args.otlp_traces_endpoint) == (
            "json", "WARNING", "localhost:4317")
    assert gateway_options(gateway_parser().parse_args(gateway)).served_model_name == [
        "tiny", "tiny-alias"]


def test_several_served_names_the_first_names_answers_any_is_accepted() -> None:
    model = ServedModel.for_directory("/models/smol", 2048, ["tiny", "tiny-alias"])
    assert model.name == "tiny" and model.response_name(None) == "tiny"
    for requested in ("tiny", "tiny-alias", "smol", "/models/smol", ""):
        assert model.resolve(requested) is None
    with pytest.raises(NotFound):
        model.resolve("other")
    assert ServedModel.for_directory("/models/smol", 2048, "one").name == "one"
    assert ServedModel.for_directory("/models/smol", 2048, None).name == "smol"


def test_help_shows_defaults_and_the_replica_is_tandem_serve() -> None:
    serve = replica_parser().format_help()
    assert serve.startswith("usage: tandem serve")
    for flag, default in (("--max-num-seqs", "(default: "), ("--block-size", "(default: "),
                          ("--role", "(default: both)"), ("--kv-fallback", "(default: recompute)")):
        text = " ".join(serve.split(flag, 2)[-1].split("--", 1)[0].split())
        assert default in text, (flag, text)
    up = " ".join(_subparser_help("up").split())
    assert "--served-model-name NAME [NAME ...]" in up
    assert "(default: 512MiB)" in up and "(default: 50051)" in up
    generate = " ".join(_subparser_help("generate").split())
    assert "(default: 127.0.0.1:50051)" in generate and "(default: 64)" in generate


def _subparser_help(name: str) -> str:
    parser = tandem_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name].format_help()


def _tandem(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", ["up", "serve"])
def test_a_wrong_model_path_is_one_line_and_exit_2(tmp_path: Path, command: str) -> None:
    not_a_model = tmp_path / "weights"
    not_a_model.mkdir()
    for model, why in ((tmp_path / "missing", "no such directory"),
                       (not_a_model, "no config.json")):
        logs = tmp_path / "logs"
        extra = ["--log-dir", str(logs)] if command == "up" else []
        result = _tandem(command, "--model", str(model), *extra)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and str(model) in lines[0] and why in lines[0], result.stderr
        assert "Traceback" not in result.stderr
        assert not logs.exists()  # nothing was started


def test_generate_against_nothing_is_one_line_and_exit_1() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{probe.getsockname()[1]}"
    result = _tandem("generate", "hello", "--target", target)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and target in lines[0] and "--target" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
