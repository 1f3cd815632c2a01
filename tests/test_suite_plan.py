"""The replicas and the gateway get the same model settings (``tandem up``'s plan, and the
flags each of them reads).

The gateway renders chats, parses tool calls and applies sampling defaults itself, so the
flags that decide them (``--chat-template``, ``--tool-call-parser``,
``--generation-config``, ``--override-generation-config``, ``--lora-modules``, ``--max-loras``,
``--allow-runtime-lora-updating``) must reach it exactly as they reach every replica.
"""

from __future__ import annotations

import argparse

from deploy.cli import add_suite_args, suite_config
from deploy.suite_plan import plan_suite
from engine_common.config import ModelSettings
from gateway.__main__ import build_parser as gateway_parser
from gateway.__main__ import options_from_args as gateway_options
from services.replica.main import build_parser as replica_parser
from services.replica.main import options_from_args as replica_options


def served_argvs(*args: str) -> list[list[str]]:
    parser = argparse.ArgumentParser()
    add_suite_args(parser)
    suite = plan_suite(suite_config(parser.parse_args(list(args))))
    return [spec.argv for spec in suite.specs
            if "services.replica" in spec.argv or "gateway" in spec.argv]


SETTINGS_FLAGS = ["--generation-config", "vllm", "--chat-template", "chat.jinja",
                  "--tool-call-parser", "mistral",
                  "--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 64}',
                  "--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat",
                  "--max-loras", "1", "--allow-runtime-lora-updating"]
SETTINGS = ModelSettings(chat_template="chat.jinja", tool_call_parser="mistral",
                         generation_config="vllm",
                         override_generation_config={"temperature": 0.5, "max_new_tokens": 64},
                         lora_modules={"sql": "/adapters/sql", "chat": "/adapters/chat"},
                         max_loras=1, allow_runtime_lora_updating=True)


def read_back(argv: list[str]) -> ModelSettings:
    """The settings the replica or gateway started with ``argv`` runs with."""
    if "services.replica" in argv:
        args = argv[argv.index("services.replica") + 1:]
        return replica_options(replica_parser().parse_args(args)).engine.model_settings
    args = argv[argv.index("gateway") + 1:]
    return gateway_options(gateway_parser().parse_args(args)).model_settings


def test_replicas_and_gateway_get_the_same_model_settings(tiny_llama_dir) -> None:
    served = served_argvs("--model", str(tiny_llama_dir), *SETTINGS_FLAGS)
    assert len(served) == 3  # prefill, decode, gateway
    assert [read_back(argv) for argv in served] == [SETTINGS] * 3
    for argv in served_argvs("--model", str(tiny_llama_dir)):
        assert read_back(argv) == ModelSettings()
        assert "--chat-template" not in argv and "--override-generation-config" not in argv


def test_the_replica_and_the_gateway_read_those_flags(tiny_llama_dir) -> None:
    flags = ["--model", str(tiny_llama_dir), *SETTINGS_FLAGS]
    engine = replica_options(replica_parser().parse_args(flags)).engine
    assert engine.model_settings == SETTINGS
    gateway = gateway_options(gateway_parser().parse_args([*flags, "--replica", "h:1"]))
    assert gateway.model_settings == SETTINGS


def test_the_suite_tls_directory_reaches_every_member_that_needs_it(tiny_llama_dir,
                                                                    tmp_path) -> None:
    """With --tls-dir, every replica serves and dials with the suite's certificate and the
    gateway dials with it (its own port stays the plaintext public one, behind Envoy); Envoy
    holds it only where it calls a replica itself. The replica and gateway parsers read it
    back as the directory given; --no-suite-tls leaves every hop plaintext."""
    from deploy.local_ca import make_suite_certificates

    tls_dir = make_suite_certificates(tmp_path / "tls")
    parser = argparse.ArgumentParser()
    add_suite_args(parser)

    def specs(*flags: str) -> dict[str, list[str]]:
        config = suite_config(parser.parse_args(["--model", str(tiny_llama_dir), *flags]))
        return {spec.name: spec.argv for spec in plan_suite(config).specs}

    with_gateway = specs("--tls-dir", str(tls_dir), "--envoy")
    for name in ("prefill-0", "decode-1"):
        argv = with_gateway[name]
        args = replica_parser().parse_args(argv[argv.index("services.replica") + 1:])
        assert replica_options(args).tls is not None and args.tls_dir == tls_dir
    gateway = with_gateway["gateway"]
    assert gateway_options(gateway_parser().parse_args(
        gateway[gateway.index("gateway") + 1:])).tls is not None
    assert "--upstream-tls-dir" not in with_gateway["envoy"]
    envoy = specs("--tls-dir", str(tls_dir), "--envoy", "--no-gateway")["envoy"]
    assert envoy[envoy.index("--upstream-tls-dir") + 1] == str(tls_dir)
    plain = specs("--no-suite-tls", "--envoy")
    assert not any("--tls-dir" in argv or "--upstream-tls-dir" in argv for argv in plain.values())
