"""Which part of the model a tensor-parallel rank holds (Megatron-LM's layout, as vLLM's).

* q/k/v and gate/up are column-parallel: rank r holds heads ``[r H/N, (r+1) H/N)`` of the
  queries, its share of the intermediate columns, and computes them with no communication.
* o_proj and down_proj are row-parallel: rank r holds the input columns matching its heads
  (intermediate columns) and produces a partial sum; one all-reduce per projection adds
  them up. A row-parallel bias is held by rank 0 alone (zeros elsewhere), so the sum adds it
  once.
* KV heads are split like the query heads; with more ranks than KV heads each KV head is
  replicated on the ``N / KV`` ranks whose query heads read it (GQA groups never straddle
  ranks), so every rank's cache holds ``kv_heads_per_rank`` heads.
* The token embedding and the LM head are vocab-parallel: rank r holds ``ceil(V / N)``
  rows from ``r ceil(V / N)`` (the last rank's tail padded with zeros); a lookup is an
  all-reduce of each rank's rows (zeros for ids it does not hold), the head's logits are
  gathered (no arithmetic across ranks).
* Mixture-of-experts layers are tensor-parallel within each expert, not expert-parallel:
  every rank holds every expert's share of the intermediate columns (w13 column-parallel,
  w2 row-parallel), routes every token itself (the router is replicated) and the layer
  ends in the same one all-reduce as a dense MLP. Expert parallelism would need the
  experts' count to divide by N, an all-to-all (or a full-size all-reduce) per layer, and
  would leave a rank idle whenever routing favours another rank's experts; at the sizes a
  replica's ranks run (2 to 8, one machine) splitting each expert keeps every rank's work
  equal whatever the routing, and the communication is the dense model's.
* Norms, rotary, q/k norms and the router are replicated.

Owns the per-rank sizes (``rank_arch``) and cutting a checkpoint tensor to a rank's part
(``shard_tensor``), by the tensor's Hugging Face name, after the network's own transform
(GPT-OSS's de-interleaving). It does not own the collectives (``group``) or where a part
lands in a fused parameter (the network's placements, at the rank's sizes).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine_common.model.arch_config import ModelArchConfig


def check_divisible(arch: ModelArchConfig, size: int) -> None:
    """ValueError, naming the shape, when ``arch`` cannot be split ``size`` ways."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {size}")
    problems = []
    if arch.num_heads % size:
        problems.append(f"{arch.num_heads} attention heads")
    kv = arch.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} KV heads (need a multiple or a divisor of the size)")
    if arch.intermediate_size % size:
        problems.append(f"intermediate size {arch.intermediate_size}")
    if arch.is_moe and arch.moe_intermediate_size % size:
        problems.append(f"expert intermediate size {arch.moe_intermediate_size}")
    if problems:
        raise ValueError(f"{arch.architecture} cannot be split over {size} tensor-parallel "
                         f"ranks: {', '.join(problems)} do not divide evenly")


def kv_heads_per_rank(arch: ModelArchConfig, size: int) -> int:
    """KV heads in each rank's cache (1 where heads are replicated)."""
    return max(1, arch.num_kv_heads // size)


def first_kv_head(arch: ModelArchConfig, rank: int, size: int) -> int:
    """The first KV head rank ``rank`` holds."""
    if arch.num_kv_heads >= size:
        return rank * (arch.num_kv_heads // size)
    return rank * arch.num_kv_heads // size


def vocab_per_rank(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)


def rank_arch(arch: ModelArchConfig, size: int) -> ModelArchConfig:
    """The shapes one rank's layers are built with (its heads, columns and vocab rows)."""
    if size == 1:
        return arch
    check_divisible(arch, size)
    return replace(
        arch, num_heads=arch.num_heads // size, num_kv_heads=kv_heads_per_rank(arch, size),
        intermediate_size=arch.intermediate_size // size,
        moe_intermediate_size=arch.moe_intermediate_size // size,
        vocab_size=vocab_per_rank(arch.vocab_size, size))


def shard_tensor(name: str, tensor: torch.Tensor, arch: ModelArchConfig, rank: int,
                 size: int) -> torch.Tensor:
    """Rank ``rank``'s part of checkpoint tensor ``name`` (``arch``: the full model's)."""
    if size == 1:
        return tensor
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return _vocab_rows(tensor, rank, size)
    if ".k_proj." in name or ".v_proj." in name:
        per_rank = kv_heads_per_rank(arch, size) * arch.head_size
        return tensor.narrow(0, first_kv_head(arch, rank, size) * arch.head_size, per_rank)
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.gate_up_proj_bias"):
        # GPT-OSS, de-interleaved already: gate rows then up rows on dim 1; each half split.
        gate, up = tensor.chunk(2, dim=1)
        return torch.cat((_part(gate, 1, rank, size), _part(up, 1, rank, size)), dim=1)
    if name.endswith("experts.down_proj"):  # [E, hidden, I] after the network's transform
        return _part(tensor, -1, rank, size)
    if name.endswith("experts.down_proj_bias"):
        return _on_rank0(tensor, rank)
    if any(f".{p}." in name for p in ("q_proj", "gate_proj", "up_proj", "w1", "w3")) \
            or name.endswith(".sinks"):
        return _part(tensor, 0, rank, size)
    if any(f".{p}." in name for p in ("o_proj", "down_proj", "w2")):
        return _part(tensor, -1, rank, size) if name.endswith("weight") else _on_rank0(tensor, rank)
    return tensor


def _part(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    length = tensor.shape[dim] // size
    return tensor.narrow(dim, rank * length, length)


def _on_rank0(bias: torch.Tensor, rank: int) -> torch.Tensor:
    return bias if rank == 0 else torch.zeros_like(bias)


def _vocab_rows(table: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    rows = vocab_per_rank(table.shape[0], size)
    part = table[rank * rows:(rank + 1) * rows]
    if part.shape[0] == rows:
        return part
    padded = table.new_zeros(rows, *table.shape[1:])
    padded[:part.shape[0]] = part
    return padded
