"""A bf16 head's near-ties resolved in float32: the argmax of float32 logits, nothing else moved."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_common.model.logit_ties import resolve_near_ties


def _near_tie_head(vocab: int, hidden_size: int, rows: int, seed: int):
    """bf16 hidden states and a head whose rows come in pairs a hair apart, so that each
    row's top logits are closer than a bf16 step."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(vocab // 2, hidden_size, generator=gen)
    twin = base + 1e-3 * torch.randn(base.shape, generator=gen)
    weight = torch.cat([base, twin])[torch.randperm(vocab, generator=gen)]
    if vocab % 2:
        weight = torch.cat([weight, torch.randn(1, hidden_size, generator=gen)])
    hidden = (2 * torch.randn(rows, hidden_size, generator=gen)).bfloat16()
    return hidden, weight.bfloat16()


@pytest.mark.parametrize("vocab", [1024, 1000, 200])  # chunked, chunked with a tail, tail only
def test_argmax_is_float32_logits_argmax(vocab: int) -> None:
    hidden, weight = _near_tie_head(vocab, 64, rows=256, seed=vocab)
    rounded = F.linear(hidden, weight).float()
    exact = hidden.float() @ weight.float().t()
    # The test can fail: bf16 rounding alone picks another token on some rows.
    assert (rounded.argmax(-1) != exact.argmax(-1)).any()
    resolved = rounded.clone()
    resolve_near_ties(resolved, hidden, weight)
    assert torch.equal(resolved.argmax(-1), exact.argmax(-1))
    changed = resolved != rounded
    # Only logits near their row's top moved, and those to float32's values.
    top = rounded.amax(-1, keepdim=True)
    assert bool((rounded[changed.nonzero(as_tuple=True)]
                 >= (top - top.abs() / 64).expand_as(rounded)[changed]).all())
    torch.testing.assert_close(resolved[changed], exact[changed], rtol=1e-5, atol=1e-5)


def test_float32_logits_are_left_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(4, 16, generator=gen), torch.randn(300, 16, generator=gen)
    logits = F.linear(hidden, weight)
    before = logits.clone()
    resolve_near_ties(logits, hidden, weight)
    assert torch.equal(logits, before)
