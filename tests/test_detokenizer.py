"""The incremental detokenizer: streamed text equals a full decode; stop strings and hold-back."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine_common.detokenizer import IncrementalDetokenizer
from engine_common.sampling_params import SamplingParams
from engine_common.tokenizer import load_tokenizer

MIXED_TEXT = (
    "Hello, world! Naïve café — 你好，世界。東京は晴れ 🎉🙂👍🏽 and 🇫🇷 flags; "
    "résumé ñandú Ελληνικά русский текст 😀 end."
)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    """SmolLM2's tokenizer as the server loads it, from the suite's one conversion of the
    default model (reading it from the GGUF file again would cost ~9 s)."""
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def tiny_byte_bpe():
    """A byte-level BPE so small that CJK characters and emoji span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(["hello world the quick brown fox", "naïve café 世界 🎉"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def stream(
    tokenizer,
    output_ids: list[int],
    params: SamplingParams | None = None,
    prompt_ids: list[int] | None = None,
    chunk_sizes: list[int] | None = None,
    finish: bool = True,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ``output_ids`` in chunks, collecting each step's delta; stop at a stop string."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids or [], params or SamplingParams())
    deltas: list[str] = []
    sizes = iter(chunk_sizes or [])
    i = 0
    stop = None
    while i < len(output_ids):
        n = next(sizes, 1)
        stop = detok.update(output_ids[i : i + n])
        i += n
        last = stop is not None or i >= len(output_ids)
        deltas.append(detok.get_delta_text(finished=last and finish))
        if stop is not None:
            break
    return detok, deltas, stop


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_deltas_equal_full_decode(smollm2, skip_special_tokens: bool) -> None:
    prompt = smollm2.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    output = smollm2.encode(MIXED_TEXT) + [smollm2.eos_token_id]
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok, deltas, _ = stream(smollm2, output, params, prompt)
    expected = smollm2.decode(output, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected == detok.output_text
    assert ("<|im_end|>" in expected) is not skip_special_tokens
    assert all("\ufffd" not in d for d in deltas)
    assert detok.num_output_tokens == len(output)


def test_multibyte_characters_split_across_tokens_are_never_broken(tiny_byte_bpe) -> None:
    ids = tiny_byte_bpe.encode("你好世界 🎉🙂 café 東京")
    # The case is real: some single tokens are fragments of a character.
    assert any(tiny_byte_bpe.decode([t]).endswith("\ufffd") for t in ids)
    for chunk_sizes in ([1] * len(ids), [2, 3, 1, 4, 2] * 10):
        detok, deltas, _ = stream(tiny_byte_bpe, ids, chunk_sizes=chunk_sizes)
        assert "".join(deltas) == tiny_byte_bpe.decode(ids) == "你好世界 🎉🙂 café 東京"
        assert all("\ufffd" not in d for d in deltas)


def test_random_texts_stream_to_the_full_decode(smollm2, tiny_byte_bpe) -> None:
    rng = random.Random(0)
    alphabet = list("abc xyz,.!?\n") + list("éñü你好世界東京") + ["🎉", "🙂", "👍🏽", "🇫🇷"]
    for tokenizer in (smollm2, tiny_byte_bpe):
        for _ in range(20):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
            ids = tokenizer.encode(text)
            chunks = [rng.randint(1, 4) for _ in ids]
            _, deltas, _ = stream(tokenizer, ids, chunk_sizes=chunks)
            assert "".join(deltas) == tokenizer.decode(ids) == text


def test_incomplete_character_at_finish_is_flushed_like_decode(tiny_byte_bpe) -> None:
    ids = tiny_byte_bpe.encode("ok 你好")
    cut = next(i for i in range(1, len(ids)) if tiny_byte_bpe.decode(ids[:i]).endswith("\ufffd"))
    detok, deltas, _ = stream(tiny_byte_bpe, ids[:cut], finish=False)
    assert "\ufffd" not in "".join(deltas)
    deltas.append(detok.get_delta_text(finished=True))
    assert "".join(deltas) == tiny_byte_bpe.decode(ids[:cut])


def test_raw_tokenizers_tokenizer_is_accepted(smollm2) -> None:
    raw = smollm2.backend_tokenizer
    ids = raw.encode("plain Tokenizer 🙂 works").ids
    _, deltas, _ = stream(raw, ids)
    assert "".join(deltas) == "plain Tokenizer 🙂 works"


def test_decode_window_stays_small_on_long_outputs(smollm2) -> None:
    """O(new tokens) per update: each decode sees a bounded window, not the whole output."""
    window_sizes: list[int] = []
    backend = smollm2.backend_tokenizer

    class RecordingDecoder:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            window_sizes.append(len(ids))
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = smollm2.encode(MIXED_TEXT * 20)
    _, deltas, _ = stream(RecordingDecoder(), ids, prompt_ids=list(range(100, 400)))
    assert "".join(deltas) == smollm2.decode(ids)
    assert len(ids) > 1000 and max(window_sizes) <= 12


def tokens_of(tokenizer, text: str, piece: str) -> int:
    """How many tokens of ``text``'s encoding overlap ``piece``'s span."""
    ids = tokenizer.encode(text)
    start = text.index(piece)
    end = start + len(piece)
    count, pos = 0, 0
    for t in ids:
        n = len(tokenizer.decode([t]))
        if pos < end and pos + n > start:
            count += 1
        pos += n
    return count


def test_stop_string_spanning_tokens_is_caught_and_excluded(smollm2) -> None:
    text = "Hello world, the answer is 42. Then more text follows here."
    stop = "answer is 4"
    assert tokens_of(smollm2, text, stop) >= 3
    ids = smollm2.encode(text)
    detok, deltas, matched = stream(smollm2, ids, SamplingParams(stop=["nope", stop]))
    assert matched == stop == detok.stop_string
    assert "".join(deltas) == "Hello world, the " == detok.output_text
    # The stop came before the end of the tokens: nothing more is emitted, now or later.
    assert detok.num_output_tokens < len(ids)
    assert detok.update(smollm2.encode(" and more")) is None
    assert detok.get_delta_text(finished=True) == ""
    assert detok.output_text == "Hello world, the "


def test_stop_string_included_with_flag(smollm2) -> None:
    ids = smollm2.encode("Hello world, the answer is 42. Then more.")
    params = SamplingParams(stop=["answer is 4"], include_stop_str_in_output=True)
    detok, deltas, matched = stream(smollm2, ids, params)
    assert matched == "answer is 4"
    assert "".join(deltas) == "Hello world, the answer is 4" == detok.output_text


def test_stop_string_inside_one_multi_token_update(smollm2) -> None:
    ids = smollm2.encode("one two three four five six")
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["four", "two"]))
    # Both stops are in the same update: the earlier one in the text wins.
    assert detok.update(ids) == "two"
    assert detok.get_delta_text() == "one "


def test_partial_stop_prefix_is_held_then_released(smollm2) -> None:
    text = "Hello world! And world peace."
    ids = smollm2.encode(text)
    params = SamplingParams(stop=["world peace"])
    detok = IncrementalDetokenizer(smollm2, [], params)
    emitted = ""
    for i, t in enumerate(ids):
        matched = detok.update([t])
        emitted += detok.get_delta_text()
        decoded = smollm2.decode(ids[: i + 1])
        if decoded == "Hello world":
            # " world" might begin "world peace": held back, not emitted.
            assert emitted == "Hello "
        if decoded == "Hello world!":
            assert emitted == "Hello world!"  # it was not a stop: released
        if matched:
            break
    assert matched == "world peace"
    assert emitted == "Hello world! And "


def test_held_text_is_flushed_at_finish(smollm2) -> None:
    ids = smollm2.encode("Counting: one, two, thr")
    detok, deltas, matched = stream(smollm2, ids, SamplingParams(stop=["three!"]), finish=False)
    assert matched is None
    assert "".join(deltas) == "Counting: one, two, "  # "thr" may still become "three!"
    assert detok.get_delta_text(finished=True) == "thr"
    assert detok.output_text == "Counting: one, two, thr"


def test_stop_strings_ignored_before_min_tokens(smollm2) -> None:
    ids = smollm2.encode("stop here, then stop there")
    first_stop_tokens = len(smollm2.encode("stop"))
    params = SamplingParams(stop=["stop"], min_tokens=first_stop_tokens + 2, max_tokens=50)
    detok, deltas, matched = stream(smollm2, ids, params)
    assert matched == "stop"
    assert detok.output_text == "stop here, then "
    assert "".join(deltas) == "stop here, then "
