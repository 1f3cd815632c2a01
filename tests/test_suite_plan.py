"""The replicas and the gateway get the same model settings (``tandem up``'s plan, and the
flags each of them reads).

The gateway renders chats, parses tool calls and applies sampling defaults itself, so the
flags that decide them (``--chat-template``, ``--tool-call-parser``,
``--generation-config``) must reach it exactly as they reach every replica.
"""

from __future__ import annotations

import argparse

from deploy.supervisor import plan_suite
from gateway.__main__ import build_parser as gateway_parser
from gateway.__main__ import options_from_args as gateway_options
from services.replica.main import build_parser as replica_parser
from services.replica.main import options_from_args as replica_options
from tandem.cli import add_suite_args, suite_config


def served_argvs(*args: str) -> list[list[str]]:
    parser = argparse.ArgumentParser()
    add_suite_args(parser)
    suite = plan_suite(suite_config(parser.parse_args(list(args))))
    return [spec.argv for spec in suite.specs
            if "services.replica" in spec.argv or "gateway" in spec.argv]


def test_replicas_and_gateway_get_the_same_model_settings() -> None:
    served = served_argvs("--generation-config", "vllm", "--chat-template", "chat.jinja",
                          "--tool-call-parser", "mistral")
    assert len(served) == 3  # prefill, decode, gateway
    for argv in served:
        assert argv[argv.index("--generation-config") + 1] == "vllm"
        assert argv[argv.index("--chat-template") + 1] == "chat.jinja"
        assert argv[argv.index("--tool-call-parser") + 1] == "mistral"
    for argv in served_argvs():
        assert argv[argv.index("--generation-config") + 1] == "auto"
        assert "--chat-template" not in argv and "--tool-call-parser" not in argv


def test_the_replica_and_the_gateway_read_those_flags(tiny_llama_dir) -> None:
    flags = ["--model", str(tiny_llama_dir), "--generation-config", "vllm",
             "--chat-template", "chat.jinja", "--tool-call-parser", "llama3_json"]
    engine = replica_options(replica_parser().parse_args(flags)).engine
    assert (engine.generation_config, engine.chat_template, engine.tool_call_parser) == (
        "vllm", "chat.jinja", "llama3_json")
    gateway = gateway_options(gateway_parser().parse_args([*flags, "--replica", "h:1"]))
    assert (gateway.generation_config, gateway.chat_template, gateway.tool_call_parser) == (
        "vllm", "chat.jinja", "llama3_json")
