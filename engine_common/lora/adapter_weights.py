"""A PEFT LoRA adapter's weights: ``adapter_model.safetensors`` read into per-module A and B.

Owns the tensor names PEFT saves (``base_model.model.model.layers.{i}.{self_attn|mlp}.
{module}.lora_{A|B}.weight``), and checks each against the base model: the layer exists, the
module is a projection Tandem serves, A is [r, in] and B is [out, r] with the rank the
configuration gives that module. It does not own the configuration checks (``adapter_config``)
or where the weights go in the model (``CausalLM.add_lora_adapter``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine_common.lora.adapter_config import SUPPORTED_TARGETS, LoraAdapterConfig

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_LORA_TENSOR = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<module>\w+)"
    r"\.lora_(?P<matrix>[AB])\.weight")
_PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
            "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass(frozen=True)
class LoraModuleWeights:
    """One adapted projection: its delta is ``((x @ a^T) @ b^T) * scaling``."""

    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [out_features, r]
    scaling: float


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str
    # By (layer index, Hugging Face module name), e.g. (0, "q_proj").
    modules: dict[tuple[int, str], LoraModuleWeights]


def _unservable(name: str, key: str) -> ValueError:
    if "embed_tokens" in key or "lm_head" in key:
        return ValueError(f"LoRA adapter {name!r} adapts the embeddings or the LM head "
                          f"({key!r}), which Tandem does not serve")
    return ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A or B matrix of "
                      f"a projection Tandem serves ({', '.join(SUPPORTED_TARGETS)})")


def _read_matrices(name: str, path: Path, projection_shapes: Mapping[str, tuple[int, int]],
                   num_layers: int) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """Every LoRA tensor of the file by (layer, module) and matrix ("A", "B"), each checked to
    belong to a layer and projection the model has."""
    matrices: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for key in f.keys():
            match = _LORA_TENSOR.fullmatch(key.removeprefix(_PEFT_PREFIX))
            if match is None:
                raise _unservable(name, key)
            module = match["module"]
            if _PARENTS.get(module) != match["parent"]:
                raise _unservable(name, key)
            layer = int(match["layer"])
            if layer >= num_layers:
                raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}, "
                                 f"but the model has {num_layers} layers")
            if module not in projection_shapes:
                raise ValueError(f"LoRA adapter {name!r}: the model has no {module} ({key!r})")
            matrices.setdefault((layer, module), {})[match["matrix"]] = f.get_tensor(key)
    return matrices


def load_adapter_weights(config: LoraAdapterConfig, adapter_dir: str | Path,
                         projection_shapes: Mapping[str, tuple[int, int]],
                         num_layers: int) -> LoraAdapter:
    """Reads the adapter's A and B matrices; ``projection_shapes`` gives the base model's
    (in_features, out_features) of each projection by its Hugging Face name. Raises
    ValueError naming the adapter for a missing file, a tensor of a layer or module the
    model lacks, or a shape that does not fit the model."""
    name = config.name
    path = Path(adapter_dir) / ADAPTER_WEIGHTS_FILE
    if not path.is_file():
        other = " (only safetensors is read: save with safe_serialization=True)" \
            if (Path(adapter_dir) / "adapter_model.bin").is_file() else ""
        raise ValueError(f"LoRA adapter {name!r}: no {ADAPTER_WEIGHTS_FILE} in "
                         f"{str(adapter_dir)!r}{other}")
    try:
        matrices = _read_matrices(name, path, projection_shapes, num_layers)
    except (OSError, SafetensorError) as e:
        # A damaged or unreadable file is the adapter's fault, as a bad config is: the
        # caller (a runtime load, say) must get a ValueError it can report, not a crash.
        raise ValueError(f"LoRA adapter {name!r}: cannot read {str(path)!r}: {e}") from e
    if not matrices:
        raise ValueError(f"LoRA adapter {name!r}: {str(path)!r} holds no LoRA weights")
    modules: dict[tuple[int, str], LoraModuleWeights] = {}
    for (layer, module), pair in sorted(matrices.items()):
        module_key = f"model.layers.{layer}.{_PARENTS[module]}.{module}"
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise ValueError(f"LoRA adapter {name!r}: {module_key} has no lora_{missing} weight")
        a, b = pair["A"], pair["B"]
        in_features, out_features = projection_shapes[module]
        r = config.rank_of(module_key)
        if tuple(a.shape) != (r, in_features) or tuple(b.shape) != (out_features, r):
            raise ValueError(
                f"LoRA adapter {name!r}: {module_key} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, but the model needs [r, {in_features}] and "
                f"[{out_features}, r] with r={r} (the adapter's rank for that module): "
                "was it trained for another base model?")
        modules[(layer, module)] = LoraModuleWeights(a, b, config.scaling_of(module_key))
    return LoraAdapter(name, str(adapter_dir), modules)
