"""The sampling settings a model's creator recommends, from its ``generation_config.json``.

Owns reading them: ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
``repetition_penalty``, where the file sets them, become the defaults of every request that
does not set its own, as vLLM does by default (``--generation-config auto``; ``vllm`` keeps
the library's defaults: temperature 1, no top-k/top-p/min-p, no repetition penalty). A
model whose card says "use temperature 0.6, top-p 0.95" is then served that way to clients
that send neither. It does not own applying them (``services.replica.openai_api``) or the
stop ids the same file lists (``tokenizer.eos_token_ids``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engine_common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json's keys that are request defaults (the same names in SamplingParams).
DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_CONFIG_MODES = ("auto", "vllm")


def load_sampling_defaults(model_dir: str | Path, mode: str = "auto") -> dict[str, float | int]:
    """The defaults ``mode`` asks for: "auto" reads the model directory's
    ``generation_config.json`` (nothing if it has none), "vllm" gives none. Raises
    ValueError for an unknown mode or a file whose values no request could use."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation config must be one of {GENERATION_CONFIG_MODES}, "
                         f"got {mode!r}")
    path = Path(model_dir) / "generation_config.json"
    if mode == "vllm" or not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    defaults: dict[str, float | int] = {
        name: value for name in DEFAULT_FIELDS
        if isinstance(value := config.get(name), int | float) and not isinstance(value, bool)}
    try:
        SamplingParams(**defaults)  # type: ignore[arg-type]
    except ValueError as error:
        raise ValueError(f"{path} sets sampling defaults no request could use ({error}); "
                         "fix the file or serve with --generation-config vllm") from error
    if defaults:
        logger.info("sampling defaults from %s (a request's own values win): %s", path,
                    defaults)
    return defaults
