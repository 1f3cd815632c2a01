"""The logits a bf16 LM head rounds together, computed again in float32.

A bf16 matmul rounds each logit to bf16: 8 significant bits, a step of 0.0625 to 0.125 for
the logits of 8 to 32 a model like SmolLM2 produces. Two candidates closer than that come out
equal or in the wrong order, and greedy decoding then follows the rounding, not the model:
in issue 39's check (SmolLM2-135M, 32 random prompts, 128 greedy tokens, AMD EPYC with
AVX512-BF16), Tandem's bf16 matched Hugging Face float32 on 20 of 32 sequences, and 4 of the
12 misses were at the very first token, where the float32 logits' top two were 0.06-0.08
apart and bf16 gave them the same value. vLLM-CPU's bf16 matched 24 of 32 (the same kind of
rounding, different luck). With the ties resolved: 26 of 32.

So after the bf16 head, every logit within two bf16 steps of its row's maximum (a margin no
rounding of two values can cross) is replaced by the float32 dot product of the same bf16
hidden state and head row, what a head with float32 output would give. No token outside the
margin can be the true maximum, so the argmax (and a greedy request's token) is the one of
float32 logits; the others keep their bf16 values. The candidates are found chunk by chunk
(a chunk's maximum against the row's threshold) so that only a few hundred logits of a row
are compared one by one: about 2 ms for a batch of 64 over a 49,152-token vocabulary on one
core (1% of that decode step), where a mask of the whole batch costs 5.

Owns only that correction. It does not own the head's matmul (the model) or sampling; float32
logits need none of it, nor does a head on oneDNN's direct path, which writes its float32
sums unrounded (``CausalLM.compute_logits``). The model applies it on the CPU only: on a GPU
the candidates' count would synchronise the stream, and the step's logits may be a CUDA
graph's.
"""

from __future__ import annotations

import torch

# Columns whose maximum is compared at once before single logits are.
_CHUNK = 256


def resolve_near_ties(logits: torch.Tensor, hidden: torch.Tensor, head_weight: torch.Tensor) -> None:
    """Recompute in float32, in place, the logits of ``logits`` ([rows, vocab] float32, from
    a reduced-precision head) that rounding may have put level with their row's maximum.

    ``hidden`` [rows, hidden_size] and ``head_weight`` [vocab, hidden_size] are the head's
    inputs, in the model's dtype."""
    if hidden.dtype == torch.float32 or logits.numel() == 0:
        return
    rows, cols = _candidates(logits, torch.finfo(hidden.dtype).eps)
    exact = (hidden[rows].float() * head_weight[cols].float()).sum(dim=-1)
    logits[rows, cols] = exact


def _candidates(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every logit within two steps of ``eps`` of its row's maximum."""
    num_rows, vocab = logits.shape
    top = logits.amax(dim=-1, keepdim=True)
    threshold = top - top.abs() * (2 * eps)
    chunked = vocab - vocab % _CHUNK
    chunk_max = logits[:, :chunked].view(num_rows, -1, _CHUNK).amax(dim=-1)
    row, chunk = (chunk_max >= threshold).nonzero(as_tuple=True)
    cols = chunk[:, None] * _CHUNK + torch.arange(_CHUNK, device=logits.device)
    keep = logits[row[:, None], cols] >= threshold[row]
    rows, columns = row[:, None].expand_as(cols)[keep], cols[keep]
    if chunked < vocab:
        tail_rows, tail_cols = (logits[:, chunked:] >= threshold).nonzero(as_tuple=True)
        rows = torch.cat([rows, tail_rows])
        columns = torch.cat([columns, tail_cols + chunked])
    return rows, columns
