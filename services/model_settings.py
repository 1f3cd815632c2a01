"""The flags that say how a model's requests are shaped (``ModelSettings``): its chat
template, the syntax of its tool calls, its sampling defaults and the LoRA adapters served
beside it.

Every process that resolves requests (a replica; the gateway, which renders chats, parses
calls and applies defaults itself) must be given them alike, and so must what starts those
processes (``tandem up``, ``tandem render k8s``): this module adds them to each one's
parser, reads them back and writes them out again as arguments, so that their names,
choices and defaults are one. It does not own what they do
(``engine_common.tokenizer.read_chat_template``, ``tool_call_parsers``,
``engine_common.sampling_defaults``, ``engine_common.lora``).
"""

from __future__ import annotations

import argparse
import json

from engine_common.config import ModelSettings
from services.frontend.tools.parsers import CALL_FORMATS


def _json_object(text: str) -> dict[str, float | int]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text!r}") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def _lora_module(text: str) -> tuple[str, str]:
    name, separator, path = text.partition("=")
    if not separator or not name or not path:
        raise argparse.ArgumentTypeError(f"a LoRA module is NAME=PATH, got {text!r}")
    return name, path


def add_model_settings_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template", default=None,
                        help="a chat template used instead of the model's (a file, or the "
                             "Jinja text itself), for a model without one or one that needs "
                             "fixing")
    parser.add_argument("--tool-call-parser", choices=CALL_FORMATS, default=None,
                        help='the syntax the model writes tool calls in, for tool_choice '
                             '"auto" (default: the one its chat template teaches, if known)')
    parser.add_argument("--generation-config", default="auto",
                        help="sampling defaults of requests that leave them unset: auto, the "
                             "model's generation_config.json (temperature, top_p, top_k, "
                             "min_p, the penalties, max_new_tokens as a chat's max_tokens; as "
                             "vLLM); vllm, the library's; or a folder holding a "
                             "generation_config.json (default: %(default)s)")
    parser.add_argument("--override-generation-config", type=_json_object, default={},
                        metavar="JSON",
                        help='values set over those defaults, by generation_config.json\'s '
                             'keys, e.g. \'{"temperature": 0.5, "max_new_tokens": 512}\' '
                             "(vLLM's flag)")
    parser.add_argument("--lora-modules", type=_lora_module, nargs="+", default=[],
                        metavar="NAME=PATH",
                        help="LoRA adapters served beside the base model: a request whose "
                             "model is NAME runs with the PEFT adapter in directory PATH "
                             "(vLLM's flag)")
    parser.add_argument("--max-loras", type=_positive_int, default=None,
                        help="at most this many different LoRA adapters in one step; a "
                             "request of another adapter waits (vLLM's flag; default: no cap)")
    parser.add_argument("--max-lora-rank", type=_positive_int, default=None,
                        help="refuse LoRA adapters of a higher rank, at start and when loaded "
                             "at run time (vLLM's flag; default: any rank)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="serve LoadLoraAdapter / UnloadLoraAdapter (POST "
                             "/v1/load_lora_adapter, /v1/unload_lora_adapter): adapters are "
                             "loaded from a directory the caller names on the server's file "
                             "system, so only where callers are trusted (vLLM's "
                             "VLLM_ALLOW_RUNTIME_LORA_UPDATING)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def model_settings_from_args(args: argparse.Namespace) -> ModelSettings:
    return ModelSettings(chat_template=args.chat_template,
                         tool_call_parser=args.tool_call_parser,
                         generation_config=args.generation_config,
                         override_generation_config=args.override_generation_config,
                         lora_modules=_unique_lora_names(args.lora_modules),
                         max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                         allow_runtime_lora_updating=args.allow_runtime_lora_updating)


def _unique_lora_names(modules: list[tuple[str, str]]) -> dict[str, str]:
    names = [name for name, _ in modules]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise SystemExit(f"error: --lora-modules names {repeated} more than once")
    return dict(modules)


def model_settings_args(settings: ModelSettings) -> list[str]:
    """The flags that give another process these settings."""
    args = ["--generation-config", settings.generation_config]
    if settings.chat_template:
        args += ["--chat-template", settings.chat_template]
    if settings.tool_call_parser:
        args += ["--tool-call-parser", settings.tool_call_parser]
    if settings.override_generation_config:
        args += ["--override-generation-config",
                 json.dumps(settings.override_generation_config)]
    if settings.lora_modules:
        args += ["--lora-modules",
                 *(f"{name}={path}" for name, path in settings.lora_modules.items())]
    if settings.max_loras is not None:
        args += ["--max-loras", str(settings.max_loras)]
    if settings.max_lora_rank is not None:
        args += ["--max-lora-rank", str(settings.max_lora_rank)]
    if settings.allow_runtime_lora_updating:
        args.append("--allow-runtime-lora-updating")
    return args
