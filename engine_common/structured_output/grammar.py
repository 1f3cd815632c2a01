"""Compiling a request's constraint with xgrammar and enforcing it on the logits.

Owns everything that touches xgrammar: ``GrammarCompiler`` (one per process, built from the
model's tokenizer and vocabulary size) turns a ``StructuredOutputSpec`` into a compiled
grammar and a per-request ``RequestGrammar`` (an xgrammar ``GrammarMatcher``: which tokens may
come next, and the tokens accepted so far); ``GrammarBitmask`` writes the allowed-token masks
of one step's constrained rows and applies them to the logits. It does not own when a token
is accepted or a request stops (the scheduler and ``Request``), nor the other sampling stages
(``sampler``).

Compiling happens synchronously where a request is added (the engine core, and the frontend's
check before admission): it takes a few milliseconds (2-5 ms measured for small schemas) and
xgrammar caches compiled grammars, so a repeated schema costs a lookup. xgrammar's tokenizer
table is built on the first constrained request (about 0.3 s for a 128k vocabulary), so a
replica that never sees one pays nothing; xgrammar itself is imported then too (it imports
transformers' tokenizer modules and part of torch's: about 1 s of every process start).

The mask is applied to the logits before the sampler, as vLLM V1 does: logit bias,
min-tokens suppression and penalties then act on masked logits (a masked token stays at
-inf), greedy rows may still take the plain argmax, and logprobs (the log-softmax after
bias, suppression and penalties, see ``Sampler``) are those of the masked distribution: a
token the grammar forbids has logprob -inf.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine_common.structured_output.spec import StructuredOutputError, StructuredOutputSpec

# xgrammar's messages start with a timestamp and its C++ source position.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# Any JSON object; a schema rather than xgrammar's builtin JSON grammar, which accepts any
# JSON value (OpenAI's json_object promises an object) and any whitespace.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'

if TYPE_CHECKING:  # imported where used, at the first constrained request
    import xgrammar as xgr


def _xgrammar_message(error: Exception) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(error).strip())


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; one per process, shared by its requests
    (xgrammar's compiler is thread-safe, and its cache is what makes a repeated schema free).

    ``vocab_size`` is the model's (the logits' width), which may exceed the tokenizer's;
    ``stop_token_ids`` are the engine's EOS ids, the tokens that end a complete grammar.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()  # two first requests must not both build the table

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    # None: xgrammar finds the tokenizer's own EOS (an empty list is an error).
                    stop_token_ids=self._stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``; raises StructuredOutputError with xgrammar's
        reason when it cannot be compiled.

        JSON schemas compile with ``any_whitespace=False``: one line, with xgrammar's default
        ", " and ": " separators. Allowing any whitespace lets a small model loop on spaces
        and newlines until max_tokens, and whitespace carries nothing. Objects are strict
        (xgrammar's default, as vLLM): no properties beyond the schema's.
        """
        compiler = self._xgr_compiler()
        try:
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "json_object":
                return compiler.compile_json_schema(_ANY_OBJECT_SCHEMA, any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return compiler.compile_grammar(_choice_ebnf(spec.choices()))
            return compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError) as error:  # xgrammar's parse errors
            raise StructuredOutputError(
                f"cannot compile the {spec.kind.replace('_', ' ')}: {_xgrammar_message(error)}"
            ) from error

    def matcher(self, spec: StructuredOutputSpec,
                accepted_token_ids: Sequence[int] = ()) -> RequestGrammar:
        """A new matcher for ``spec`` that has accepted ``accepted_token_ids`` (output
        tokens sampled before this engine saw the request: a P/D first token, a resumed
        stream); raises StructuredOutputError if the grammar rejects one of them."""
        tokens = (*spec.starts_after, *([] if spec.waits_if_first is None
                                         else [spec.waits_if_first]))
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise StructuredOutputError(
                f"starts_after / waits_if_first token ids must be in [0, {self.vocab_size}); "
                f"got {list(tokens)}")
        import xgrammar as xgr

        grammar = RequestGrammar(xgr.GrammarMatcher(self.compile(spec)), spec.starts_after,
                                 spec.waits_if_first)
        for i, token_id in enumerate(accepted_token_ids):
            if not grammar.accept(token_id):
                raise StructuredOutputError(
                    f"output token {i} ({token_id}), generated before this engine took the "
                    f"request, does not follow the {spec.kind.replace('_', ' ')}")
        return grammar


def _choice_ebnf(choices: Sequence[str]) -> str:
    # A JSON string literal is an EBNF one too: xgrammar reads its escapes (\", \\, \n,
    # \uXXXX), so any choice text is expressed exactly.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class RequestGrammar:
    """One request's position in its grammar: which tokens may come next.

    With ``starts_after`` the grammar waits (no token masked, none checked) until the output
    has those tokens in a row, and holds from the next token on. With ``waits_if_first`` as
    well, the first token decides: that token starts the wait, any other starts the grammar
    (so the first token's mask allows the grammar's tokens and that one)."""

    def __init__(self, matcher: xgr.GrammarMatcher, starts_after: Sequence[int] = (),
                 waits_if_first: int | None = None):
        self._matcher = matcher
        self._trigger = tuple(starts_after)
        self._opener = waits_if_first
        self._recent: tuple[int, ...] = ()
        self._state = ("active" if not self._trigger else
                       "deciding" if waits_if_first is not None else "waiting")

    @property
    def masks(self) -> bool:
        """Whether the next token is masked (the grammar holds, or the first token decides)."""
        return self._state != "waiting"

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (state unchanged) if the grammar forbids it."""
        if self._state == "deciding":
            if token_id == self._opener:
                self._state = "waiting"
                return True
            self._state = "active"
        if self._state == "waiting":
            self._recent = (*self._recent, token_id)[-len(self._trigger):]
            if self._recent == self._trigger:
                self._state = "active"
            return True
        return bool(self._matcher.accept_token(token_id))

    def fork(self) -> RequestGrammar:
        """An independent copy at the same position (speculative decoding advances one past
        each draft, to mask the positions after it)."""
        copy = RequestGrammar(self._matcher.fork(), self._trigger, self._opener)
        copy._recent, copy._state = self._recent, self._state
        return copy

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted a stop token: nothing may follow."""
        return self._state == "active" and bool(self._matcher.is_terminated())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._state == "deciding" and self._opener is not None:
            bit = 1 << (self._opener & 31)
            bitmask[row, self._opener >> 5] |= bit - (1 << 32) if bit >= 1 << 31 else bit


class GrammarBitmask:
    """The allowed-token masks of one step's constrained rows, applied to the logits in place.

    One CPU buffer of ``max_rows`` rows (pinned on CUDA, copied to the device each step) is
    reused every step, grown when a step has more rows: a step's copy has finished before the
    next step writes the buffer, since every step waits for its sampled tokens.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self._cpu = self._allocate(max_rows)

    def _allocate(self, num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        buffer = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        return buffer.pin_memory() if self.device.type == "cuda" else buffer

    def apply(self, logits: torch.Tensor, grammars: Sequence[tuple[int, RequestGrammar]]) -> None:
        """Set every token that ``grammar`` forbids next to -inf in ``logits[row]``, for each
        (row, grammar); other rows are left alone. The rows' masks stay readable
        (``allows_other_than``) until the next call."""
        if logits.shape[0] > self._cpu.shape[0]:  # speculative steps have a row per draft
            self._cpu = self._allocate(logits.shape[0])
        for row, grammar in grammars:
            grammar.fill_bitmask(self._cpu, row)
        num_rows = logits.shape[0]
        bitmask = self._cpu[:num_rows]
        if self.device.type != "cpu":
            bitmask = bitmask.to(self.device, non_blocking=True)
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                        indices=[row for row, _ in grammars])

    def allows_other_than(self, row: int, token_ids: Collection[int]) -> bool:
        """Whether ``row``'s last mask allows some token outside ``token_ids``."""
        words = self._cpu[row].numpy().view(np.uint32).copy()
        for t in token_ids:
            if 0 <= t < self.vocab_size:
                words[t >> 5] &= ~np.uint32(1 << (t & 31))
        tail = self.vocab_size & 31
        if tail:  # bits past the vocabulary in the last word are no tokens
            words[-1] &= np.uint32((1 << tail) - 1)
        return bool(words.any())
