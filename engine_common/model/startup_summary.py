"""The lines an engine logs at startup about its model, as vLLM's startup log does: the
architecture and its layer types, the weights' memory by kind, the KV cache's blocks and
the most sequences of ``max_model_len`` tokens it holds at once, the attention backend.

With KV cache groups (``engine_common.kv_cache_groups``) the KV line says what each group
keeps of a sequence. Owns the wording only; the numbers come from the loaded model and the sized cache.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from engine_common.model.arch_config import SLIDING_ATTENTION
from engine_common.model.causal_lm import CausalLM

if TYPE_CHECKING:
    from engine_common.kv_cache_groups import KVCacheGroups


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
                    max_model_len: int, groups: KVCacheGroups | None = None) -> list[str]:
    """One line per fact. With one KV cache group (``groups`` None or single) the KV line
    counts every layer keeping every block of a sequence; with several, what each group
    keeps of a sequence at ``max_model_len`` (``kv_groups_line``)."""
    blocks_per_seq = -(-max_model_len // block_size)
    lines = [f"architecture {model.arch.architecture}: {layer_summary(model)}"]
    if model.weight_memory is not None:
        lines.append(f"weights: {model.weight_memory.describe()}")
    if groups is None or groups.is_single:
        lines.append(f"KV cache: {num_blocks} blocks of {block_size} tokens; maximum "
                     f"concurrency at max_model_len {max_model_len}: "
                     f"{num_blocks // blocks_per_seq} sequences")
    else:
        lines.append(kv_groups_line(groups, num_blocks, block_size, max_model_len))
    lines.append(f"attention backend: {model.attention_backend.name}"
                 + (" (+ PyTorch sink/sliding-window path for those layers)"
                    if model.arch.attention_sinks or model.arch.attention_window else ""))
    return lines


def kv_groups_line(groups: KVCacheGroups, num_blocks: int, block_size: int,
                   max_model_len: int) -> str:
    """The KV line of a cache split into groups: the blocks (each one group's at a time,
    ``layers_per_block`` layers), per group what a sequence of ``max_model_len`` tokens
    keeps, and the concurrency that leaves (a sliding group: the window's blocks and the
    one being filled, as vLLM counts; more while a long prefill chunk is computed)."""
    blocks_per_seq = -(-max_model_len // block_size)
    parts, per_seq = [], 0
    for group in groups.groups:
        kept = blocks_per_seq if group.window is None else min(
            blocks_per_seq, -(-(group.window - 1) // block_size) + 1)
        per_seq += kept
        kind = "full attention" if group.window is None else f"sliding window {group.window}"
        layers = f"{len(group.layers)} layer{'s' if len(group.layers) != 1 else ''}"
        parts.append(f"{kind} ({layers}) {kept} blocks a sequence")
    return (f"KV cache: {num_blocks} blocks of {block_size} tokens x "
            f"{groups.layers_per_block} layer{'s' if groups.layers_per_block != 1 else ''} in "
            f"{len(groups.groups)} groups: "
            f"{', '.join(parts)}; maximum concurrency at max_model_len {max_model_len}: "
            f"{num_blocks // per_seq} sequences")
