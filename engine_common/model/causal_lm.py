"""The base every network of the registry derives from: decoder plus LM head, logits,
oneDNN packing, checkpoint loading through the network's name map, and LoRA placement.

Owns what is common to every architecture: how a checkpoint tensor reaches its parameter
(a ``Placement``: which parameter, which expert, which rows, which layout change), that
every parameter is covered exactly once, and placing LoRA adapters' weights in the dense
projections (each token's adapter comes down the forward call as a ``LoraBatch``). A
network file owns only its layer wiring and its checkpoint names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_common.lora.adapter_weights import LoraAdapter, LoraModuleWeights
from engine_common.lora.linear_delta import LoraLinearWeights
from engine_common.lora.step_batch import LoraBatch
from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.attention.backend import AttentionBackend, AttentionMetadata
from engine_common.model.decoder import DecoderModel, FeedForwardFactory
from engine_common.model.layers.linear import Embedding, Linear
from engine_common.model.layers.mlp import GatedMLP
from engine_common.model.layers.moe import SparseMoeBlock
from engine_common.model.logit_ties import resolve_near_ties
from engine_common.model.onednn_gemm import OnednnGemm
from engine_common.model.packed_linear import (
    PackedWeight,
    can_pack,
    pack_projection,
    packed_linear,
)
from engine_common.model.weight_memory import WeightMemory
from engine_common.parallel.group import SINGLE, TensorParallel
from engine_common.parallel.sharding import rank_arch, shard_tensor

# Checkpoint tensors that are slices of one fused parameter: (fused name, HF name, shard).
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)
# The projections a LoRA adapter may target, by Hugging Face name: (parent module, the
# model's projection holding it, its shard there or None when it is the whole projection).
_LORA_PROJECTIONS = {
    original: ("mlp" if fused == "gate_up_proj" else "self_attn", fused, shard)
    for fused, original, shard in STACKED_PARAMS
} | {"o_proj": ("self_attn", "o_proj", None), "down_proj": ("mlp", "down_proj", None)}


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes: ``param``, its ``expert`` (index on dim 0) if any,
    then ``rows`` (start, length) on the next dim if a slice, after ``transform``."""

    param: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


class CausalLM(nn.Module):
    """The decoder plus LM head; forward returns final hidden states, not logits.

    Under tensor parallelism (``parallel``) this is one rank's part: ``arch`` is this rank's
    shapes (``sharding.rank_arch``: its heads, columns, vocabulary rows) and ``full_arch``
    the model's; checkpoint tensors are cut to the rank's part as they load, and
    ``compute_logits`` gathers every rank's vocabulary slice (every rank must call it).
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        attention_backend_cls: type[AttentionBackend],
        feed_forward: FeedForwardFactory,
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: TensorParallel = SINGLE,
    ):
        """``arch``: the whole model's; ``feed_forward`` builds at this rank's shapes
        (``rank_arch(arch, parallel.rank, parallel.size)``)."""
        super().__init__()
        device = torch.device(device)
        self.parallel = parallel
        self.full_arch = arch
        self.arch = arch = rank_arch(arch, parallel.rank, parallel.size)
        self.dtype = dtype
        self.device = device
        # One backend shared by every layer: the layers differ only in the cache view they
        # pass, and sharing lets the backend plan a step once for all layers.
        self.attention_backend = attention_backend_cls(
            arch.num_heads, arch.num_kv_heads, arch.head_size, arch.head_size**-0.5
        )
        self.model = DecoderModel(arch, self.attention_backend, feed_forward, dtype, device,
                                  parallel)
        self.lm_head = (
            self.model.embed_tokens
            if arch.tie_word_embeddings
            else Embedding(arch.vocab_size, arch.hidden_size, dtype, device)
        )
        self.packed_lm_head: PackedWeight | None = None  # see ``pack_linear_weights``
        self.weight_memory: WeightMemory | None = None  # set by the loader

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether a decode step can be captured: the backend allows it, and no layer plans
        on the host from per-step values (the MoE experts size their tiles from the step's
        routing; the sink/sliding-window path plans from sequence lengths)."""
        arch = self.arch
        return (self.attention_backend.supports_cuda_graphs and not arch.is_moe
                and not arch.attention_sinks and arch.attention_window is None)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: torch.Tensor,  # kv_cache_layout's [blocks, layers, 2, kv_heads, block, head]
        metadata: AttentionMetadata,
        lora: LoraBatch | None = None,  # the step's adapter tokens; None: all base model
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.model(input_ids, positions, kv_cache, metadata, lora)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] float32. A bf16 head on oneDNN's direct path
        writes its float32 sums unrounded; otherwise the logits are computed in the model
        dtype, as HF, and on the CPU those that dtype rounds level with the top are
        recomputed in float32 (``logit_ties``): greedy picks float32's argmax either way."""
        if isinstance(self.packed_lm_head, OnednnGemm):
            # NOTE: bf16 logits cost three more passes over [N, vocab] (the float copy and
            # the tie search's two): ~2.5 ms of a 135 ms decode step at batch 64, one core.
            logits = self.packed_lm_head(hidden, None, out_dtype=torch.float32)
        else:
            logits = (F.linear(hidden, self.lm_head.weight) if self.packed_lm_head is None
                      else packed_linear(hidden, self.packed_lm_head, None)).float()
            if hidden.device.type == "cpu":
                # On a rank's slice, against the slice's own maximum: a superset of the
                # candidates the full row's maximum would pick, so no true tie is missed.
                resolve_near_ties(logits, hidden, self.lm_head.weight)
        if not self.parallel.is_parallel:
            return logits
        return self.parallel.all_gather_last_dim(logits)[:, :self.full_arch.vocab_size]

    def pack_linear_weights(self, float32: bool = False) -> bool:
        """On the CPU in bf16 (or in float32 standing in for bf16: ``float32``), put every
        projection and the LM head in oneDNN's packed layout (see ``packed_linear``).
        Returns whether it did."""
        if not can_pack(self.lm_head.weight, float32):
            return False
        for module in self.modules():
            if isinstance(module, Linear | SparseMoeBlock):
                module.pack_weight(float32)
        # A copy: the embedding keeps its plain rows for the lookup (the head is the
        # embedding when they are tied).
        self.packed_lm_head = pack_projection(self.lm_head.weight.data)
        return True

    # -- checkpoint names -------------------------------------------------------------

    def placements(self, name: str) -> list[Placement]:
        """Where checkpoint tensor ``name`` goes (empty: nowhere, on purpose). The dense
        names; networks with other tensors extend this."""
        if "rotary_emb." in name:
            return []  # old checkpoints store inv_freq; we compute it.
        if name == "lm_head.weight" and self.arch.tie_word_embeddings:
            return []  # tied: the embedding is the head.
        for fused, original, shard in STACKED_PARAMS:
            if f".{original}." in name:
                return [Placement(name.replace(f".{original}.", f".{fused}."),
                                  rows=self._shard_ranges()[shard])]
        return [Placement(name)]

    def expert_placements(self, match: re.Match[str], gate: str, down: str) -> list[Placement]:
        """Where a per-expert checkpoint tensor goes in the stacked expert weights: ``match``
        holds its prefix, expert index and projection name; ``down`` goes to ``w2``, ``gate``
        to the first half of ``w13`` and the other (up) projection to its second half."""
        prefix, expert, which = match.group(1), int(match.group(2)), match.group(3)
        if which == down:
            return [Placement(f"{prefix}.w2", expert=expert)]
        size = self.arch.moe_intermediate_size
        return [Placement(f"{prefix}.w13", expert=expert,
                          rows=(0 if which == gate else size, size))]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face checkpoint tensors into the (fused) parameters.

        Converts dtype on copy. Raises ValueError for a tensor the model has no place for
        (shape or name), for a tensor given twice, and for any parameter left (in part)
        without a tensor.
        """
        params = dict(self.named_parameters())
        covered = dict.fromkeys(params, 0)
        placed: dict[str, set[tuple[int, int] | None]] = {name: set() for name in params}
        seen: set[str] = set()
        for name, tensor in weights:
            if name in seen:
                raise ValueError(f"checkpoint tensor {name!r} appears twice")
            seen.add(name)
            for place in self.placements(name):
                param = params.get(place.param)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
                covered[place.param] += _copy_placed(name, tensor, param, place,
                                                     self._rank_part)
                placed[place.param].add(place.rows)
        missing = sorted(missing_name for n, p in params.items() if covered[n] != p.numel()
                         for missing_name in self._missing_names(n, placed[n]))
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {shown}")

    def _rank_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (the tensor itself when alone)."""
        return shard_tensor(name, tensor, self.full_arch, self.parallel.rank,
                            self.parallel.size)

    def _missing_names(self, param: str, rows_placed: set[tuple[int, int] | None]) -> list[str]:
        """The checkpoint names of what parameter ``param`` still lacks: the unfilled shards
        of a fused dense projection, else the parameter itself."""
        ranges = self._shard_ranges()
        shards = [(original, ranges[shard]) for fused, original, shard in STACKED_PARAMS
                  if f".{fused}." in param]
        names = [param.replace(f".{param.split('.')[-2]}.", f".{original}.")
                 for original, rows in shards if rows not in rows_placed]
        return names or [param]

    def _shard_ranges(self) -> dict[str, tuple[int, int]]:
        """(first output row, rows) of each checkpoint tensor in its fused projection."""
        arch = self.arch
        return {
            "q": (0, arch.q_size),
            "k": (arch.q_size, arch.kv_size),
            "v": (arch.q_size + arch.kv_size, arch.kv_size),
            "gate": (0, arch.intermediate_size),
            "up": (arch.intermediate_size, arch.intermediate_size),
        }

    # -- LoRA -------------------------------------------------------------------------

    def _projection(self, layer: int, name: str) -> tuple[Linear, int]:
        """The Linear holding Hugging Face projection ``name`` of ``layer``, and the first
        output column of ``name`` in it."""
        parent, fused, shard = _LORA_PROJECTIONS[name]
        linear = getattr(getattr(self.model.layers[layer], parent), fused)
        assert isinstance(linear, Linear)
        return linear, 0 if shard is None else self._shard_ranges()[shard][0]

    def lora_projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each projection a LoRA adapter may target, by its
        Hugging Face name (every layer has the same)."""
        if self.parallel.is_parallel:
            raise ValueError("LoRA adapters are not supported with tensor parallelism yet")
        if not all(isinstance(getattr(layer, "mlp", None), GatedMLP)
                   for layer in self.model.layers):
            raise ValueError(f"LoRA adapters are not supported for {self.arch.architecture} "
                             "(mixture-of-experts layers) yet")
        ranges = self._shard_ranges()
        shapes = {}
        for name, (_, _, shard) in _LORA_PROJECTIONS.items():
            linear, _ = self._projection(0, name)
            shapes[name] = (linear.in_features,
                            linear.out_features if shard is None else ranges[shard][1])
        return shapes

    def add_lora_adapter(self, slot: int, adapter: LoraAdapter) -> None:
        """Gives each projection ``adapter`` targets its low-rank weights under ``slot``, in
        the model's dtype and device; a fused projection gets its targeted shards fused."""
        by_linear: dict[int, tuple[Linear, list[tuple[int, LoraModuleWeights]]]] = {}
        for (layer, name), weights in adapter.modules.items():
            linear, column = self._projection(layer, name)
            by_linear.setdefault(id(linear), (linear, []))[1].append((column, weights))
        for linear, shards in by_linear.values():
            linear.lora[slot] = LoraLinearWeights.fuse(shards, linear.out_features, self.dtype,
                                                       self.device)

    def remove_lora_adapter(self, slot: int) -> None:
        """Deletes the weights under ``slot`` from every projection (restack afterwards)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.lora.pop(slot, None)

    def stack_lora_adapters(self, num_slots: int) -> None:
        """After adapters are added or removed: stack each projection's adapters by slot;
        ``num_slots`` is one more than the largest slot in use (0: none)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.stack_lora(num_slots)


def _copy_placed(name: str, tensor: torch.Tensor, param: nn.Parameter,
                 place: Placement,
                 rank_part: Callable[[str, torch.Tensor], torch.Tensor]) -> int:
    """Copies ``tensor`` where ``place`` says (this rank's part of it, after the
    placement's transform); returns how many elements it filled."""
    dest = param.data
    if place.expert is not None:
        dest = dest[place.expert]
    if place.rows is not None:
        dest = dest.narrow(0, *place.rows)
    if place.transform is not None:
        tensor = place.transform(tensor)
    tensor = rank_part(name, tensor)
    if dest.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(dest.shape)}"
        )
    dest.copy_(tensor)
    return dest.numel()
