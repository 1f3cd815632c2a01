"""Loading a model's tokenizer and the token ids that end generation.

Owns reading the tokenizer of a local Hugging Face model directory (never the network) and
combining the end-of-sequence ids the tokenizer and ``generation_config.json`` declare. It
does not own detokenization or stop-string handling (the detokenizer).

transformers is imported where a tokenizer is loaded, not here, and only as far as the
tokenizer needs: ``AutoTokenizer`` imports transformers' configuration classes and with them
torch (4-5 s of CPU), which the gateway does not otherwise need.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any


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
    tokenizer_class = _known_tokenizer_class(model_dir)
    if tokenizer_class is not None:
        tokenizer = tokenizer_class.from_pretrained(str(model_dir), local_files_only=True)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            str(model_dir), local_files_only=True, **_declared_model_config(model_dir))
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


# The class AutoTokenizer (transformers 5.23) picks, by config.json's model_type, for a
# tokenizer_config.json that declares one of _GENERIC_CLASSES and no auto_map: the class it
# registers for a model type whose hub files it knows to declare the wrong class (qwen2), else
# the generic one. Mistral's is MistralCommonBackend where mistral_common is installed: there
# AutoTokenizer decides. tests/test_model_forward.py checks each against AutoTokenizer's choice.
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
_CLASS_BY_MODEL_TYPE = {"llama": "TokenizersBackend", "mistral": "TokenizersBackend",
                        "qwen2": "Qwen2Tokenizer", "qwen3": "TokenizersBackend"}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _known_tokenizer_class(model_dir: Path) -> Any:
    """The tokenizer class AutoTokenizer would pick for ``model_dir``, where that is certain
    without importing AutoTokenizer (``_CLASS_BY_MODEL_TYPE``); None where AutoTokenizer must
    decide. Only an absolute directory: AutoTokenizer matches a name like a hub id (org/name)
    against a list of checkpoints it loads generically, which no absolute path matches."""
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    model_config = _read_json(model_dir / "config.json")
    if tokenizer_config is None or model_config is None or not model_dir.is_absolute():
        return None
    if tokenizer_config.get("tokenizer_class") not in _GENERIC_CLASSES or \
            "auto_map" in tokenizer_config:
        return None
    name = _CLASS_BY_MODEL_TYPE.get(str(model_config.get("model_type")))
    if name is None or (model_config.get("model_type") == "mistral"
                        and importlib.util.find_spec("mistral_common") is not None):
        return None
    import transformers  # the tokenizer classes only (its lazy module imports just them)

    return getattr(transformers, name)


def _declared_model_config(model_dir: Path) -> dict[str, Any]:
    """``AutoTokenizer``'s ``config`` argument, when the directory lets us skip its own.

    Without one, ``AutoTokenizer`` imports the model's configuration class only to read its
    ``model_type``, and for some architectures (Llama: the default model) that import pulls in
    transformers' modeling stack, 1.5 s of every replica's, engine core's and gateway's start.
    When ``tokenizer_config.json`` names the tokenizer class, the class is all it looks up by
    the config's type, so a plain config carrying the same ``model_type`` and path picks the
    same tokenizer (tests/test_model_forward.py checks it per architecture). Otherwise nothing
    is passed and ``AutoTokenizer`` decides as usual.
    """
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    model_config = _read_json(model_dir / "config.json")
    if tokenizer_config is None or model_config is None:
        return {}
    model_type = model_config.get("model_type")
    if not tokenizer_config.get("tokenizer_class") or not isinstance(model_type, str):
        return {}
    from transformers import PreTrainedConfig

    config = PreTrainedConfig()
    # Set as AutoConfig would set them on the model's own config (model_type is a class
    # attribute there, and the typed constructor takes none of these).
    vars(config).update(model_type=model_type, _name_or_path=str(model_dir),
                        tokenizer_class=model_config.get("tokenizer_class"))
    return {"config": config}


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
