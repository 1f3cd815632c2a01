"""The sampling settings a model's creator recommends, from its ``generation_config.json``.

Owns reading them: ``temperature``, ``top_p``, ``top_k``, ``min_p``, the three penalties and
``max_new_tokens`` (as the default ``max_tokens``), where the file sets them, become the
defaults of every request that does not set its own, as vLLM does by default
(``--generation-config auto``; ``vllm`` keeps the library's defaults: temperature 1, no
top-k/top-p/min-p, no penalties; a folder path reads that folder's file instead of the
model's). ``--override-generation-config`` sets values over the file's (or alone, with
``vllm``). A model whose card says "use temperature 0.6, top-p 0.95" is then served that way
to clients that send neither. It does not own applying them
(``services.replica.openai_api``) or the stop ids the same file lists
(``tokenizer.eos_token_ids``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from engine_common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json's keys that are request defaults, by their SamplingParams names
# (Hugging Face's max_new_tokens is vLLM's max_tokens).
DEFAULT_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                  "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}
GENERATION_CONFIG_MODES = ("auto", "vllm")


def load_sampling_defaults(model_dir: str | Path, mode: str = "auto",
                           override: Mapping[str, object] | None = None
                           ) -> dict[str, float | int]:
    """The defaults ``mode`` asks for: "auto" reads the model directory's
    ``generation_config.json`` (nothing if it has none), "vllm" gives none, any other value
    names a folder whose ``generation_config.json`` is read; ``override`` (its keys those of
    the file) sets values over them. Raises ValueError for a folder without the file, an
    override key that is no default, or values no request could use."""
    config: dict[str, object] = {}
    sources = []
    if mode != "vllm":
        path = Path(model_dir if mode == "auto" else mode) / "generation_config.json"
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            sources.append(str(path))
        elif mode != "auto":
            raise ValueError(f"--generation-config must be {' or '.join(GENERATION_CONFIG_MODES)}"
                             f" or a folder holding a generation_config.json; {path} is not a "
                             "file")
    if override:
        wrong = sorted(key for key, value in override.items() if key not in DEFAULT_FIELDS
                       or not isinstance(value, int | float) or isinstance(value, bool))
        if wrong:
            raise ValueError(f"--override-generation-config: {wrong} are not numeric request "
                             f"defaults; it takes numbers for {sorted(DEFAULT_FIELDS)}")
        config = {**config, **override}
        sources.append("--override-generation-config")
    source = " with ".join(sources)
    defaults: dict[str, float | int] = {
        name: value for key, name in DEFAULT_FIELDS.items()
        if isinstance(value := config.get(key), int | float) and not isinstance(value, bool)}
    try:
        SamplingParams(**defaults)  # type: ignore[arg-type]
    except ValueError as error:
        raise ValueError(f"{source} sets sampling defaults no request could use ({error}); "
                         "fix it or serve with --generation-config vllm") from error
    if defaults:
        logger.info("sampling defaults from %s (a request's own values win): %s", source,
                    defaults)
    return defaults
