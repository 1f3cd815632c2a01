"""The lines an engine logs at startup about its model, as vLLM's startup log does: the
architecture and its layer types, the weights' memory by kind, the KV cache's blocks and
the most sequences of ``max_model_len`` tokens it holds at once, the attention backend.

Owns the wording only; the numbers come from the loaded model and the sized cache.
"""

from __future__ import annotations

from collections import Counter

from engine_common.model.arch_config import SLIDING_ATTENTION
from engine_common.model.causal_lm import CausalLM


def layer_summary(model: CausalLM) -> str:
    arch = model.arch
    kinds = Counter(
        f"sliding-window attention ({arch.layer_window(i)} tokens)"
        if arch.layer_type(i) == SLIDING_ATTENTION else "full attention"
        for i in range(arch.num_layers))
    text = ", ".join(f"{n} x {kind}" for kind, n in kinds.items())
    if arch.attention_sinks:
        text += ", attention sinks"
    if arch.is_moe:
        sparse = sum(arch.is_sparse_layer(i) for i in range(arch.num_layers))
        text += (f"; {sparse} MoE layers of {arch.num_experts} experts, top-"
                 f"{arch.num_experts_per_tok}")
    return text


def startup_summary(model: CausalLM, num_blocks: int, block_size: int,
                    max_model_len: int) -> list[str]:
    """One line per fact; the KV line counts every layer keeping every block of a sequence
    (sliding-window layers included: see docs/engine.md)."""
    blocks_per_seq = -(-max_model_len // block_size)
    lines = [f"architecture {model.arch.architecture}: {layer_summary(model)}"]
    if model.weight_memory is not None:
        lines.append(f"weights: {model.weight_memory.describe()}")
    lines.append(f"KV cache: {num_blocks} blocks of {block_size} tokens; maximum concurrency "
                 f"at max_model_len {max_model_len}: {num_blocks // blocks_per_seq} sequences")
    lines.append(f"attention backend: {model.attention_backend.name}"
                 + (" (+ PyTorch sink/sliding-window path for those layers)"
                    if model.arch.attention_sinks or model.arch.attention_window else ""))
    return lines
