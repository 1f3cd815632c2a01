"""Tandem's engine: the paged-KV, continuous-batching LLM engine every replica runs.

Owns a request's life inside the engine: its record in (``generation_request``), the block
pool and prefix cache (``block_pool``, ``kv_cache_manager``: invariants stated there and
property-tested), the scheduler (a token budget per step, chunked prefill, preemption by
recompute), the model and its attention backends (``model/``), the sampler, the incremental
detokenizer, metrics with vLLM's names and KV events. ``core_process`` runs the scheduler and
the model in a process of their own; ``AsyncLLM`` is its asyncio face, ``LLM`` the offline
one.

Contract with its neighbours: it takes ``GenerationRequest``s and streams ``RequestOutput``s;
for P/D it pins a finished prompt's blocks under a lease (producer) or pulls them through a
``kv_transfer`` connector (consumer). It imports nothing of the services around it.
"""
