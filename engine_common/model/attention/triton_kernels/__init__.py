"""Triton kernels for paged attention, one module per kernel.

- ``kv_write``: store a step's K/V into the paged cache (``kv_write.kv_write``).
- ``decode_attention``: one query token per sequence, split over the context.
- ``prefill_attention``: ragged batches of query tokens (prefill, chunks, mixed steps).
- ``paged_attention_tile``: the inner tile step both attention kernels share.
- ``kernel_config``: launch settings derived from the inputs.

The functions are not re-exported here: their names match their modules', and a package
attribute would shadow the module. Set ``TRITON_INTERPRET=1`` before triton is first
imported to run the kernels on the CPU (Triton's interpreter), as the tests do.
"""
