"""Turning one step's logits into one token per request, with optional logprobs.

Owns the per-step sampling batch (the tensors built from each request's ``SamplingParams``)
and the pipeline applied to the logits: logit bias, vLLM's allowed token ids and bad words,
min-tokens suppression, repetition / frequency / presence penalties, greedy argmax,
temperature, min-p, top-k, top-p, and the random draw, plus the logprobs a request asked
for. It does not own the model (which produces the logits), stop checks (``request`` and
``detokenizer``) or the per-request generators (the caller creates them from the seed and
keeps them with the request, so that a seeded request's stream continues across steps).

The random draw is the exponential race used by vLLM V1: with ``q ~ Exp(1)`` per token,
``argmax(probs / q)`` is distributed as ``probs``, with no sort and no cumulative sum. A row
with its own generator draws its ``q`` from it, so its tokens do not depend on what else is
in the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_common.outputs import TokenLogprobs
from engine_common.sampling_params import SamplingParams

# Block widths of the CPU's greedy argmax (``greedy_argmax``), widest first.
_ARGMAX_BLOCKS = (512, 256, 128)

# Temperatures below this are treated as greedy: dividing by them overflows nothing, but the
# result is argmax anyway and the greedy path is cheaper (vLLM uses the same epsilon).
_GREEDY_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    """Whether the request samples by argmax (and so draws nothing from its generator)."""
    return params.temperature < _GREEDY_TEMPERATURE


def is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes the logits or reads them but ``min_tokens``: no
    logit bias, no allowed token ids, no bad words, no penalties, no logprobs."""
    return (is_greedy(params) and not params.logit_bias and params.allowed_token_ids is None
            and not params.bad_words_token_ids and not params.needs_penalties
            and params.logprobs is None)


def takes_argmax(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether the next token is the plain argmax of the logits: plain greedy, no tokens
    suppressed by ``min_tokens``. A batch of only such rows skips building a
    ``SamplingBatch`` (the common greedy case, kept cheap on the host)."""
    return is_plain_greedy(params) and num_output_tokens >= params.min_tokens


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The request's own generator (on the logits' device), created from its seed; None
    # draws from the batch's (global) random stream.
    generator: torch.Generator | None = None
    # EOS / stop token ids, masked while fewer than ``params.min_tokens`` tokens are out.
    suppress_token_ids: frozenset[int] = frozenset()


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass
class SamplingBatch:
    """One step's sampling parameters as tensors, one row per request.

    Tensors that no row needs are None, so that the sampler skips their stage entirely.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k_p: bool
    # Largest top-n asked for; None when no row wants logprobs (0: only the sampled token's).
    max_num_logprobs: int | None
    greedy_mask: torch.Tensor  # [N] bool
    temperatures: torch.Tensor  # [N] float32; 1.0 on greedy rows so that division is safe
    top_k: torch.Tensor | None  # [N] int64; vocab_size where disabled
    max_top_k: int  # largest enabled top-k (known on the host: no device sync to find it)
    top_p: torch.Tensor | None  # [N] float32; 1.0 where disabled
    min_p: torch.Tensor | None  # [N] float32; 0.0 where disabled
    # Penalties (None when no row has any): output-token counts and prompt|output presence.
    presence_penalties: torch.Tensor | None  # [N]
    frequency_penalties: torch.Tensor | None  # [N]
    repetition_penalties: torch.Tensor | None  # [N]
    output_token_counts: torch.Tensor | None  # [N, V] float32
    seen_token_mask: torch.Tensor | None  # [N, V] bool: in prompt or output
    # (row, token) pairs to set to -inf for min_tokens; None when there are none.
    suppress_index: tuple[torch.Tensor, torch.Tensor] | None
    # (rows, tokens, values) of every row's logit_bias, added in one indexed add; None when
    # no row has one.
    logit_bias_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # (restricted rows, rows, tokens): the rows with allowed_token_ids, and each of their
    # (row, allowed token) pairs; every other logit of those rows is set to -inf. None when
    # no row has allowed ids.
    allowed_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # (row, token) pairs that a bad word bans this step; None when there are none.
    bad_words_index: tuple[torch.Tensor, torch.Tensor] | None
    generators: list[torch.Generator | None]
    seeded_rows: list[int]
    # Rows that want logprobs, and how many top entries each wants.
    logprob_rows: list[int]
    num_logprobs: list[int]

    @property
    def fast_greedy(self) -> bool:
        """Nothing to do but one argmax."""
        return (
            self.all_greedy
            and self.no_penalties
            and self.suppress_index is None
            and self.logit_bias_index is None
            and self.allowed_index is None
            and self.bad_words_index is None
            and self.max_num_logprobs is None
        )

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str
    ) -> SamplingBatch:
        n = len(rows)
        greedy = [is_greedy(r.params) for r in rows]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        temperatures = [
            1.0 if g else r.params.temperature for g, r in zip(greedy, rows, strict=True)
        ]
        # Top-k/top-p/min-p are meaningless on greedy rows: leave them disabled there.
        top_k = [
            vocab_size if g or r.params.top_k <= 0 else min(r.params.top_k, vocab_size)
            for g, r in zip(greedy, rows, strict=True)
        ]
        top_p = [1.0 if g else r.params.top_p for g, r in zip(greedy, rows, strict=True)]
        min_p = [0.0 if g else r.params.min_p for g, r in zip(greedy, rows, strict=True)]
        use_top_k = any(k < vocab_size for k in top_k)
        use_top_p = any(p < 1.0 for p in top_p)
        use_min_p = any(p > 0.0 for p in min_p)

        # One host-to-device copy for every per-row scalar.
        scalars = torch.tensor(
            [
                temperatures,
                top_p,
                min_p,
                [float(k) for k in top_k],
                [r.params.presence_penalty for r in rows],
                [r.params.frequency_penalty for r in rows],
                [r.params.repetition_penalty for r in rows],
                [float(g) for g in greedy],
            ],
            dtype=torch.float32,
        ).to(device, non_blocking=True)

        penalized = [r.params.needs_penalties for r in rows]
        no_penalties = not any(penalized)
        output_counts = seen_mask = None
        if not no_penalties:
            output_counts, seen_mask = _penalty_tensors(rows, penalized, vocab_size, device)

        suppress_index = _suppress_index(rows, vocab_size, device)
        logit_bias_index = _logit_bias_index(rows, vocab_size, device)
        allowed_index = _allowed_index(rows, vocab_size, device)
        bad_words_index = _bad_words_index(rows, vocab_size, device)

        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        num_logprobs = [rows[i].params.logprobs or 0 for i in logprob_rows]
        generators = [r.generator for r in rows]
        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            no_penalties=no_penalties,
            no_top_k_p=not (use_top_k or use_top_p),
            max_num_logprobs=max(num_logprobs) if logprob_rows else None,
            greedy_mask=scalars[7].bool(),
            temperatures=scalars[0],
            top_k=scalars[3].long() if use_top_k else None,
            max_top_k=max((k for k in top_k if k < vocab_size), default=0),
            top_p=scalars[1] if use_top_p else None,
            min_p=scalars[2] if use_min_p else None,
            presence_penalties=None if no_penalties else scalars[4],
            frequency_penalties=None if no_penalties else scalars[5],
            repetition_penalties=None if no_penalties else scalars[6],
            output_token_counts=output_counts,
            seen_token_mask=seen_mask,
            suppress_index=suppress_index,
            logit_bias_index=logit_bias_index,
            allowed_index=allowed_index,
            bad_words_index=bad_words_index,
            generators=generators,
            seeded_rows=[
                i
                for i, (g, gen) in enumerate(zip(greedy, generators, strict=True))
                if gen is not None and not g
            ],
            logprob_rows=logprob_rows,
            num_logprobs=num_logprobs,
        )


def _penalty_tensors(
    rows: Sequence[SamplingRow],
    penalized: list[bool],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output-token counts [N, V] and the prompt-or-output mask [N, V].

    Rows without penalties contribute no tokens, so their cost is nothing. Built from flat
    (row, token) index lists rather than padded rows, so there is no Python-side padding.
    """
    n = len(rows)
    out_lists = [r.output_token_ids if p else [] for r, p in zip(rows, penalized, strict=True)]
    # The prompt only matters for the repetition penalty.
    prompt_lists = [
        r.prompt_token_ids if p and r.params.repetition_penalty != 1.0 else []
        for r, p in zip(rows, penalized, strict=True)
    ]
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.float32, device=device)
    out_rows, out_tokens = _flat_index(out_lists, vocab_size, device)
    counts.index_put_(
        (out_rows, out_tokens), torch.ones_like(out_tokens, dtype=torch.float32), accumulate=True
    )
    seen = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=device)
    prompt_rows, prompt_tokens = _flat_index(prompt_lists, vocab_size, device)
    seen[prompt_rows, prompt_tokens] = True
    # The extra column collects out-of-range ids, which have no logit to penalize.
    counts = counts[:, :vocab_size]
    seen = seen[:, :vocab_size] | (counts > 0)
    return counts, seen


def _flat_index(
    lists: list[list[int]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.long)
    tokens = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long)
    tokens = tokens.clamp_(0, vocab_size)
    row_ids = torch.repeat_interleave(torch.arange(len(lists)), lengths)
    return row_ids.to(device, non_blocking=True), tokens.to(device, non_blocking=True)


def _suppress_index(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, r in enumerate(rows):
        if r.suppress_token_ids and len(r.output_token_ids) < r.params.min_tokens:
            ids = [t for t in r.suppress_token_ids if 0 <= t < vocab_size]
            row_ids.extend([i] * len(ids))
            token_ids.extend(ids)
    if not row_ids:
        return None
    return (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))


def _logit_bias_index(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if not any(r.params.logit_bias for r in rows):
        return None
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, r in enumerate(rows):
        # Ids were checked against the vocabulary on the way in; the filter only keeps an
        # unchecked caller from indexing out of bounds.
        bias = [(t, b) for t, b in r.params.logit_bias.items() if 0 <= t < vocab_size]
        row_ids.extend([i] * len(bias))
        token_ids.extend(t for t, _ in bias)
        values.extend(b for _, b in bias)
    if not row_ids:
        return None
    return (
        torch.tensor(row_ids, dtype=torch.long).to(device, non_blocking=True),
        torch.tensor(token_ids, dtype=torch.long).to(device, non_blocking=True),
        torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True),
    )


def _allowed_index(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    restricted = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if not restricted:
        return None
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i in restricted:
        # As for the bias, the filter only keeps an unchecked caller in bounds.
        allowed = [t for t in rows[i].params.allowed_token_ids or () if 0 <= t < vocab_size]
        row_ids.extend([i] * len(allowed))
        token_ids.extend(allowed)
    return (
        torch.tensor(restricted, dtype=torch.long).to(device, non_blocking=True),
        torch.tensor(row_ids, dtype=torch.long).to(device, non_blocking=True),
        torch.tensor(token_ids, dtype=torch.long).to(device, non_blocking=True),
    )


def bad_word_bans(sequences: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> set[int]:
    """The tokens ``sequences`` (bad words as token ids) ban after ``output_token_ids``: the
    last token of each sequence whose other tokens end the output (a one-token sequence's
    always). Only output tokens count, as in vLLM: a prompt ending with a word's first
    tokens does not ban its last."""
    banned: set[int] = set()
    num_output = len(output_token_ids)
    for sequence in sequences:
        *prefix, last = sequence
        if len(prefix) > num_output:
            continue
        if all(output_token_ids[num_output - len(prefix) + j] == t for j, t in enumerate(prefix)):
            banned.add(last)
    return banned


def _bad_words_index(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, r in enumerate(rows):
        if r.params.bad_words_token_ids:
            banned = [t for t in bad_word_bans(r.params.bad_words_token_ids, r.output_token_ids)
                      if 0 <= t < vocab_size]
            row_ids.extend([i] * len(banned))
            token_ids.extend(banned)
    if not row_ids:
        return None
    return (torch.tensor(row_ids, dtype=torch.long).to(device, non_blocking=True),
            torch.tensor(token_ids, dtype=torch.long).to(device, non_blocking=True))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [rows, vocab] logits, exactly (the first of tied maxima;
    the first NaN, which torch's argmax takes as the max).

    On the CPU torch's argmax is a scalar loop: 2.8 ms for 64 rows of a 49,152-token
    vocabulary on one core, against 0.55 ms here. Each block of ``_ARGMAX_BLOCKS[i]`` logits
    takes its max with a vector reduction (amax, NaN-propagating), the argmax of the block
    maxima finds the first block holding the row's max (or first NaN), and the argmax inside
    that one block its first position: the same index. Other devices, non-contiguous rows and
    vocabularies no block width divides take torch's argmax."""
    rows, vocab = logits.shape
    block = next((b for b in _ARGMAX_BLOCKS if vocab % b == 0), 0)
    if logits.device.type != "cpu" or not block or vocab == block or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    blocks = logits.view(rows, vocab // block, block)
    first = blocks.amax(dim=-1).argmax(dim=-1)  # [rows]
    inside = blocks[torch.arange(rows), first].argmax(dim=-1)
    return first * block + inside


class Sampler:
    """Samples one token per row of ``logits`` under ``batch``'s parameters.

    Order: logit bias -> allowed token ids -> bad words -> min-tokens suppression ->
    penalties (repetition, then frequency, then presence) -> greedy rows take the argmax ->
    temperature -> min-p -> top-k -> top-p -> draw. The bias comes first, as vLLM V1 applies
    its logits processors before the penalties, so a repetition penalty sees the biased
    logit. Allowed ids and bad words only set logits to -inf, which nothing after brings
    back.

    Logprobs are the log-softmax of the logits after bias, allowed ids, bad words,
    suppression and penalties but before temperature, min-p, top-k and top-p: the model's
    distribution as the request shaped it, not the truncated one it was drawn from. (vLLM's
    default ``raw_logprobs`` is taken even before bias and penalties; ours sees them, so a
    biased or penalized token's logprob shows the change, and a banned one's is -inf.)
    The input logits are never modified.
    """

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dtype != torch.float32:
            logits = logits.float()
        if batch.fast_greedy:
            return SamplerOutput(greedy_argmax(logits).tolist(), [None] * batch.num_rows)

        if (batch.logit_bias_index is not None or batch.suppress_index is not None
                or batch.allowed_index is not None or batch.bad_words_index is not None):
            logits = logits.clone()  # the caller's logits stay untouched
        if batch.logit_bias_index is not None:
            rows, tokens, values = batch.logit_bias_index
            logits.index_put_((rows, tokens), values, accumulate=True)
        if batch.allowed_index is not None:
            restricted, rows, tokens = batch.allowed_index
            kept = logits[rows, tokens]
            logits[restricted] = float("-inf")
            logits[rows, tokens] = kept
        if batch.bad_words_index is not None:
            logits[batch.bad_words_index] = float("-inf")
        if batch.suppress_index is not None:
            logits[batch.suppress_index] = float("-inf")
        if not batch.no_penalties:
            logits = _apply_penalties(logits, batch)

        if batch.all_greedy:
            sampled = greedy_argmax(logits)
        else:
            sampled = self._sample(logits, batch)
            if not batch.all_random:
                sampled = torch.where(batch.greedy_mask, logits.argmax(dim=-1), sampled)

        token_ids: list[int] = sampled.tolist()
        if batch.max_num_logprobs is None:
            return SamplerOutput(token_ids, [None] * batch.num_rows)
        return SamplerOutput(token_ids, _gather_logprobs(logits, sampled, batch))

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # Out of place: from here on the tensor is ours to modify.
        logits = logits / batch.temperatures.unsqueeze(1)
        if batch.min_p is not None:
            _apply_min_p(logits, batch.min_p)
        logits = _apply_top_k_top_p(logits, batch.top_k, batch.max_top_k, batch.top_p)
        probs = logits.softmax(dim=-1)

        q = torch.empty_like(probs)
        if len(batch.seeded_rows) < batch.num_rows:
            q.exponential_()
        for i in batch.seeded_rows:
            q[i].exponential_(generator=batch.generators[i])
        # Exp(1) can round to 0 on some backends; 0/0 would be NaN, which argmax would pick.
        q.clamp_min_(torch.finfo(torch.float32).tiny)
        return probs.div_(q).argmax(dim=-1)


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    assert batch.output_token_counts is not None and batch.seen_token_mask is not None
    assert batch.repetition_penalties is not None
    assert batch.frequency_penalties is not None and batch.presence_penalties is not None
    # Repetition (HF / vLLM): shrink towards zero, dividing positive logits and multiplying
    # negative ones, for every token seen in the prompt or the output.
    rep = batch.repetition_penalties.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(batch.seen_token_mask, penalized, logits)
    # Frequency and presence (OpenAI): over output tokens only.
    counts = batch.output_token_counts
    logits = logits - batch.frequency_penalties.unsqueeze(1) * counts
    return logits - batch.presence_penalties.unsqueeze(1) * (counts > 0).float()


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below ``min_p`` times the top token's.

    Done in log space (p_i / p_max = exp(l_i - l_max)), so no softmax is needed.
    """
    max_logits = logits.amax(dim=-1, keepdim=True)
    threshold = max_logits + min_p.log().unsqueeze(1)  # log(0) = -inf keeps everything
    logits.masked_fill_(logits < threshold, float("-inf"))


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest set whose mass reaches p.

    Ties with the k-th logit are kept. Top-p sees the distribution renormalised after top-k.
    """
    if top_p is None:
        if top_k is not None:
            _apply_top_k_only(logits, top_k, max_top_k)
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth_pos = (logits_sort.size(1) - top_k).unsqueeze(1)
        kth_value = logits_sort.gather(1, kth_pos)
        logits_sort.masked_fill_(logits_sort < kth_value, float("-inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    cumulative = probs_sort.cumsum_(dim=-1)
    # Ascending order: drop the least likely tokens whose total mass is at most 1 - p; the
    # most likely token always survives.
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    logits_sort.masked_fill_(drop, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Top-k without a full sort: one ``topk`` of the largest k in the batch."""
    vocab_size = logits.size(1)
    disabled = top_k >= vocab_size
    k = top_k.masked_fill(disabled, 1)
    kth_value = logits.topk(max_top_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth_value.masked_fill_(disabled.unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < kth_value, float("-inf"))


def _gather_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, batch: SamplingBatch
) -> list[TokenLogprobs | None]:
    rows = batch.logprob_rows
    index = torch.tensor(rows, device=logits.device)
    result: list[TokenLogprobs | None] = [None] * batch.num_rows
    for row, entry in zip(rows, token_logprobs(logits.index_select(0, index),
                                               sampled.index_select(0, index),
                                               batch.num_logprobs), strict=True):
        result[row] = entry
    return result


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Row j's logprob of ``token_ids[j]`` (under the softmax of row j of ``logits``), that
    token's rank and the row's ``num_top[j]`` most likely tokens."""
    # log_softmax is one fused pass on CPU; logsumexp is several and took 3x as long.
    logprobs = logits.log_softmax(dim=-1)
    chosen = token_ids.unsqueeze(1)
    chosen_logprob = logprobs.gather(1, chosen)
    # Summed as int32: a bool tensor's default int64 sum is nearly twice as slow.
    ranks = (logprobs > chosen_logprob).sum(dim=-1, dtype=torch.int32) + 1
    max_n = max(num_top, default=0)
    top_v: list[list[float]] = []
    top_i: list[list[int]] = []
    if max_n > 0:
        # One top token (what evaluation harnesses ask for) is a plain max, cheaper than topk.
        top_values, top_ids = (logprobs.max(dim=-1, keepdim=True) if max_n == 1
                               else logprobs.topk(max_n, dim=-1))
        top_v, top_i = top_values.tolist(), top_ids.tolist()
    chosen_ids = chosen.squeeze(1).tolist()
    chosen_lps = chosen_logprob.squeeze(1).tolist()
    rank_list = ranks.tolist()
    return [
        TokenLogprobs(chosen_ids[j], chosen_lps[j], rank_list[j],
                      list(zip(top_i[j][:n], top_v[j][:n], strict=True)) if n > 0 else [])
        for j, n in enumerate(num_top)
    ]
