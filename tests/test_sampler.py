"""The sampler: greedy, seeds, temperature, top-k/top-p/min-p, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine_common.sampler import Sampler, SamplingBatch, SamplingRow, greedy_argmax
from engine_common.sampling_params import SamplingParams

sampler = Sampler()


def row(
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    generator: torch.Generator | None = None,
    suppress: frozenset[int] = frozenset(),
    **params: object,
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params),  # type: ignore[arg-type]
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=generator,
        suppress_token_ids=suppress,
    )


def sample(logits: torch.Tensor, rows: list[SamplingRow]):
    return sampler(logits, SamplingBatch.build(rows, logits.shape[1], "cpu"))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draw_many(logits_row: list[float], n: int, **params: object) -> torch.Tensor:
    """n independent draws from one distribution: one row per draw, one step."""
    torch.manual_seed(1234)
    logits = torch.tensor([logits_row]).repeat(n, 1)
    out = sample(logits, [row(**params) for _ in range(n)])
    return torch.bincount(torch.tensor(out.sampled_token_ids), minlength=len(logits_row))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def entropy(counts: torch.Tensor) -> float:
    p = counts.double() / counts.sum()
    p = p[p > 0]
    return float(-(p * p.log()).sum())


LOGITS8 = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]
# Chi-square critical value for 7 degrees of freedom at p = 0.001.
CHI2_7DF_999 = 24.32


def test_greedy_is_argmax_in_fast_path_and_mixed_batches() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 300)
    expected = logits.argmax(dim=-1).tolist()
    fast = SamplingBatch.build([row(temperature=0.0) for _ in range(16)], 300, "cpu")
    assert fast.fast_greedy and fast.all_greedy
    assert sampler(logits, fast).sampled_token_ids == expected

    rows = [row(temperature=0.0) if i % 2 else row(temperature=1.5, top_k=50) for i in range(16)]
    out = sample(logits, rows).sampled_token_ids
    assert [out[i] for i in range(1, 16, 2)] == [expected[i] for i in range(1, 16, 2)]


@pytest.mark.parametrize("vocab", [49152, 1536, 384, 1000])  # blocks of 512, 256, 128; none
def test_greedy_argmax_is_torch_argmax_exactly(vocab: int) -> None:
    """Ties (in one block and across blocks: the first wins), NaN (the first one, as torch
    takes it), rows of -inf, signed zeros, a max in the last position; through the sampler's
    fast greedy path too."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=gen)
    logits[0, [5, 7]] = 9.0  # a tie inside the first block
    logits[1, [vocab - 1, 3]] = 9.0  # a tie across blocks: the first block's wins
    logits[2, [vocab // 2, vocab - 2]] = float("nan")
    logits[3] = float("-inf")
    logits[4] = 0.0
    logits[4, vocab // 3] = -0.0
    logits[5, vocab - 1] = 50.0
    logits[6, [1, vocab // 2]] = float("nan")
    logits[6, 0] = float("inf")
    expected = logits.argmax(dim=-1)
    assert torch.equal(greedy_argmax(logits), expected)
    fast = SamplingBatch.build([row(temperature=0.0) for _ in range(12)], vocab, "cpu")
    assert sampler(logits, fast).sampled_token_ids == expected.tolist()


def test_same_seed_same_tokens_different_seed_differs() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any difference in the draws shows

    def run(seed: int) -> list[int]:
        gen = seeded(seed)  # one generator for the whole request, as the engine keeps it
        return [
            sample(logits, [row(generator=gen, seed=seed)]).sampled_token_ids[0] for _ in range(10)
        ]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_seeded_row_does_not_depend_on_batch_composition() -> None:
    torch.manual_seed(3)
    target_logits = torch.randn(500)

    def tokens_alone() -> list[int]:
        gen = seeded(42)
        return [
            sample(
                target_logits.unsqueeze(0), [row(generator=gen, seed=42, top_p=0.9)]
            ).sampled_token_ids[0]
            for _ in range(8)
        ]

    def tokens_in_batch() -> list[int]:
        gen = seeded(42)
        result = []
        for step in range(8):
            others = torch.randn(4, 500)
            logits = torch.cat([others[:2], target_logits.unsqueeze(0), others[2:]])
            rows = [
                row(temperature=0.7, top_k=10),
                row(temperature=0.0, repetition_penalty=1.3, output=[1, 2, 3]),
                row(generator=gen, seed=42, top_p=0.9),
                row(generator=seeded(step), seed=step),
                row(logprobs=3, min_p=0.1),
            ]
            result.append(sample(logits, rows).sampled_token_ids[2])
        return result

    assert tokens_alone() == tokens_in_batch()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_of_scaled_logits(temperature: float) -> None:
    counts = draw_many(LOGITS8, 20000, temperature=temperature)
    probs = torch.softmax(torch.tensor(LOGITS8) / temperature, dim=-1)
    assert chi_square(counts, probs) < CHI2_7DF_999


def test_temperature_lowers_and_raises_entropy() -> None:
    cold, neutral, hot = (draw_many(LOGITS8, 20000, temperature=t) for t in (0.5, 1.0, 2.0))
    assert entropy(cold) < entropy(neutral) < entropy(hot)


def test_top_k_restricts_support_to_k_most_likely() -> None:
    counts = draw_many(LOGITS8, 20000, top_k=3)
    assert set(torch.nonzero(counts).flatten().tolist()) == {0, 1, 2}
    probs = torch.softmax(torch.tensor(LOGITS8[:3]), dim=-1)
    assert chi_square(counts[:3], probs) < 13.8  # 2 df, p = 0.001


def nucleus_logits(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


@pytest.mark.parametrize(("top_p", "support"), [(0.7, {0, 1}), (0.8, {0, 1, 2}), (0.4, {0})])
def test_top_p_keeps_smallest_nucleus(top_p: float, support: set[int]) -> None:
    probs = [0.5, 0.25, 0.15, 0.1]
    counts = draw_many(nucleus_logits(probs), 8000, top_p=top_p)
    assert set(torch.nonzero(counts).flatten().tolist()) == support
    kept = torch.tensor([probs[i] for i in sorted(support)])
    if len(support) > 1:
        observed = counts[sorted(support)]
        assert chi_square(observed, kept / kept.sum()) < 13.8


def test_top_k_and_top_p_together() -> None:
    # top-k=3 renormalises to [0.5, 0.25, 0.15] / 0.9; top-p=0.8 then needs {0, 1} (0.83).
    counts = draw_many(nucleus_logits([0.5, 0.25, 0.15, 0.1]), 4000, top_k=3, top_p=0.8)
    assert set(torch.nonzero(counts).flatten().tolist()) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    # min_p=0.2 of max 0.5 -> threshold 0.1: token 3 (0.08) goes, token 2 (0.12) stays.
    counts = draw_many(nucleus_logits([0.5, 0.3, 0.12, 0.08]), 8000, min_p=0.2)
    assert set(torch.nonzero(counts).flatten().tolist()) == {0, 1, 2}


def all_logprobs(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """The logprob vector the sampler reports for one row (logprobs = whole vocab)."""
    out = sample(logits.unsqueeze(0), [r]).logprobs[0]
    assert out is not None
    result = torch.full((logits.numel(),), float("nan"))
    for token_id, lp in out.top:
        result[token_id] = lp
    return result


def test_penalties_change_logits_exactly_as_specified() -> None:
    logits = torch.tensor([1.6, -1.0, 0.9, -0.5, 1.0, 0.0])
    prompt = [0, 3]
    output = [1, 4, 4]
    r = row(
        prompt=prompt,
        output=output,
        temperature=0.0,
        logprobs=6,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    # Repetition over prompt+output {0, 1, 3, 4}: positive / 2, negative * 2.
    # Frequency (0.5 * count) and presence (0.25) over output {1: 1, 4: 2} only.
    expected = torch.tensor(
        [
            1.6 / 2,  # prompt only: repetition
            -1.0 * 2 - 0.5 * 1 - 0.25,  # output once
            0.9,  # unseen
            -0.5 * 2,  # prompt only
            1.0 / 2 - 0.5 * 2 - 0.25,  # output twice
            0.0,  # unseen
        ]
    )
    torch.testing.assert_close(all_logprobs(logits, r), expected.log_softmax(dim=-1))
    # Token 0 led before; after the penalties token 2 does.
    assert sample(logits.unsqueeze(0), [r]).sampled_token_ids == [2]


def test_repetition_penalty_alone_uses_prompt_and_output() -> None:
    logits = torch.tensor([3.0, 2.9, -1.0, 1.0])
    r = row(prompt=[0], output=[2], temperature=0.0, logprobs=4, repetition_penalty=1.5)
    expected = torch.tensor([3.0 / 1.5, 2.9, -1.5, 1.0])
    torch.testing.assert_close(all_logprobs(logits, r), expected.log_softmax(dim=-1))


def test_min_tokens_suppresses_stop_ids_until_reached() -> None:
    eos = 5
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4, 9.0]])
    suppress = frozenset({eos})
    early = row(output=[1, 2], temperature=0.0, min_tokens=3, suppress=suppress)
    reached = row(output=[1, 2, 3], temperature=0.0, min_tokens=3, suppress=suppress)
    assert sample(logits, [early]).sampled_token_ids == [4]
    assert sample(logits, [reached]).sampled_token_ids == [eos]

    torch.manual_seed(0)
    many = logits.repeat(500, 1)
    drawn = sample(many, [row(output=[1], min_tokens=3, suppress=suppress) for _ in range(500)])
    assert eos not in drawn.sampled_token_ids


def test_logprobs_are_log_softmax_with_sorted_top_n_and_rank() -> None:
    torch.manual_seed(11)
    logits = torch.randn(4, 50) * 3
    rows = [
        row(temperature=0.0, logprobs=5),
        row(temperature=1.3, top_k=20, logprobs=3),  # sampled: rank may be > 1
        row(temperature=1.0),  # no logprobs asked
        row(temperature=0.8, top_p=0.5, logprobs=0),  # sampled token only
    ]
    out = sample(logits, rows)
    # Raw semantics: independent of temperature / top-k / top-p.
    reference = logits.log_softmax(dim=-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp is not None
        token = out.sampled_token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(reference[i, token].item(), abs=1e-5)
        assert lp.rank == 1 + int((reference[i] > reference[i, token]).sum())
        n = rows[i].params.logprobs
        assert len(lp.top) == n
        values, ids = reference[i].topk(n) if n else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert out.logprobs[0] is not None and out.logprobs[0].rank == 1


def test_input_logits_are_not_modified() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, 40)
    before = logits.clone()
    rows = [
        row(temperature=0.5, top_k=5, top_p=0.8, min_p=0.05, output=[1], repetition_penalty=1.2),
        row(output=[], min_tokens=2, suppress=frozenset({0})),
        row(temperature=0.0, logprobs=2),
    ]
    sample(logits, rows)
    assert torch.equal(logits, before)


def test_full_vocab_batch_of_64_mixed_rows() -> None:
    vocab = 49152
    torch.manual_seed(9)
    logits = torch.randn(64, vocab)
    rows = []
    for i in range(64):
        kind = i % 4
        if kind == 0:
            rows.append(row(temperature=0.0))
        elif kind == 1:
            rows.append(row(temperature=0.8, top_p=0.95, top_k=40, generator=seeded(i), seed=i))
        elif kind == 2:
            rows.append(row(temperature=1.0, min_p=0.05, logprobs=5))
        else:
            rows.append(
                row(
                    temperature=0.7,
                    output=list(range(i, i + 100)),
                    prompt=list(range(1000)),
                    frequency_penalty=0.3,
                )
            )
    out = sample(logits, rows)
    assert len(out.sampled_token_ids) == 64
    assert all(0 <= t < vocab for t in out.sampled_token_ids)
    top40 = logits[1].topk(40).indices.tolist()
    assert out.sampled_token_ids[1] in top40
    assert out.sampled_token_ids[0] == int(logits[0].argmax())
