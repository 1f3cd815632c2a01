"""Tandem's engine: the paged-KV, continuous-batching LLM engine every replica runs."""
