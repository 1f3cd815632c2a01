"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Owns the network: embeddings, RMSNorm, rotary embeddings, fused q/k/v and gate/up
projections, the decoder layers and the LM head, plus mapping Hugging Face checkpoint
names onto the fused parameters, and placing LoRA adapters' weights in the projections
(each token's adapter comes down the forward call as a ``LoraBatch``). It does not own
reading files (the loader, ``engine_common.lora``), the KV cache tensor (the model runner)
or attention over the cache (an ``AttentionBackend``).

Numerics follow Hugging Face's ``LlamaModel`` op for op (RMSNorm in float32 then cast
back before the weight, rotary in the model dtype from float32 cos/sin, SiLU rounded
before the multiply), so greedy outputs match token for token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine_common.lora.adapter_weights import LoraAdapter, LoraModuleWeights
from engine_common.lora.linear_delta import (
    LoraLinearWeights,
    StackedLoraWeights,
    add_lora_deltas,
)
from engine_common.lora.step_batch import LoraBatch
from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.attention.backend import AttentionBackend, AttentionMetadata
from engine_common.model.logit_ties import resolve_near_ties
from engine_common.model.packed_linear import can_pack, pack, packed_linear


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by the checkpoint.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` whose weight may be several checkpoint tensors stacked on dim 0,
    plus, for the rows of a step's ``LoraBatch``, their LoRA adapter's delta."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.packed_weight: torch.Tensor | None = None  # see ``pack_weight``
        # LoRA adapters' weights by adapter slot; plain tensors, not parameters, as the
        # checkpoint holds none of them.
        self.lora: dict[int, LoraLinearWeights] = {}
        self.lora_stacked: StackedLoraWeights | None = None  # see ``stack_lora``

    def pack_weight(self, float32: bool = False) -> None:
        """Keep the weight only in oneDNN's packed layout, if it can be (see
        ``packed_linear``; ``float32``: float32 stands in for bf16); the plain copy is
        dropped, or the model would take twice the memory. Call after the checkpoint is
        loaded."""
        if can_pack(self.weight, float32):
            self.packed_weight = pack(self.weight.data)
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        if self.packed_weight is not None:
            y = packed_linear(x, self.packed_weight, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        if lora is None:
            return y
        # After the base output, packed or not: base rows stay bitwise what they were.
        return add_lora_deltas(y, x, self.lora, self.lora_stacked, lora) if self.lora else y

    def stack_lora(self, num_slots: int) -> None:
        """Stack the adapters' weights for steps that run several at once (restacked when
        adapters come and go; with none left, the projection is the base model's)."""
        self.lora_stacked = (
            StackedLoraWeights.stack(self.lora, num_slots, self.in_features, self.out_features)
            if self.lora else None)


class Embedding(nn.Module):
    """A [vocab_size, hidden_size] table: the token embedding, and the LM head's weight."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _empty_param(vocab_size, hidden_size, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _empty_param(hidden_size, dtype=dtype, device=device)
        self.eps = eps
        self.normalized_shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm normalises in float32 and rounds once to x's dtype, which is exactly
        # HF's x.float() * rsqrt(mean(x^2) + eps) then .to(dtype); the weight multiplies
        # after the rounding, in the model dtype, as in HF.
        return self.weight * F.rms_norm(x, self.normalized_shape, eps=self.eps)


def _inverse_frequencies(arch: ModelArchConfig) -> torch.Tensor:
    dim = arch.head_size
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (arch.rope_theta**exponents)
    scaling = arch.rope_scaling
    if arch.rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif arch.rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with cos/sin precomputed for every position.

    HF builds ``cos = cat(freqs, freqs).cos()``, so both halves of a head share the same
    cos/sin; storing one half and rotating the halves separately gives bit-identical results
    (``a*c + (-b)*s`` rounds exactly like ``a*c - b*s``).
    """

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        inv_freq = _inverse_frequencies(arch).to(device)
        positions = torch.arange(arch.max_position_embeddings, dtype=torch.int64,
                                 device=device).float()
        # float32 like HF, rounded to the model dtype only at the end; on the model's device,
        # as HF computes cos/sin there (a GPU's cos may differ from the CPU's in the last bit).
        freqs = positions[:, None] * inv_freq[None, :]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)
        self.half_size = arch.head_size // 2

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``positions``, [num_tokens, 1, head_size // 2]; looked up once per
        step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate_(self, qk: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Rotates ``qk`` [num_tokens, num_heads, head_size] in place."""
        cos, sin = cos_sin
        x1 = qk[..., : self.half_size]
        x2 = qk[..., self.half_size :]
        first = x1 * cos - x2 * sin
        second = x2 * cos + x1 * sin
        x1.copy_(first)
        x2.copy_(second)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_size = arch.head_size
        self.q_size = arch.q_size
        self.kv_size = arch.kv_size
        self.qkv_proj = Linear(
            arch.hidden_size, arch.q_size + 2 * arch.kv_size, arch.qkv_bias, dtype, device
        )
        self.o_proj = Linear(arch.q_size, arch.hidden_size, arch.o_proj_bias, dtype, device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_size, arch.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(arch.head_size, arch.rms_norm_eps, dtype, device)
        self.backend = backend

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden, lora)
        # q and k are adjacent in the fused output, so one rotary pass covers both.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_size)
        if self.q_norm is not None and self.k_norm is not None:
            qk[:, : self.num_heads] = self.q_norm(qk[:, : self.num_heads])
            qk[:, self.num_heads :] = self.k_norm(qk[:, self.num_heads :])
        rotary.rotate_(qk, cos_sin)
        query = qk[:, : self.num_heads]
        key = qk[:, self.num_heads :]
        value = qkv[:, self.q_size + self.kv_size :].view(num_tokens, -1, self.head_size)
        out = self.backend.forward(query, key, value, kv_cache, metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size), lora)


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = Linear(
            arch.hidden_size, 2 * arch.intermediate_size, arch.mlp_bias, dtype, device
        )
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, arch.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)
        gate = gate_up[:, : self.intermediate_size]
        up = gate_up[:, self.intermediate_size :]
        return self.down_proj(F.silu(gate) * up, lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(arch, backend, dtype, device)
        self.mlp = LlamaMLP(arch, dtype, device)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), rotary, cos_sin, kv_cache, metadata,
                              lora)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden), lora)


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, backend, dtype, device) for _ in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(arch, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, self.rotary, cos_sin, kv_cache[i], metadata, lora)
        return self.norm(hidden)


# Checkpoint tensors that are slices of one fused parameter: (fused name, HF name, shard).
_STACKED_PARAMS = (
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
    for fused, original, shard in _STACKED_PARAMS
} | {"o_proj": ("self_attn", "o_proj", None), "down_proj": ("mlp", "down_proj", None)}


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head; forward returns final hidden states, not logits."""

    def __init__(
        self,
        arch: ModelArchConfig,
        attention_backend_cls: type[AttentionBackend],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        device = torch.device(device)
        self.arch = arch
        self.dtype = dtype
        self.device = device
        # One backend shared by every layer: the layers differ only in the cache view they
        # pass, and sharing lets the backend plan a step once for all layers.
        self.attention_backend = attention_backend_cls(
            arch.num_heads, arch.num_kv_heads, arch.head_size, arch.head_size**-0.5
        )
        self.model = LlamaModel(arch, self.attention_backend, dtype, device)
        self.lm_head = (
            self.model.embed_tokens
            if arch.tie_word_embeddings
            else Embedding(arch.vocab_size, arch.hidden_size, dtype, device)
        )
        self.packed_lm_head: torch.Tensor | None = None  # see ``pack_linear_weights``

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        lora: LoraBatch | None = None,  # the step's adapter tokens; None: all base model
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.model(input_ids, positions, kv_cache, metadata, lora)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] float32 (computed in the model dtype, as HF;
        on the CPU the logits that dtype rounds level with the top are float32's: see
        ``logit_ties``)."""
        if self.packed_lm_head is not None:
            logits = packed_linear(hidden, self.packed_lm_head, None).float()
        else:
            logits = F.linear(hidden, self.lm_head.weight).float()
        if hidden.device.type == "cpu":
            resolve_near_ties(logits, hidden, self.lm_head.weight)
        return logits

    def pack_linear_weights(self, float32: bool = False) -> bool:
        """On the CPU in bf16 (or in float32 standing in for bf16: ``float32``), put every
        projection and the LM head in oneDNN's packed layout (see ``packed_linear``).
        Returns whether it did."""
        if not can_pack(self.lm_head.weight, float32):
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_weight(float32)
        # A copy: the embedding keeps its plain rows for the lookup (the head is the
        # embedding when they are tied).
        self.packed_lm_head = pack(self.lm_head.weight.data)
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face checkpoint tensors into the (fused) parameters.

        Converts dtype on copy. Raises ValueError for a tensor the model has no place for
        (shape or name) and for any parameter (or fused shard) left without a tensor.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        arch = self.arch
        shard_ranges = self._shard_ranges()
        expected = self._expected_checkpoint_names(params)
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb." in name:
                continue  # old checkpoints store inv_freq; we compute it.
            if name == "lm_head.weight" and arch.tie_word_embeddings:
                continue  # tied: the embedding is the head.
            target, start, length = name, 0, -1
            for fused, original, shard in _STACKED_PARAMS:
                if f".{original}." in name:
                    target = name.replace(f".{original}.", f".{fused}.")
                    start, length = shard_ranges[shard]
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
            dest = param.data if length < 0 else param.data.narrow(0, start, length)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {shown}")

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

    def _expected_checkpoint_names(self, params: dict[str, nn.Parameter]) -> set[str]:
        names: set[str] = set()
        for name in params:
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            for fused, original, _ in _STACKED_PARAMS:
                if f".{fused}." in name:
                    names.add(name.replace(f".{fused}.", f".{original}."))
            if not any(f".{fused}." in name for fused, _, _ in _STACKED_PARAMS):
                names.add(name)
        return names
