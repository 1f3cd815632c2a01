"""MXFP4 weights as GPT-OSS checkpoints store them: ``<name>_blocks`` (uint8, two 4-bit
E2M1 values per byte, low nibble first, 16 bytes = one group of 32 values) and
``<name>_scales`` (uint8, one power-of-two exponent per group, biased by 127).

Owns checking a block/scale pair and turning it into the dense tensor the unquantized
checkpoint would hold under ``<name>`` (dequantized at load: the experts then run through
the same batched path as every other MoE model). It does not own where that tensor goes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

# The 16 E2M1 values, by 4-bit code.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BYTES_PER_GROUP = 16
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"


def check_pair(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Raises ValueError naming ``name`` unless ``blocks`` [..., G, 16] and ``scales``
    [..., G] are a well-formed uint8 pair."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensor {name!r}: blocks and scales must be uint8, got "
                         f"{blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BYTES_PER_GROUP:
        raise ValueError(f"MXFP4 tensor {name!r}: blocks must end in a dimension of "
                         f"{BYTES_PER_GROUP} bytes, got shape {tuple(blocks.shape)}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 tensor {name!r}: blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} do not pair (scales must be blocks' shape "
                         "without its last dimension)")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[E, rows, G, 16] blocks and [E, rows, G] scales -> [E, G * 32, rows] in ``dtype``:
    the layout of the unquantized GPT-OSS expert tensor (input dim before output dim)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.empty(*blocks.shape[:-1], BYTES_PER_GROUP * 2, dtype=torch.float32)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents[..., None].float())
    dense = values.reshape(*blocks.shape[:-2], -1)  # [E, rows, G * 32]
    return dense.transpose(-1, -2).contiguous().to(dtype)


@dataclass
class Mxfp4Stats:
    """What the MXFP4 tensors of a checkpoint took: packed on disk, dense once loaded."""

    packed_bytes: int = 0
    tensors: int = 0
    names: list[str] = field(default_factory=list)


def dequantize_pairs(weights: Iterable[tuple[str, torch.Tensor]],
                     stats: Mxfp4Stats) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes plain tensors through; joins each ``<name>_blocks``/``<name>_scales`` pair
    (in either order) into one dense ``<name>``. Raises ValueError naming the tensor for a
    malformed pair or a half without its partner."""
    pending: dict[str, tuple[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = next((s for s in (BLOCKS_SUFFIX, SCALES_SUFFIX) if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name[: -len(suffix)]
        other = pending.pop(base, None)
        if other is None:
            pending[base] = (suffix, tensor)
            continue
        if other[0] == suffix:
            raise ValueError(f"MXFP4 tensor {name!r} appears twice")
        blocks, scales = (tensor, other[1]) if suffix == BLOCKS_SUFFIX else (other[1], tensor)
        check_pair(base, blocks, scales)
        stats.packed_bytes += blocks.numel() + scales.numel()
        stats.tensors += 1
        stats.names.append(base)
        yield base, dequantize(blocks, scales)
    for base, (suffix, _) in pending.items():
        partner = SCALES_SUFFIX if suffix == BLOCKS_SUFFIX else BLOCKS_SUFFIX
        raise ValueError(f"MXFP4 tensor {base + suffix!r} has no {base + partner!r}")
