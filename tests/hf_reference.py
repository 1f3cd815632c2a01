"""Hugging Face ``transformers`` as the reference the engine's greedy output must equal."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int,
              device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Each prompt's ``max_tokens`` greedy tokens from HF ``generate``, one prompt at a time
    (no padding), with EOS suppressed as ``min_new_tokens`` does."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
