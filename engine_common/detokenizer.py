"""Turning a request's output tokens into streamed text, and finding its stop strings.

Owns incremental decoding (text deltas from token ids, never splitting a UTF-8 character
that spans several byte-level tokens), stop-string detection, and the hold-back of text that
might still become a stop string. It does not own token-level stops (EOS, stop token ids,
``max_tokens``: ``request``) or the request's status (the caller finishes the request when
``update`` reports a stop string).

Decoding is vLLM's prefix/read-offset algorithm (the one ``tokenizers.decoders.DecodeStream``
runs in Rust), on the tokenizer's Rust backend: each new token decodes a small window of ids
-- a few already-emitted ones for context, then the unemitted ones -- and emits what the
window adds beyond its context, unless that ends in an incomplete character (U+FFFD). The
work per token is bounded by the window, not by the length of the output. We own the
offsets rather than use ``DecodeStream`` so that the tail of an incomplete character can be
flushed when the request finishes, making the streamed text equal ``tokenizer.decode``.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine_common.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token, so that a tokenizer that
# drops a leading space at the start of a text (SentencePiece-style) keeps it here.
_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so at most 4 byte tokens. Past this many unemitted
# tokens the bytes are not going to form a character (or the tokens are skipped special
# ones): emit what there is, U+FFFD included, rather than let the window, and the cost per
# token, grow.
_MAX_PENDING_TOKENS = 8
_REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Streams one request's output text and watches for its stop strings.

    ``tokenizer`` is a ``transformers`` tokenizer (its Rust ``backend_tokenizer`` is used when
    it has one) or a ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decoder: _Decoder = tokenizer if backend is None else backend
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens

        # The decode window: ids[:read_offset] are emitted, ids[:prefix_offset] are dropped.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

        self._text = ""  # all output text decoded so far (cut at a matched stop string)
        self._emitted = 0  # characters of _text handed out by get_delta_text
        self._held = 0  # characters at the end of _text that may start a stop string
        self.num_output_tokens = 0
        self.stop_string: str | None = None

    @property
    def output_text(self) -> str:
        """All text so far, held-back text included, cut at a matched stop string."""
        return self._text

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; return the stop string if one now appears in the text, else None.

        ``stop_terminated``: the last token ended the request (EOS, a stop token id); as in
        vLLM V1 it adds no text unless ``include_stop_str_in_output``, so an EOS decoded with
        ``skip_special_tokens`` off does not end up in the answer. After a stop string has
        matched, further tokens are ignored.
        """
        if self.stopped:
            return None
        if stop_terminated and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        old_len = len(self._text)
        pieces = [self._decode_next(token_id) for token_id in new_token_ids]
        self.num_output_tokens += len(new_token_ids)
        self._text += "".join(pieces)
        if not self._stop or len(self._text) == old_len:
            return None
        if self.num_output_tokens >= self._min_tokens:
            match = self._find_stop(old_len)
            if match is not None:
                return match
        self._held = 0 if self._include_stop else self._stop_prefix_length()
        return None

    def get_delta_text(self, finished: bool = False) -> str:
        """Text produced since the last call; with ``finished``, everything that is left."""
        if finished and not self.stopped:
            self._flush()
            self._held = 0
        end = max(self._emitted, len(self._text) - self._held)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT_CHAR):
            return self._advance(text)
        if len(self._ids) - self._read_offset >= _MAX_PENDING_TOKENS:
            # Stray bytes or a run of skipped special tokens: slide on regardless.
            return self._advance(text)
        return ""

    def _advance(self, text: str) -> str:
        """Emit what ``text`` adds beyond its context, and slide the window forward."""
        new_text = text[len(self._prefix_text) :]
        # Keep only the ids still needed as context, so the list stays window-sized.
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset :])
        return new_text

    def _flush(self) -> None:
        """At the end, emit unfinished bytes as ``tokenizer.decode`` would (U+FFFD)."""
        if self._read_offset < len(self._ids):
            text = self._decode(self._ids[self._prefix_offset :])
            if len(text) > len(self._prefix_text):
                self._text += self._advance(text)

    def _find_stop(self, old_len: int) -> str | None:
        """The earliest stop string that ends in the text added since ``old_len``."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            # A new match must end after old_len, so it starts at most len(stop) - 1 earlier.
            pos = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        self._text = self._text[: pos + len(stop) if self._include_stop else pos]
        self._held = 0
        self.stop_string = stop
        return stop

    def _stop_prefix_length(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string."""
        longest = 0
        text = self._text
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
