"""The shape of one engine's paged KV cache, as two replicas must agree on it.

Owns the description of the KV layout (model, dtype, layer/head/block geometry), its
fingerprint (the value both sides of a transfer compare before any byte moves) and the
per-block byte count. It does not own the cache tensor (the model runner allocates it) or
block bookkeeping (the engine's block pool).

The cache this describes is the engine's one tensor
``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_size]`` (see
``engine_common/model/attention/kv_cache_layout.py``): a block's bytes, every layer's K and
V, are one contiguous stretch of ``bytes_per_block``, and so are a run of consecutive
blocks'. ``num_blocks`` is deliberately left out: replicas with different cache sizes can
exchange blocks. Under tensor parallelism the cache is one rank's (``num_kv_heads`` is the
heads per rank) and ``tensor_parallel_size`` says how many ranks the replica has: the
handshake carries both, and a pull where either side has several ranks moves each rank's
heads (``rank_layout``, ``rank_reader``).

Fingerprint versions: 1 was the layer-major cache ``[num_layers, 2, num_blocks,
block_size, num_kv_heads, head_size]``; 2 is the block-major, head-major one. Both sides
compare fingerprints before any byte moves, so a peer of the old layout is refused (a
``layout_mismatch``, counted, and the request recomputes) and never read wrong;
``previous_layout_fingerprint`` lets the refusal say that it is the old layout.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are: a gateway reads layouts without it
    import torch

_FINGERPRINT_VERSION = 2
_PREVIOUS_FINGERPRINT_VERSION = 1  # the layer-major cache (see the module docstring)

# The KV-cache dtypes an engine allocates, by ``KvLayout.dtype``, and their sizes in bytes.
ITEM_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the spelling ``KvLayout.dtype`` uses."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KvLayout:
    model: str
    dtype: str  # a torch dtype name without the "torch." prefix, e.g. "bfloat16"
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    # The replica's tensor-parallel ranks; ``num_kv_heads`` is each rank's.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in ITEM_SIZES:
            raise ValueError(f"unsupported KV-cache dtype {self.dtype!r} (one of "
                             f"{', '.join(ITEM_SIZES)})")
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size",
                     "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def of_cache(cls, model: str, kv_cache: torch.Tensor,
                 tensor_parallel_size: int = 1) -> KvLayout:
        """The layout of an existing cache tensor (one rank's, of ``tensor_parallel_size``)."""
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError(
                "expected a cache of shape [num_blocks, num_layers, 2, num_kv_heads, "
                f"block_size, head_size], got {tuple(kv_cache.shape)}"
            )
        _, num_layers, _, num_kv_heads, block_size, head_size = kv_cache.shape
        return cls(
            model=model,
            dtype=dtype_name(kv_cache.dtype),
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            block_size=block_size,
            tensor_parallel_size=tensor_parallel_size,
        )

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elements = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size
        return elements * ITEM_SIZES[self.dtype]

    def fingerprint(self) -> str:
        """A stable hex digest of every field and of the cache's memory order: equal iff
        the layouts are equal.

        Stable across processes, machines and Python versions (canonical JSON, sha256),
        unlike ``hash()``.
        """
        return self._fingerprint(_FINGERPRINT_VERSION)

    def previous_layout_fingerprint(self) -> str:
        """The fingerprint an engine of the previous (layer-major) cache layout gives these
        same fields: a peer that sends it runs the previous release."""
        return self._fingerprint(_PREVIOUS_FINGERPRINT_VERSION)

    def mismatch(self, theirs: str, side: str) -> str:
        """Why a peer's layout fingerprint ``theirs`` is refused, for an error's detail."""
        if theirs == self.previous_layout_fingerprint():
            return (f"the {side} runs the previous KV cache layout (layer-major, fingerprint "
                    f"version {_PREVIOUS_FINGERPRINT_VERSION}; this side is block-major, "
                    f"version {_FINGERPRINT_VERSION}): upgrade it; until then its requests "
                    "recompute")
        return f"{side} layout {theirs}, ours {self.fingerprint()}"

    def _fingerprint(self, version: int) -> str:
        fields = asdict(self)
        if self.tensor_parallel_size == 1:
            # Left out: a single-rank layout keeps the fingerprint it had before the field.
            del fields["tensor_parallel_size"]
        canonical = json.dumps(
            {"v": version, **fields}, sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    def check_cache(self, kv_cache: torch.Tensor) -> None:
        """Raise ValueError unless ``kv_cache`` is a contiguous cache of this layout."""
        expected = type(self).of_cache(self.model, kv_cache, self.tensor_parallel_size)
        if expected != self:
            raise ValueError(f"cache of layout {expected} does not match {self}")
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache tensor must be contiguous")
