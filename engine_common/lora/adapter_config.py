"""A PEFT LoRA adapter's ``adapter_config.json``: whether Tandem can serve it, and the rank
and scaling of each module.

Owns the checks on the configuration (a plain LoRA on the decoder's linear projections:
no DoRA, no trained biases, no ``modules_to_save``, no embedding or LM-head targets) and
PEFT's scaling rule: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA, with ``r``
and ``lora_alpha`` per module where ``rank_pattern`` / ``alpha_pattern`` say so. It does
not own the weights (``adapter_weights``) or applying them (``linear_delta``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ADAPTER_CONFIG_FILE = "adapter_config.json"
# The projections an adapter may target, by their Hugging Face (and PEFT) names.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's shorthand for every linear layer but the output layer.
_ALL_LINEAR = "all-linear"
_EMBEDDING_TARGETS = ("embed_tokens", "lm_head")
# Settings that make an adapter something other than a plain LoRA on linear layers, with
# what they are, for the error message. Each is refused when set (truthy).
_UNSUPPORTED_SETTINGS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "lora_bias": "trained LoRA biases (lora_bias)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "parameter targets (target_parameters)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
}


def _pattern_key(patterns: Iterable[str], module_key: str) -> str | None:
    """The first pattern naming ``module_key`` (or a suffix of it), as PEFT matches them."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            return pattern
    return None


@dataclass(frozen=True)
class LoraAdapterConfig:
    """What the forward pass needs from an adapter's configuration."""

    name: str  # the adapter's served name, for messages
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        """The largest rank of any of its projections."""
        return max([self.r, *map(int, self.rank_pattern.values())])

    def rank_of(self, module_key: str) -> int:
        """The rank of the module at ``module_key`` ("model.layers.0.self_attn.q_proj")."""
        pattern = _pattern_key(self.rank_pattern, module_key)
        return self.r if pattern is None else int(self.rank_pattern[pattern])

    def scaling_of(self, module_key: str) -> float:
        """PEFT's ``scaling`` of that module; computed as PEFT does, so it is the same float."""
        pattern = _pattern_key(self.alpha_pattern, module_key)
        alpha = self.lora_alpha if pattern is None else self.alpha_pattern[pattern]
        r = self.rank_of(module_key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _check_targets(name: str, targets: object) -> None:
    if isinstance(targets, str):
        # "all-linear", or a regex over module names: what it matched is in the weights,
        # which ``adapter_weights`` checks module by module.
        if targets != _ALL_LINEAR and any(t in targets for t in _EMBEDDING_TARGETS):
            raise ValueError(f"LoRA adapter {name!r}: target_modules {targets!r} may target "
                             "the embeddings or the LM head, which Tandem does not serve")
        return
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"LoRA adapter {name!r}: target_modules must be a list of module "
                         f"names or a regex, got {targets!r}")
    unsupported = sorted({t for t in targets
                          if not isinstance(t, str) or t.split(".")[-1] not in SUPPORTED_TARGETS})
    if unsupported:
        embeddings = [t for t in unsupported if str(t).split(".")[-1] in _EMBEDDING_TARGETS]
        what = ("the embeddings or the LM head (" + ", ".join(map(str, embeddings)) + ")"
                if embeddings else "modules " + ", ".join(map(repr, unsupported)))
        raise ValueError(f"LoRA adapter {name!r} targets {what}; Tandem serves LoRA on "
                         f"{', '.join(SUPPORTED_TARGETS)} only")


def read_adapter_config(name: str, adapter_dir: str | Path) -> LoraAdapterConfig:
    """Reads and checks ``adapter_dir``'s adapter_config.json; ValueError names the adapter
    and what Tandem cannot serve.

    ``fan_in_fan_out`` is accepted and ignored: it describes Conv1D weights (GPT-2), and PEFT
    itself turns it off for ``nn.Linear`` targets; saved A and B are [r, in] and [out, r]
    either way."""
    path = Path(adapter_dir) / ADAPTER_CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no {ADAPTER_CONFIG_FILE} in {str(adapter_dir)!r}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {str(path)!r}: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"LoRA adapter {name!r}: {str(path)!r} is not a JSON object")
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type is {peft_type!r}, not 'LORA'; "
                         "Tandem serves LoRA adapters only")
    for key, what in _UNSUPPORTED_SETTINGS.items():
        if raw.get(key):
            raise ValueError(f"LoRA adapter {name!r} uses {what}, which Tandem does not serve")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise ValueError(f"LoRA adapter {name!r} trains biases (bias={bias!r}); Tandem "
                         "serves adapters with bias='none' only")
    _check_targets(name, raw.get("target_modules"))
    r = raw.get("r")
    alpha = raw.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, int | float):
        raise ValueError(f"LoRA adapter {name!r}: r must be a positive integer and lora_alpha "
                         f"a number, got r={r!r}, lora_alpha={alpha!r}")
    return LoraAdapterConfig(
        name=name,
        r=r,
        lora_alpha=alpha,
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern=dict(raw.get("rank_pattern") or {}),
        alpha_pattern=dict(raw.get("alpha_pattern") or {}),
    )
