"""Triton kernels for paged attention: cache write, decode, and ragged prefill.

Set ``TRITON_INTERPRET=1`` before this package is first imported to run them on the CPU
(Triton's interpreter), as the tests do.
"""

from engine_common.model.attention.triton_kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
)
from engine_common.model.attention.triton_kernels.kv_write import kv_write
from engine_common.model.attention.triton_kernels.prefill_attention import prefill_attention

__all__ = ["choose_num_splits", "decode_attention", "kv_write", "prefill_attention"]
