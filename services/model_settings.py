"""The flags that say how a model's requests are shaped: its chat template, the syntax of its
tool calls and its sampling defaults.

Every process that resolves requests (a replica; the gateway, which renders chats, parses
calls and applies defaults itself) must be given them alike, and so must what starts those
processes (``tandem up``, ``tandem render k8s``): this module adds them to each one's
parser, so that their names, choices and defaults are one. It does not own what they do
(``engine_common.tokenizer.read_chat_template``, ``tool_call_parsers``,
``engine_common.sampling_defaults``).
"""

from __future__ import annotations

import argparse

from engine_common.sampling_defaults import GENERATION_CONFIG_MODES
from services.replica.tool_call_parsers import CALL_FORMATS


def add_model_settings_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template", default=None,
                        help="a chat template used instead of the model's (a file, or the "
                             "Jinja text itself), for a model without one or one that needs "
                             "fixing")
    parser.add_argument("--tool-call-parser", choices=CALL_FORMATS, default=None,
                        help='the syntax the model writes tool calls in, for tool_choice '
                             '"auto" (default: the one its chat template teaches, if known)')
    parser.add_argument("--generation-config", choices=GENERATION_CONFIG_MODES, default="auto",
                        help="sampling defaults of requests that leave them unset: auto, the "
                             "model's generation_config.json (temperature, top_p, top_k, "
                             "min_p, repetition_penalty, as vLLM); vllm, the library's "
                             "(default: %(default)s)")
