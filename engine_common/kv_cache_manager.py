"""Which KV blocks each request holds: prefix-cache lookups, slot allocation, freeing.

Owns the map request_id -> blocks, how many of each request's blocks are registered in the
prefix cache, and the prefix-cache hit counters. The scheduler asks it for blocks every step;
it does not decide who is scheduled or preempted (``scheduler``), and it does not own the
blocks themselves (``block_pool``) or the hash function (``block_hash``).

Block i of a request holds the KV of its tokens [i * block_size, (i + 1) * block_size).
A block is registered in the prefix cache as soon as it is allocated for a step that will
fill it, before the forward pass runs: a request scheduled later in the same step may then
reuse it, which is sound because the model runner writes a step's KV before attention reads.

Sliding windows: when every attention layer of the model slides (``sliding_window``: Mistral,
Mixtral with a window), a request's leading blocks whose tokens all lie before the window of
its next query are released while it runs, as vLLM's ``SlidingWindowManager`` does: the
table keeps a placeholder there (``OUT_OF_WINDOW_BLOCK_ID``, a valid id the attention never
reads at those positions, nor writes: a step writes only its own new tokens' slots). A
released block that was registered keeps its hash: it stays a prefix-cache hit until
evicted, like any freed block. Only blocks already registered are released (a block whose KV
arrives later, or not yet hashed, is kept until it is), and never those of a request whose
blocks a decode replica will pull (``hold_kv`` / ``announce_kv``: the whole prompt moves).
Models with layers of several attention types (GPT-OSS alternates a window and the whole
context) get a table per type when the engine splits its cache into KV cache groups
(``kv_cache_groups``): ``hybrid_kv_cache_manager`` extends this class to the other groups,
this one's rules being the first group's. Without the split, one table serves every layer
and every block is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_common.block_hash import BlockHash
from engine_common.block_pool import BlockPool, KVCacheBlock
from engine_common.kv_events import KVEvent
from engine_common.request import Request

# What a released block's table entry reads (see the module docstring): block 0, which may
# belong to another request; only positions the attention never visits point at it.
OUT_OF_WINDOW_BLOCK_ID = 0


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last ``take_prefix_cache_stats``; queries and hits are
    in tokens, as vLLM's ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    tier_hits: int = 0  # tokens loaded from a KV tier (engine_common.kv_tiers) instead


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_events: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same blocks' ids, kept alongside because the scheduler asks every step.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request were already offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Every layer's window, when all slide; how many leading blocks each request released.
        self.sliding_window = sliding_window
        self.num_released_blocks: dict[str, int] = {}
        self._placeholder = KVCacheBlock(OUT_OF_WINDOW_BLOCK_ID)
        # Blocks a logical block of a request spans, one per KV cache group (P/D's unit).
        self.pages_per_block = 1

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request that holds no blocks yet, and its length in
        tokens. The last token is never a hit: it must be computed to sample from its logits;
        nor is any token of a request that asks for prompt logprobs (they need its logits)."""
        if not self.enable_caching or request.needs_prompt_logprobs:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        get_cached_block = self.block_pool.get_cached_block
        computed: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        num_reserved_blocks: int = 0,
        delay_caching: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens this step.

        ``new_computed_blocks`` / ``num_new_computed_tokens`` are prefix hits from
        ``get_computed_blocks`` (only for a request that holds no blocks yet). At least
        ``num_reserved_blocks`` blocks must stay free afterwards (the admission watermark).
        Returns the newly allocated blocks (possibly none), or None, changing nothing, when
        the pool is too small. Then registers the blocks this step fills in the prefix cache,
        unless ``delay_caching`` (their KV comes from elsewhere later: call ``cache_blocks``
        once it has arrived).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}")
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        if new_computed_blocks and req_blocks:
            raise ValueError(f"prefix hits for request {request_id}, which already holds blocks")
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                f"{len(new_computed_blocks)} computed blocks"
            )
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_required_tokens = num_computed_tokens + num_new_tokens
        if num_required_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id} needs {num_required_tokens} token slots, "
                f"more than max_model_len={self.max_model_len}"
            )
        num_held = len(req_blocks) if req_blocks else 0
        num_required_blocks = -(-num_required_tokens // self.block_size)
        num_new_blocks = max(0, num_required_blocks - num_held - len(new_computed_blocks))
        # Prefix hits that sit in the free queue leave it when touched, like new blocks.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        pool = self.block_pool
        if num_new_blocks + num_free_hits > pool.get_num_free_blocks() - num_reserved_blocks:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
            self.req_to_block_ids[request_id] = []
            self.num_cached_blocks[request_id] = 0
            if self.enable_caching:
                # Counted on admission only, so a request that waits for room and is looked
                # up again every step counts once.
                stats = self.prefix_cache_stats
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += num_new_computed_tokens
        block_ids = self.req_to_block_ids[request_id]
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            block_ids.extend(block.block_id for block in new_computed_blocks)
            # Prefix hits are in the cache already.
            self.num_cached_blocks[request_id] = len(req_blocks)
        if num_new_blocks:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
            block_ids.extend(block.block_id for block in new_blocks)
        else:
            new_blocks = []

        if not delay_caching:
            self.cache_blocks(request, num_required_tokens)
        if self.sliding_window is not None:
            self._release_out_of_window(request, num_computed_tokens)
        return new_blocks

    def _release_out_of_window(self, request: Request, first_query: int) -> None:
        if request.hold_kv or request.announce_kv:
            return
        assert self.sliding_window is not None
        request_id = request.request_id
        self._release_behind(request_id, first_query, self.sliding_window,
                             self.req_to_blocks[request_id], self.req_to_block_ids[request_id],
                             self.num_cached_blocks, self.num_released_blocks)

    def _release_behind(self, request_id: str, first_query: int, window: int,
                        blocks: list[KVCacheBlock], block_ids: list[int],
                        num_cached: dict[str, int], num_released: dict[str, int]) -> None:
        """Release the leading blocks of one table that no query from position
        ``first_query`` on can see (a query at p sees positions (p - window, p]); cached
        blocks only, so that a released block's KV stays findable by its hash."""
        num_out = max(0, first_query - window + 1) // self.block_size
        if self.enable_caching:
            num_out = min(num_out, num_cached[request_id])
        start = num_released.get(request_id, 0)
        if num_out <= start:
            return
        released = blocks[start:num_out]
        blocks[start:num_out] = [self._placeholder] * len(released)
        block_ids[start:num_out] = [OUT_OF_WINDOW_BLOCK_ID] * len(released)
        num_released[request_id] = num_out
        self.block_pool.free_blocks(reversed(released))

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds in the pool (released out-of-window ones excluded)."""
        return (len(self.req_to_blocks.get(request_id, ()))
                - self.num_released_blocks.get(request_id, 0))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks within its first ``num_computed_tokens`` tokens
        in the prefix cache (those not registered yet)."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_cached = self.num_cached_blocks.get(request_id)
        if num_cached is None:
            return  # holds no blocks
        # Only tokens already known (in all_token_ids) have hashes; the rest of a step's
        # slots are for tokens not sampled yet.
        blocks = self.req_to_blocks[request_id]
        num_full_blocks = min(
            min(num_computed_tokens, request.num_tokens) // self.block_size, len(blocks)
        )
        if num_full_blocks > num_cached:
            self.block_pool.cache_full_blocks(
                blocks,
                request.block_hashes,
                num_cached,
                num_full_blocks,
                request.all_token_ids,
                self.block_size,
            )
            self.num_cached_blocks[request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release every block of a finished, aborted or preempted request (tail first, so the
        tail is evicted first). A request holding nothing is a no-op."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.req_to_block_ids.pop(request.request_id, None)
        num_released = self.num_released_blocks.pop(request.request_id, 0)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks[num_released:]))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy: the caller may keep it while the request grows."""
        return list(self.req_to_block_ids.get(request_id, ()))

    def get_transfer_block_ids(self, request_id: str, first: int = 0,
                               last: int | None = None) -> list[int]:
        """The blocks that hold the request's logical blocks ``first`` to ``last``, in the
        order P/D moves them (``pages_per_block`` for each: here the table itself)."""
        return self.get_block_ids(request_id)[first:last]

    def get_extra_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's tables of the KV cache groups after the first (copies); none with
        one group."""
        return ()

    def take_events(self) -> list[KVEvent]:
        return self.block_pool.take_events()

    def get_cached_block_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache; see ``BlockPool.get_cached_block_hashes``."""
        return self.block_pool.get_cached_block_hashes()

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache; False (nothing done) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def evict_cached_free_blocks(self) -> int:
        """Drop every block no request holds from the prefix cache (BlockRemoved events);
        see ``BlockPool.evict_cached_free_blocks``. Returns how many were evicted."""
        return self.block_pool.evict_cached_free_blocks()

    def note_tier_hits(self, num_tokens: int) -> None:
        """Tokens of an admitted request loaded from a KV tier rather than computed."""
        if self.enable_caching:
            self.prefix_cache_stats.tier_hits += num_tokens

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats
