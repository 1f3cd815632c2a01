"""KV tiers behind the engine's pool: host memory, local disk and a shared Redis.

The engine's KV pool is the first tier (``block_pool``); these keep copies of computed
blocks after the pool has evicted them, keyed by the engine's block-hash chain within a
namespace of the model, dtype and layout (``key``). Blocks are written through as they are
computed, asynchronously (``worker``): a step copies a block's bytes out and never waits on
a store. A request whose prefix a tier holds waits in ``WAITING_FOR_TIER_KV`` while its
blocks load into the pool (``tiers.KvTiers``), other requests keep running; any failure
(a miss, a slow or unreachable Redis, a checksum mismatch, a truncated entry) loads less and
the rest is recomputed, counted by reason. See docs/kv-tiers.md.

Nothing is imported here: ``config`` is read by processes that never load torch.
"""
