"""The model a server answers for, under the name clients use.

Owns the served name (``--served-model-name``, default: the model directory's basename), the
other names a request may use for it, the names of the LoRA adapters served beside it, and
reading a request's ``model`` field: the base model, or the adapter it names. It does not own
loading the model or its adapters (the engine) or the model list's wire shape
(``openai_api``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.frontend.errors import NotFound, quoted


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int
    # Other names a request may use: the model directory's basename and its full path.
    aliases: frozenset[str] = frozenset()
    created: int = field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    # LoRA adapters served beside the model (``--lora-modules``), by the names requests use.
    lora_names: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        clash = self.lora_names & (self.aliases | {self.name})
        if clash:
            raise ValueError(f"LoRA adapter names {sorted(clash)} are names of the base "
                             "model; name the adapters otherwise")

    @classmethod
    def for_directory(cls, model_dir: str, max_model_len: int,
                      served_name: str | Sequence[str] | None = None,
                      lora_names: Iterable[str] = ()) -> ServedModel:
        """Served as ``served_name`` (one name, or several as vLLM's ``--served-model-name``:
        the first is the name, the others aliases), default the directory's name."""
        path = Path(model_dir)
        names = [served_name] if isinstance(served_name, str) else list(served_name or ())
        names = [name for name in names if name] or [path.name]
        return cls(
            name=names[0],
            max_model_len=max_model_len,
            aliases=frozenset({path.name, str(model_dir), *names[1:]}),
            lora_names=frozenset(lora_names),
        )

    def resolve(self, requested: str) -> str | None:
        """The LoRA adapter a request's ``model`` names, or None for the base model (an
        empty name, the served name or an alias); raises NotFound (OpenAI's
        "model_not_found") for anything else."""
        if requested in self.lora_names:
            return requested
        if requested and requested != self.name and requested not in self.aliases:
            adapters = (f", or a LoRA adapter: {', '.join(map(repr, sorted(self.lora_names)))}"
                        if self.lora_names else "")
            raise NotFound(
                f"model {quoted(requested)} is not served here; use {self.name!r} "
                f"(or leave model empty for the default){adapters}",
                reason="model_not_found", param="model")
        return None

    def response_name(self, lora_name: str | None) -> str:
        """The ``model`` an answer names: the adapter's, or the served name."""
        return lora_name or self.name
