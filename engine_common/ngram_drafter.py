"""Draft tokens for speculative decoding by n-gram lookup ("prompt lookup decoding").

Owns proposing, for a sequence, the tokens that followed the latest earlier occurrence of its
last n tokens (the longest n in ``[ngram_min, ngram_max]`` that occurs), continuing past the
end of the sequence as an overlapping copy (a loop of period p repeats every p tokens): text
that repeats its prompt or itself (quoting, editing code, extraction, lists) is predicted
for free, and a decode step checks the guess at almost no extra cost where it is
memory-bound. It does not
decide which requests speculate or check the drafts (``scheduler``, ``model_runner``).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine_common.config import SpeculativeConfig

# Only the latest tokens are searched: a step's lookup stays cheap on long sequences.
SEARCH_WINDOW = 2048


class NgramDrafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        if not 1 <= config.ngram_min <= config.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {config.ngram_min} and "
                             f"{config.ngram_max}")
        if config.num_tokens < 1:
            raise ValueError(f"num_tokens must be positive, got {config.num_tokens}")
        self.config = config

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``min(num_tokens, max_tokens)`` tokens that may follow ``token_ids``."""
        limit = min(self.config.num_tokens, max_tokens)
        if limit <= 0:
            return []
        tokens = np.asarray(token_ids[-SEARCH_WINDOW:], dtype=np.int64)
        for n in range(min(self.config.ngram_max, len(tokens) - 1), self.config.ngram_min - 1, -1):
            # Every window of n tokens that ends before the last token, against the last n.
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                follow = int(starts[-1]) + n  # the latest occurrence's next token
                # Copied as if the drafts were already there (an overlapping copy): a match
                # close to the end repeats its period instead of running out of tokens.
                period = len(tokens) - follow
                return [int(tokens[follow + i % period]) for i in range(limit)]
        return []
