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


def load_tokenizer(model_dir: str | Path) -> Any:
    """The model directory's tokenizer (a transformers fast tokenizer), from local files only."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(
            f"model directory {str(model_dir)!r} does not exist; expected a local Hugging Face "
            "model directory with tokenizer files"
        )
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


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
