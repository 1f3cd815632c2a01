"""Building a model from a local Hugging Face directory: dtype choice and safetensors weights.

Owns finding the checkpoint files (one file, or shards named by
``model.safetensors.index.json``), streaming their tensors (MXFP4 pairs dequantized on the
way, ``layers.mxfp4``) into a freshly built network of the registry in the requested dtype
and device, the weights' memory by kind, and the user-facing ``dtype`` setting. It does not
own the architecture mapping (``arch_config``, ``registry``) or the networks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.attention.selector import get_attention_backend_cls
from engine_common.model.causal_lm import CausalLM
from engine_common.model.layers.mxfp4 import Mxfp4Stats, dequantize_pairs
from engine_common.model.packed_linear import bf16_packing_supported
from engine_common.model.registry import network_class
from engine_common.model.weight_memory import WeightMemory
from engine_common.parallel.group import SINGLE, TensorParallel

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_SHARD_INDEX = "model.safetensors.index.json"

logger = logging.getLogger(__name__)


def resolve_dtype(name: str, arch: ModelArchConfig,
                  device: torch.device | str = "cpu") -> torch.dtype:
    """"auto" is the checkpoint's dtype (float32 when config.json names none), except a bf16
    checkpoint on a CPU without a bf16 matmul (AVX2-only machines), where bf16 runs 3.2x
    slower than float32 (``make bench-cpu-dtype``): float32 there."""
    if name == "auto":
        dtype = _DTYPE_NAMES[arch.dtype or "float32"]
        if (dtype == torch.bfloat16 and torch.device(device).type == "cpu"
                and not bf16_packing_supported()):
            logger.info("this CPU has no bf16 matmul (AVX512 or AVX-NE-CONVERT): running the "
                        "bf16 checkpoint in float32, which is faster here (--dtype bfloat16 "
                        "keeps bf16)")
            return torch.float32
        return dtype
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choices: auto, {', '.join(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index_path = model_dir / _SHARD_INDEX
    if index_path.is_file():
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} names shard(s) that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {str(model_dir)!r}; Tandem loads Hugging Face "
            "checkpoints saved as safetensors (save_pretrained(safe_serialization=True))"
        )
    return files


def iterate_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) one tensor at a time, so peak memory stays near one tensor."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    attention_backend: str,
    pack_weights: bool = True,
    pack_float32: bool = False,
    parallel: TensorParallel = SINGLE,
) -> CausalLM:
    """The model in ``dtype`` on ``device``, its weights read from ``model_dir``; on the CPU in
    bf16 its projections are packed for oneDNN unless ``pack_weights`` is False (see
    ``packed_linear``: the same outputs up to rare last-bit near-ties), and in float32 too with
    ``pack_float32`` (float32 standing in for a bf16 checkpoint). ``model.weight_memory``
    says what the weights take. Under tensor parallelism (``parallel``) the model is this
    rank's part of it (``engine_common.parallel.sharding``)."""
    arch = ModelArchConfig.from_model_dir(model_dir)
    device = torch.device(device)
    files = safetensors_files(model_dir)
    backend_cls = get_attention_backend_cls(attention_backend, device)
    model = network_class(arch.architecture)(arch, backend_cls, dtype, device, parallel)
    stats = Mxfp4Stats()
    model.load_weights(dequantize_pairs(iterate_checkpoint(files), stats))
    if stats.tensors and arch.quantization != "mxfp4":
        raise ValueError(f"checkpoint has MXFP4 tensors ({stats.names[0]!r}, ...) but its "
                         "config.json names no mxfp4 quantization_config")
    if pack_weights:
        model.pack_linear_weights(float32=pack_float32)
    model.weight_memory = WeightMemory.of(model, stats.packed_bytes)
    return model.eval()
