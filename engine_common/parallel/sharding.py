"""Which part of the model a tensor-parallel rank holds (Megatron-LM's layout, as vLLM's).

* q/k/v and gate/up are column-parallel: rank r holds a contiguous run of whole GQA groups
  (a KV head and the query heads that read it) and its share of the intermediate columns,
  and computes them with no communication. KV heads that do not divide by N are split as
  evenly as whole groups allow (SmolLM2-135M's 3 KV heads over 2 ranks: 2 and 1, so rank 0
  does two thirds of the attention work).
* o_proj and down_proj are row-parallel: rank r holds the input columns matching its heads
  (intermediate columns) and produces a partial sum; one all-reduce per projection adds
  them up. A row-parallel bias is held by rank 0 alone (zeros elsewhere), so the sum adds it
  once.
* With more ranks than KV heads each KV head is replicated on the ``N / KV`` ranks whose
  query heads read it (its group's query heads split evenly among them), so every rank's
  cache holds its ``kv_head_range`` heads.
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
from kv_transfer.rank_layout import kv_head_range as rank_kv_heads


def check_divisible(arch: ModelArchConfig, size: int) -> None:
    """ValueError, naming the shape, when ``arch`` cannot be split ``size`` ways."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {size}")
    problems = []
    kv = arch.num_kv_heads
    if kv < size and (size % kv or (arch.num_heads // kv) % (size // kv)):
        problems.append(f"{arch.num_heads} attention heads over {kv} KV heads (with fewer KV "
                        "heads than ranks, the ranks must be a multiple of the KV heads and "
                        "split each one's query heads evenly)")
    if arch.intermediate_size % size:
        problems.append(f"intermediate size {arch.intermediate_size}")
    if arch.is_moe and arch.moe_intermediate_size % size:
        problems.append(f"expert intermediate size {arch.moe_intermediate_size}")
    if problems:
        raise ValueError(f"{arch.architecture} cannot be split over {size} tensor-parallel "
                         f"ranks: {', '.join(problems)} do not divide evenly")


def kv_head_range(arch: ModelArchConfig, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, count) in rank ``rank``'s cache: whole groups, as even as they go
    (the first ``KV % N`` ranks one more); one replicated head when ranks outnumber them.
    The split is ``kv_transfer.rank_layout``'s, which per-rank KV pulls read by."""
    return rank_kv_heads(arch.num_kv_heads, rank, size)


def q_head_range(arch: ModelArchConfig, rank: int, size: int) -> tuple[int, int]:
    """(first query head, count) of rank ``rank``: its KV heads' groups (a share of one
    group's when the group's KV head is replicated)."""
    group = arch.num_heads // arch.num_kv_heads
    if arch.num_kv_heads < size:
        per_rank = arch.num_heads // size
        return rank * per_rank, per_rank
    first, count = kv_head_range(arch, rank, size)
    return first * group, count * group


def vocab_per_rank(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)


def rank_arch(arch: ModelArchConfig, rank: int, size: int) -> ModelArchConfig:
    """The shapes rank ``rank``'s layers are built with (its heads, columns, vocab rows)."""
    if size == 1:
        return arch
    check_divisible(arch, size)
    return replace(
        arch, num_heads=q_head_range(arch, rank, size)[1],
        num_kv_heads=kv_head_range(arch, rank, size)[1],
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
        return _heads(tensor, 0, kv_head_range(arch, rank, size), arch.head_size)
    if ".q_proj." in name:
        return _heads(tensor, 0, q_head_range(arch, rank, size), arch.head_size)
    if name.endswith(".sinks"):
        return _heads(tensor, 0, q_head_range(arch, rank, size), 1)
    if ".o_proj." in name:
        if not name.endswith("weight"):
            return _on_rank0(tensor, rank)
        return _heads(tensor, -1, q_head_range(arch, rank, size), arch.head_size)
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.gate_up_proj_bias"):
        # GPT-OSS, de-interleaved already: gate rows then up rows on dim 1; each half split.
        gate, up = tensor.chunk(2, dim=1)
        return torch.cat((_part(gate, 1, rank, size), _part(up, 1, rank, size)), dim=1)
    if name.endswith("experts.down_proj"):  # [E, hidden, I] after the network's transform
        return _part(tensor, -1, rank, size)
    if name.endswith("experts.down_proj_bias"):
        return _on_rank0(tensor, rank)
    if any(f".{p}." in name for p in ("gate_proj", "up_proj", "w1", "w3")):
        return _part(tensor, 0, rank, size)
    if any(f".{p}." in name for p in ("down_proj", "w2")):
        return _part(tensor, -1, rank, size) if name.endswith("weight") else _on_rank0(tensor, rank)
    return tensor


def _heads(tensor: torch.Tensor, dim: int, heads: tuple[int, int], head_size: int
           ) -> torch.Tensor:
    first, count = heads
    return tensor.narrow(dim, first * head_size, count * head_size)


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
