"""Decoder models (Llama family) over a paged KV cache."""
