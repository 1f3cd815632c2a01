"""Attention backends: how one layer's attention reads and writes the paged KV cache."""
