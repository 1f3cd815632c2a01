"""Choosing the attention backend class by name and device.

Owns the mapping from the configured name ("auto", "torch", "triton") to a backend class.
The Triton backend is imported only when chosen, so CPU-only installs never import Triton.
"""

from __future__ import annotations

import torch

from engine_common.model.attention.backend import AttentionBackend

ATTENTION_BACKEND_CHOICES = ("auto", "torch", "triton")


def get_attention_backend_cls(name: str, device: torch.device) -> type[AttentionBackend]:
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        from engine_common.model.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend
    if name == "triton":
        from engine_common.model.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend
    raise ValueError(
        f"unknown attention backend {name!r}; choices: {', '.join(ATTENTION_BACKEND_CHOICES)}"
    )
