"""Where vtoken changes what vLLM's block manager believes about a request (scheduler side).

The one touch point of ``v1/core/single_type_kv_cache_manager.py`` (vllm 0.32,
``FullAttentionManager``). Four methods are wrapped on the manager *instance* (no class of vLLM's
is modified, other engines in the process are unaffected):

  get_num_blocks_to_allocate, allocate_new_blocks
      size a request by its physical tokens: ``num_tokens`` counts logical tokens; the request's
      new tokens are appended at its table's cursor, so it needs ``num_tokens - gap`` slots where
      ``gap = total_len - write_pos`` (tokens evicted and compacted away).
  cache_blocks
      prefix caching hashes block i as if it held logical tokens [i*S, (i+1)*S); after an eviction
      that is true only below the first evicted token, so caching stops there.
  pop_blocks_for_free  (``free`` calls it too)
      the request leaves (finish, abort, preemption): its token table and policy state go with it.
"""

from __future__ import annotations

from typing import Protocol


class TokenView(Protocol):
    def gap(self, req_id: str) -> int: ...

    def intact_tokens(self, req_id: str) -> int | None: ...

    def forget(self, req_id: str) -> None: ...


def install(manager, tokens: TokenView) -> None:
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    if type(manager) is not FullAttentionManager:
        raise TypeError(f"vtoken sizes FullAttentionManager only, got {type(manager).__name__}")
    if getattr(manager, "vtoken_hooks", None) is not None:
        raise RuntimeError("vtoken hooks are already installed on this manager")
    get_num_blocks_to_allocate = manager.get_num_blocks_to_allocate
    allocate_new_blocks = manager.allocate_new_blocks
    cache_blocks = manager.cache_blocks
    pop_blocks_for_free = manager.pop_blocks_for_free

    def sized_get_num_blocks_to_allocate(request_id, num_tokens, *args, **kwargs):
        return get_num_blocks_to_allocate(request_id, num_tokens - tokens.gap(request_id), *args, **kwargs)

    def sized_allocate_new_blocks(request_id, num_tokens, *args, **kwargs):
        return allocate_new_blocks(request_id, num_tokens - tokens.gap(request_id), *args, **kwargs)

    def capped_cache_blocks(request, num_tokens, *args, **kwargs):
        intact = tokens.intact_tokens(request.request_id)
        return cache_blocks(request, num_tokens if intact is None else min(num_tokens, intact), *args, **kwargs)

    def forgetting_pop_blocks_for_free(request_id):
        tokens.forget(request_id)
        return pop_blocks_for_free(request_id)

    manager.get_num_blocks_to_allocate = sized_get_num_blocks_to_allocate
    manager.allocate_new_blocks = sized_allocate_new_blocks
    manager.cache_blocks = capped_cache_blocks
    manager.pop_blocks_for_free = forgetting_pop_blocks_for_free
    manager.vtoken_hooks = tokens


def uncache(pool, block_ids) -> int:
    """Drop blocks' prefix-cache hashes (their content no longer matches). ``v1/core/block_pool.py``."""
    return sum(bool(pool._maybe_evict_cached_block(pool.blocks[b])) for b in block_ids)


def is_cached(pool, block) -> bool:
    """Whether prefix caching can hand ``block`` to another request. ``v1/core/block_pool.py``."""
    return block.block_hash is not None or block.block_id in pool.cached_block_hashes_by_block


class Reserve:
    """Evacuation headroom inside vLLM's pool (``v1/core/block_pool.py``): ``get_num_free_blocks``, which vLLM's
    scheduler reads for admission and growth (``kv_cache_manager.allocate_slots``) and ``get_new_blocks``
    checks, reports ``blocks`` fewer free blocks, except while vtoken takes compaction destinations
    (``lifted``). So vLLM preempts before it would take the last ``blocks`` blocks, and compaction, which
    gives more blocks back than it takes, can still run when the pool is otherwise full."""

    def __init__(self, pool, blocks: int) -> None:
        self.blocks = blocks
        self.lifted = False
        self.true_free = pool.get_num_free_blocks
        pool.get_num_free_blocks = lambda: max(0, self.true_free() - (0 if self.lifted else self.blocks))

