"""The decoder architecture a model directory describes, read from its ``config.json``.

Owns turning a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Qwen3, Mixtral,
Qwen3-MoE, GPT-OSS) into one plain record the model code builds from, and rejecting what
the model code cannot run. It does
not own weights (the loader) or the tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "MixtralForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# config.json's dtype spellings -> the name ``ModelArchConfig.dtype`` keeps (torch's, which
# the loader maps to a torch dtype; this module stays free of torch for the gateway).
_DTYPES_BY_NAME = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Bias on the q/k/v projections (Qwen2 always; Llama when ``attention_bias``).
    qkv_bias: bool = False
    # Bias on o_proj: Llama's and Qwen3's ``attention_bias`` covers it, Qwen2 never has one.
    o_proj_bias: bool = False
    # RMSNorm over each query and key head before the rotary embedding (Qwen3).
    qk_norm: bool = False
    mlp_bias: bool = False
    rope_type: str = "default"
    # The scaling parameters of ``rope_type`` (factor, low/high_freq_factor, ...).
    rope_scaling: dict[str, float] = field(default_factory=dict)
    # The checkpoint's dtype as config.json states it ("float32", "bfloat16" or "float16");
    # None when it does not say.
    dtype: str | None = None
    # A cap on the whole context at this window (Qwen with use_sliding_window, whose
    # per-layer rule is not run here: full attention equals it while a sequence fits);
    # None: no cap. Mistral's and Mixtral's windows are per layer (``attention_window``).
    sliding_window: int | None = None
    # Mixture of experts (0 experts: a dense model). ``moe_intermediate_size`` is each
    # expert's; ``intermediate_size`` stays the dense MLP's (Qwen3-MoE's dense layers).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Qwen3-MoE: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in
    # mlp_only_layers.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Per-layer attention kind (FULL_ATTENTION or SLIDING_ATTENTION); empty: all full. The
    # sliding layers attend to the last ``attention_window`` tokens (GPT-OSS alternating;
    # Mistral and Mixtral with a ``sliding_window``: every layer), unlike
    # ``sliding_window``, which caps the whole context.
    layer_types: tuple[str, ...] = ()
    attention_window: int | None = None
    # A learned per-head logit in the attention softmax's denominator (GPT-OSS).
    attention_sinks: bool = False
    # GPT-OSS's clamped SwiGLU in the experts.
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    # RMSNorm applies its weight in float32 before rounding (GPT-OSS).
    norm_weight_in_float32: bool = False
    # "mxfp4" when the checkpoint's expert weights are MXFP4 blocks/scales; else None.
    quantization: str | None = None

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    def layer_window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends within; None: the whole context."""
        return self.attention_window if self.layer_type(layer) == SLIDING_ATTENTION else None

    @property
    def kv_window(self) -> int | None:
        """The window when every attention layer slides (Mistral, Mixtral with a
        ``sliding_window``): a sequence's KV older than it is never read again, so the KV
        cache manager may release those blocks. None when any layer attends to everything."""
        if self.layer_types and all(t == SLIDING_ATTENTION for t in self.layer_types):
            return self.attention_window
        return None

    def is_sparse_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelArchConfig:
        config_path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(
                f"model directory {str(model_dir)!r} does not exist; expected a local Hugging Face "
                "model directory (config.json, *.safetensors, tokenizer files)"
            )
        if not config_path.is_file():
            raise FileNotFoundError(
                f"no config.json in {str(model_dir)!r}; expected a local Hugging Face model "
                "directory (config.json, *.safetensors, tokenizer files)"
            )
        with open(config_path, encoding="utf-8") as f:
            return cls.from_hf_config(json.load(f))

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelArchConfig:
        architectures = hf.get("architectures") or []
        architecture = architectures[0] if architectures else None
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden_act = hf.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only 'silu' is supported")

        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        # Mistral configs may carry "head_dim": null, which means the default.
        head_size = int(hf.get("head_dim") or hidden_size // num_heads)
        rope_theta, rope_type, rope_scaling = _read_rope(hf)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        is_qwen3 = architecture == "Qwen3ForCausalLM"
        attention_bias = bool(hf.get("attention_bias", False))
        sliding_window = hf.get("sliding_window")
        is_qwen = is_qwen2 or is_qwen3 or architecture == "Qwen3MoeForCausalLM"
        if is_qwen and not hf.get("use_sliding_window", False):
            sliding_window = None  # Qwen configs name a window they do not use
        per_layer = {}
        if sliding_window and not is_qwen:
            # Mistral's and Mixtral's window holds on every layer: run it per layer (no cap
            # on the context), as Hugging Face's sliding-window mask does.
            per_layer = dict(layer_types=(SLIDING_ATTENTION,) * int(hf["num_hidden_layers"]),
                             attention_window=int(sliding_window))
            sliding_window = None
        base = cls(
            architecture=architecture,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_size=head_size,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            qk_norm=is_qwen3,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            rope_type=rope_type,
            rope_scaling=rope_scaling,
            dtype=_read_dtype(hf),
            sliding_window=int(sliding_window) if sliding_window else None,
        )
        # GPT-OSS's own layer types replace the all-sliding ones.
        return replace(base, **{**per_layer, **_moe_fields(architecture, hf)})


def _moe_fields(architecture: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The fields a mixture-of-experts architecture sets beyond the dense ones."""
    if architecture == "MixtralForCausalLM":
        return dict(num_experts=int(hf["num_local_experts"]),
                    num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["intermediate_size"]))
    if architecture == "Qwen3MoeForCausalLM":
        return dict(num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
                    num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["moe_intermediate_size"]),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                    mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
                    qk_norm=True, qkv_bias=bool(hf.get("attention_bias", False)))
    if architecture == "GptOssForCausalLM":
        return _gpt_oss_fields(hf)
    return {}


def _gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    num_layers = int(hf["num_hidden_layers"])
    layer_types = tuple(hf.get("layer_types") or (
        SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)))
    unknown = set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
    if len(layer_types) != num_layers or unknown:
        raise ValueError(f"layer_types must name {num_layers} layers, each {FULL_ATTENTION!r} "
                         f"or {SLIDING_ATTENTION!r}")
    quant = hf.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if quant is not None and method != "mxfp4":
        raise ValueError(f"unsupported quantization {method!r}; GPT-OSS supports 'mxfp4'")
    attention_bias = bool(hf.get("attention_bias", True))
    window = hf.get("sliding_window")
    return dict(num_experts=int(hf["num_local_experts"]),
                num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["intermediate_size"]),
                layer_types=layer_types,
                attention_window=int(window) if window else None,
                sliding_window=None,  # per layer, not a cap on the context
                attention_sinks=True,
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                norm_weight_in_float32=True,
                qkv_bias=attention_bias, o_proj_bias=attention_bias,
                quantization=method)


def _read_rope(hf: dict[str, Any]) -> tuple[float, str, dict[str, float]]:
    """(rope_theta, rope_type, scaling parameters) from either config generation.

    transformers 5 writes ``rope_parameters: {rope_theta, rope_type, ...}``; older configs
    write a top-level ``rope_theta`` and an optional ``rope_scaling`` dict whose type key
    is ``rope_type`` or, older still, ``type``.
    """
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"unsupported rope parameters {params!r}")
    rope_theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are unsupported")
    scaling = {
        key: float(value)
        for key, value in params.items()
        if key not in ("rope_theta", "rope_type", "type", "partial_rotary_factor")
        and isinstance(value, int | float)
    }
    if rope_type == "linear" and "factor" not in scaling:
        raise ValueError("rope type 'linear' needs a 'factor'")
    if rope_type == "yarn":
        if "factor" not in scaling:
            raise ValueError("rope type 'yarn' needs a 'factor'")
        scaling.setdefault(
            "original_max_position_embeddings", float(hf.get("max_position_embeddings", 8192))
        )
    if rope_type == "llama3":
        missing = {"factor", "low_freq_factor", "high_freq_factor"} - scaling.keys()
        if missing:
            raise ValueError(f"rope type 'llama3' is missing {sorted(missing)}")
        scaling.setdefault(
            "original_max_position_embeddings", float(hf.get("max_position_embeddings", 8192))
        )
    return float(rope_theta), rope_type, scaling


def _read_dtype(hf: dict[str, Any]) -> str | None:
    name = hf.get("dtype") or hf.get("torch_dtype")
    if name is None:
        return None
    if name not in _DTYPES_BY_NAME:
        raise ValueError(f"unsupported checkpoint dtype {name!r} in config.json")
    return _DTYPES_BY_NAME[name]
