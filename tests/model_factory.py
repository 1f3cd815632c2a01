"""Tiny random Hugging Face model directories for tests.

Builds, in a given directory, a complete local Hugging Face model: config.json, weights as
safetensors, a byte-level BPE tokenizer trained here on ``tests/data/corpus.txt`` (saved as a
fast tokenizer with bos/eos and a ChatML chat template) and generation_config.json. Every
architecture the engine supports has a builder; everything is seeded, so two builds are
identical. Random weights use a large init std so greedy continuations are not one token
repeated.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"
TOKENIZER_VOCAB_SIZE = 400
BOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, IM_START, EOS_TOKEN]
# Reasoning tags as tokens of their own that decode as text (not special), as in Qwen3's and
# DeepSeek-R1's vocabularies; the vocabulary stays TOKENIZER_VOCAB_SIZE in all.
THINK_TOKENS = ["<think>", "</think>"]
# ChatML, with a reasoning switch as thinking models have one: ``enable_thinking`` true opens
# a <think> block for the answer (as DeepSeek-R1's template always does); otherwise an empty
# one is closed (as Qwen3's does with thinking off), so the random test models answer at once.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{{ '<think>\n' if enable_thinking is defined and enable_thinking "
    "else '<think>\n\n</think>\n\n' }}"
    "{% endif %}"
)

# Shapes shared by every tiny model: 2 layers, 4 query heads over 2 KV heads (GQA).
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
)


def build_tokenizer(out_dir: Path, think_tokens: bool = True) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE tokenizer on the test corpus (plus ``THINK_TOKENS``, unless
    ``think_tokens`` is false) and saves it to ``out_dir``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - len(THINK_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS_PATH)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=BOS_TOKEN,
        unk_token=None,
    )
    if think_tokens:
        fast.add_tokens(THINK_TOKENS)
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        "eos_token_id": tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        "pad_token_id": tokenizer.convert_tokens_to_ids(BOS_TOKEN),
    }


def build_tiny_model(
    out_dir: str | Path,
    architecture: str = "llama",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shape: dict[str, int] | None = None,
) -> Path:
    """Writes a tiny random ``architecture`` ("llama", "qwen2", "qwen3", "mistral") model to
    ``out_dir`` (``shape``: qwen2 only, config fields other than the shared ones, such as
    ``num_key_value_heads``).

    llama: untied head, llama3 rope scaling (original context 64, so positions past 64
    exercise the scaled frequencies), biases on every projection (attention_bias, mlp_bias).
    qwen2: q/k/v bias, tied embeddings. qwen3: per-head q/k RMSNorm (random weights, so it
    matters), head_dim 32, tied embeddings, no bias (as Qwen3-0.6B). mistral: a head_dim (32) that is not
    hidden_size / num_heads (16).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    ids = _token_ids(tokenizer)
    torch.manual_seed(seed)
    model: LlamaForCausalLM | Qwen2ForCausalLM | Qwen3ForCausalLM | MistralForCausalLM
    if architecture == "llama":
        config = LlamaConfig(
            **_COMMON,
            **ids,
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model = LlamaForCausalLM(config)
    elif architecture == "qwen2":
        config = Qwen2Config(**{**_COMMON, **(shape or {})}, **ids, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(config)
    elif architecture == "qwen3":
        config = Qwen3Config(**_COMMON, **ids, head_dim=32, tie_word_embeddings=True)
        model = Qwen3ForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    elif architecture == "mistral":
        config = MistralConfig(
            **_COMMON, **ids, head_dim=32, sliding_window=None, tie_word_embeddings=False
        )
        model = MistralForCausalLM(config)
    else:
        raise ValueError(f"unknown tiny architecture {architecture!r}")
    if shape and architecture != "qwen2":
        raise ValueError("shape is implemented for the tiny qwen2 only")
    # HF initialises biases to zero; make them matter.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.2)
    model = model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
    ).save_pretrained(out_dir)
    return out_dir



def write_lora_adapter(base_dir: Path, out_dir: Path, *, seed: int, **lora: object) -> Path:
    """A PEFT LoRA adapter of the model in ``base_dir`` as ``peft`` saves one
    (adapter_config.json, adapter_model.safetensors), with random, nonzero A and B;
    ``lora`` is LoraConfig's (r, lora_alpha, target_modules, use_rslora, rank_pattern...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(init_lora_weights=False, **lora)  # type: ignore[arg-type]
    get_peft_model(base, config).save_pretrained(out_dir)
    return out_dir


def write_serving_adapters(base_dir: Path, root: Path) -> dict[str, str]:
    """Two adapters the serving tests load by name: "sql" (rank 4 on every projection) and
    "poet" (rank 8 on q, v and down), as --lora-modules takes them (name -> directory)."""
    return {
        "sql": str(write_lora_adapter(
            base_dir, root / "sql", seed=1, r=4, lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"])),
        "poet": str(write_lora_adapter(base_dir, root / "poet", seed=2, r=8, lora_alpha=8,
                                       target_modules=["q_proj", "v_proj", "down_proj"])),
    }
