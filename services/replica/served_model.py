"""The model a server answers for, under the name clients use.

Owns the served name (``--served-model-name``, default: the model directory's basename), the
other names a request may use for it, and the check that a request's ``model`` field names it.
It does not own loading the model (the engine) or the model list's wire shape
(``openai_api``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from services.replica.errors import InvalidArgument


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int
    # Other names a request may use: the model directory's basename and its full path.
    aliases: frozenset[str] = frozenset()
    created: int = field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"

    @classmethod
    def for_directory(cls, model_dir: str, max_model_len: int,
                      served_name: str | None = None) -> ServedModel:
        path = Path(model_dir)
        return cls(
            name=served_name or path.name,
            max_model_len=max_model_len,
            aliases=frozenset({path.name, str(model_dir)}),
        )

    def check(self, requested: str) -> None:
        """Accept an empty name (the default model), the served name or an alias."""
        if requested and requested != self.name and requested not in self.aliases:
            raise InvalidArgument(
                f"model {requested!r} is not served here; use {self.name!r} "
                "(or leave model empty for the default)")
