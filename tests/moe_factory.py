"""Tiny random mixture-of-experts Hugging Face model directories for tests: Mixtral,
Qwen3-MoE and GPT-OSS (plain, and with its experts rewritten in MXFP4 as GPT-OSS ships
them), built with transformers' own classes in float32 and saved with ``save_pretrained``.

Shapes are small but exercise every feature: top-2 of 8 experts, Mixtral with a 16-token
sliding window on every layer, Qwen3-MoE with a dense layer between sparse ones
(``mlp_only_layers``), GPT-OSS with a 16-token sliding window on alternate layers, YaRN,
random sinks and biases.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    GenerationConfig,
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.model_factory import _token_ids, build_tokenizer

GPT_OSS_WINDOW = 16
MIXTRAL_WINDOW = 16
_COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "gpt_oss", "gpt_oss_mxfp4")


def _model(architecture: str, ids: dict[str, int]) -> torch.nn.Module:
    if architecture == "mixtral":
        return MixtralForCausalLM(MixtralConfig(
            **_COMMON, **ids, num_hidden_layers=2, intermediate_size=64, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=MIXTRAL_WINDOW))
    if architecture == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **_COMMON, **ids, num_hidden_layers=3, head_dim=32, intermediate_size=96,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
        return model
    model = GptOssForCausalLM(GptOssConfig(
        **_COMMON, **ids, num_hidden_layers=2, head_dim=32, intermediate_size=64,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=GPT_OSS_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64}))
    with torch.no_grad():  # HF zeroes these; make them matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.2)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.2)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, proj).bias.normal_(0.0, 0.2)
    return model


def build_tiny_moe_model(out_dir: str | Path, architecture: str, seed: int = 0) -> Path:
    """Writes a tiny random ``architecture`` (one of ``MOE_ARCHITECTURES``) to ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = _token_ids(build_tokenizer(out_dir))
    torch.manual_seed(seed)
    model = _model(architecture.removesuffix("_mxfp4"), ids)
    model.config.dtype = torch.float32
    model.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                     pad_token_id=ids["pad_token_id"]).save_pretrained(out_dir)
    if architecture.endswith("_mxfp4"):
        rewrite_experts_as_mxfp4(out_dir)
    return out_dir


_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] float -> (blocks [E, out, in/32, 16] uint8, scales [E, out, in/32]
    uint8): per group of 32 inputs a power-of-two scale putting the largest value within
    E2M1's 6, each value rounded to the nearest E2M1 code, low nibble first."""
    rows = weight.transpose(1, 2).float()  # [E, out, in]
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)
    magnitude = (scaled.abs()[..., None] - _FP4).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent[..., 0] + 127).to(torch.uint8)


def rewrite_experts_as_mxfp4(model_dir: Path) -> None:
    """Replaces the experts' gate_up/down weights by MXFP4 ``*_blocks``/``*_scales`` pairs
    and declares the quantization in config.json, as GPT-OSS checkpoints ship."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, path, metadata={"format": "pt"})
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }
    config_path.write_text(json.dumps(config, indent=2))
