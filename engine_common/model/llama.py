"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Owns the network: embeddings, RMSNorm, rotary embeddings, fused q/k/v and gate/up
projections, the decoder layers and the LM head, plus mapping Hugging Face checkpoint
names onto the fused parameters. It does not own reading files (the loader), the KV cache
tensor (the model runner) or attention over the cache (an ``AttentionBackend``).

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

from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.attention.backend import AttentionBackend, AttentionMetadata
from engine_common.model.packed_linear import can_pack, pack, packed_linear


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by the checkpoint.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` whose weight may be several checkpoint tensors stacked on dim 0."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.weight = _empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.packed_weight: torch.Tensor | None = None  # see ``pack_weight``

    def pack_weight(self) -> None:
        """Keep the weight only in oneDNN's packed layout, if it can be (see
        ``packed_linear``); the plain copy is dropped, or the model would take twice the
        memory. Call after the checkpoint is loaded."""
        if can_pack(self.weight):
            self.packed_weight = pack(self.weight.data)
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)


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
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
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
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = Linear(
            arch.hidden_size, 2 * arch.intermediate_size, arch.mlp_bias, dtype, device
        )
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, arch.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate = gate_up[:, : self.intermediate_size]
        up = gate_up[:, self.intermediate_size :]
        return self.down_proj(F.silu(gate) * up)


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
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), rotary, cos_sin, kv_cache, metadata)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


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
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, self.rotary, cos_sin, kv_cache[i], metadata)
        return self.norm(hidden)


# Checkpoint tensors that are slices of one fused parameter: (fused name, HF name, shard).
_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


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
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.model(input_ids, positions, kv_cache, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] float32 (computed in the model dtype, as HF)."""
        if self.packed_lm_head is not None:
            return packed_linear(hidden, self.packed_lm_head, None).float()
        return F.linear(hidden, self.lm_head.weight).float()

    def pack_linear_weights(self) -> bool:
        """On the CPU in bf16, put every projection and the LM head in oneDNN's packed
        layout (same outputs, bitwise; see ``packed_linear``). Returns whether it did."""
        if not can_pack(self.lm_head.weight):
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_weight()
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
        shard_ranges = {
            "q": (0, arch.q_size),
            "k": (arch.q_size, arch.kv_size),
            "v": (arch.q_size + arch.kv_size, arch.kv_size),
            "gate": (0, arch.intermediate_size),
            "up": (arch.intermediate_size, arch.intermediate_size),
        }
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
