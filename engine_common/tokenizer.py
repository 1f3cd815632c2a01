"""Loading a model's tokenizer and the token ids that end generation.

Owns reading the tokenizer of a local Hugging Face model directory (never the network) and
combining the end-of-sequence ids the tokenizer and ``generation_config.json`` declare. It
does not own detokenization or stop-string handling (the detokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer


def load_tokenizer(model_dir: str | Path, chat_template: str | None = None) -> Any:
    """The model directory's tokenizer (a transformers fast tokenizer), from local files only.

    ``chat_template`` replaces the model's own (vLLM's ``--chat-template``): a file holding a
    Jinja template, or the template itself; for a model that has none (a base model) or
    whose template needs fixing.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(
            f"model directory {str(model_dir)!r} does not exist; expected a local Hugging Face "
            "model directory with tokenizer files"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(template: str) -> str:
    """The template a ``--chat-template`` value names: a file's text, or the value itself
    when it is a template (it has Jinja markup); raises ValueError for neither."""
    if "{{" in template or "{%" in template:
        return template
    path = Path(template)
    if not path.is_file():
        raise ValueError(f"chat template {template!r} is neither a file nor a Jinja template")
    return path.read_text(encoding="utf-8")


def eos_token_ids(model_dir: str | Path, tokenizer: Any) -> frozenset[int]:
    """Every id that ends generation: the tokenizer's eos plus generation_config's eos_token_id.

    Chat models often stop on a turn-end token that only generation_config.json lists.
    """
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            configured = json.load(f).get("eos_token_id")
        if isinstance(configured, int):
            ids.add(configured)
        elif isinstance(configured, list):
            ids.update(int(i) for i in configured)
    return frozenset(ids)
