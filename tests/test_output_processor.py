"""The output processor: across a resumed stream no text is lost and stop strings are still
caught; the token that stopped a request shows no text.

When a replica dies mid-stream the gateway resumes on another replica with the tokens
already streamed appended to the prompt. Text the first replica was holding back (the start
of a possible stop string) was never sent; the second replica must emit it, and a stop
string spanning the resume point must still end the stream.
"""

from __future__ import annotations

from engine_common.output_processor import OutputProcessor
from engine_common.outputs import EngineCoreOutput, EngineCoreOutputs
from engine_common.sampling_params import SamplingParams
from engine_common.tokenizer import load_tokenizer


def stream(processor: OutputProcessor, request_id: str, tokens: list[int]) -> tuple[str, str | None]:
    text, reason = "", None
    for token in tokens:
        [out], _ = processor.process(EngineCoreOutputs(outputs=[EngineCoreOutput(request_id, [token])]))
        text += out.delta_text
        if out.finished:
            return text, out.finish_reason
    return text, reason


def test_resumed_stream_emits_held_back_text_and_catches_spanning_stops(tiny_llama_dir):
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    prompt = tokenizer("the story begins").input_ids
    first = tokenizer(" and the wor", add_special_tokens=False).input_ids
    params = SamplingParams(stop=["world"], max_tokens=64)

    # Replica A streams " and the wor": "wor" may start "world", so it is held back.
    a = OutputProcessor(tokenizer)
    a.add_request("r", prompt, params, 0.0)
    sent, _ = stream(a, "r", first)
    assert sent == " and the "

    # Replica B resumes with A's tokens in its prompt; "k" makes "work", not the stop string.
    rest = tokenizer("k is done", add_special_tokens=False).input_ids
    b = OutputProcessor(tokenizer)
    b.add_request("r", prompt + first, params, 0.0, num_resumed_tokens=len(first))
    more, _ = stream(b, "r", rest)
    assert sent + more == tokenizer.decode(first + rest)

    # Resumed again, but "ld" completes the stop string across the resume point.
    c = OutputProcessor(tokenizer)
    c.add_request("r", prompt + first, params, 0.0, num_resumed_tokens=len(first))
    more, reason = stream(c, "r", tokenizer("ld peace", add_special_tokens=False).input_ids)
    assert reason == "stop" and sent + more == " and the "


def test_the_token_that_stopped_a_request_adds_no_text(tiny_llama_dir):
    """As vLLM V1: a request stopped by a token (EOS, a stop token id) does not show that
    token's text, even with skip_special_tokens off (a parser that needs special tokens must
    not see EOS in the answer), unless include_stop_str_in_output asks for it."""
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    words = tokenizer(" alpha bravo", add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id

    def answer(last: int, stop_reason: int | None, **options: object) -> str:
        processor = OutputProcessor(tokenizer)
        processor.add_request("r", [1, 2], SamplingParams(max_tokens=16, **options), 0.0)
        [out], _ = processor.process(EngineCoreOutputs(outputs=[EngineCoreOutput(
            "r", [*words, last], finish_reason="stop", stop_reason=stop_reason)]))
        assert out.finished and out.new_token_ids == [*words, last]  # the ids keep it
        return out.delta_text

    plain = tokenizer.decode(words)
    assert answer(eos, None, skip_special_tokens=False) == plain
    assert answer(words[0], words[0], stop_token_ids=[words[0]]) == plain
    assert answer(words[0], words[0], stop_token_ids=[words[0]],
                  include_stop_str_in_output=True) == tokenizer.decode([*words, words[0]])
    assert tokenizer.decode([eos], skip_special_tokens=False)  # EOS has text to leave out
