"""The core's ``BlockAllocator`` protocol over vLLM's own ``BlockPool`` (scheduler side).

vtoken allocates relocation destinations and frees emptied sources in the pool vLLM's scheduler
uses, so a block vtoken releases is a block vLLM can hand to the next request. Depends on vllm 0.32
``v1/core/block_pool.py`` (``get_new_blocks``, ``free_blocks``, ``touch``, ``get_num_free_blocks``,
``blocks[i].ref_cnt``, the null block, the free queue's linked list) and ``v1/core/kv_cache_utils.py`` (``KVCacheBlock``).

Differences from ``vtoken.core.block_pool.BlockPool`` that callers see:
  * block 0 is vLLM's null block: never allocated, freed or shared (``BlockOutOfRangeError``);
  * the free count includes cached blocks that hold no reference (vLLM evicts them on reuse), and
    the order in which free blocks are handed out is vLLM's (freed uncached blocks are reused first).
Prefix-cache hashes of relocated blocks are the vLLM manager's business (``scheduler_tokens``); ``is_cached``
tells compaction which blocks a later request may map, so it leaves them in place.
Every call validates its whole batch before changing anything, and refuses what the core's
``BlockPool`` refuses, with the same classes: a count that is not an int (a float, a bool, a string)
or a purpose that is not a ``Purpose`` member (the string "admission" must not skip the headroom):
``InvalidArgumentError``; a block id that is not an int in range, or a batch that is not a sequence of
ids: ``BlockOutOfRangeError``. vLLM's own pool checks none of this (``get_new_blocks(1.5)`` would take
one block and leave its free counter at a fraction).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from vtoken.core.block_pool import Purpose
from vtoken.core.checks import as_list, check_enum, check_int
from vtoken.core.errors import (BlockOutOfRangeError, ConfigError, DoubleFreeError, HeadroomReservedError,
                                InvalidArgumentError, InvariantViolation, PoolExhaustedError)

from . import manager_hooks


class VllmBlockAllocator:
    """``BlockAllocator`` over a vLLM ``BlockPool``; ``headroom`` blocks are reserved for evacuation."""

    def __init__(self, pool, block_size: int, headroom: int = 0, reserve=None) -> None:
        check_int("block_size", block_size, 1, error=ConfigError)
        check_int("headroom", headroom, 0, pool.num_gpu_blocks - 2, error=ConfigError,
                  hint=f" (the pool has {pool.num_gpu_blocks} blocks including the null block)")
        self.pool = pool
        self.block_size = block_size
        self.num_blocks = pool.num_gpu_blocks
        self.headroom = headroom
        self.reserve = reserve  # manager_hooks.Reserve: vLLM sees the headroom as taken; this allocator does not

    # ---- queries -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.reserve.true_free() if self.reserve else self.pool.get_num_free_blocks()

    @property
    def num_allocated(self) -> int:
        return self.num_blocks - 1 - self.num_free  # NOTE: block 0, vLLM's null block, is neither

    def can_allocate(self, n: int, purpose: Purpose) -> bool:
        purpose = _check_request(n, purpose)
        reserve = self.headroom if purpose is Purpose.ADMISSION else 0
        return n == 0 or 0 <= n <= self.num_free - reserve

    def ref_count(self, block_id: int) -> int:
        return self._block(block_id).ref_cnt

    def is_cached(self, block_id: int) -> bool:
        """vLLM hashed the block (prefix caching on): a later request whose prompt matches may map it."""
        return manager_hooks.is_cached(self.pool, self._block(block_id))

    @property
    def shares_nothing(self) -> bool:
        """Whether no block can have a second reference or a prefix-cache hash: vLLM without prefix caching neither
        shares a block (a second reference is a prefix hit) nor hashes one. The fast path's planners then skip
        asking about each block (``FastGather._shares_nothing``); strict verify's shadow core asks the pool block by
        block and compares their plans."""
        return not self.pool.enable_caching

    def block_states(self, block_ids: list[int]) -> tuple[list[int], list[bool]]:
        """``ref_count`` and ``is_cached`` of each of ``block_ids`` (blocks a token table lists: in range, checked
        there), read in one pass: what the fast path's planners ask of a request's blocks every round."""
        blocks, cached = self.pool.blocks, self.pool.cached_block_hashes_by_block
        held = [blocks[b] for b in block_ids]
        return [b.ref_cnt for b in held], [b.block_hash is not None or b.block_id in cached for b in held]

    # ---- mutations -----------------------------------------------------------
    def allocate(self, n: int, purpose: Purpose) -> list[int]:
        purpose = _check_request(n, purpose)
        if n < 0:
            raise PoolExhaustedError(f"cannot allocate a negative number of blocks ({n}) for {purpose.value}")
        if not self.can_allocate(n, purpose):
            if purpose is Purpose.ADMISSION and n <= self.num_free:
                raise HeadroomReservedError(f"admission of {n} blocks would leave {self.num_free - n} free, "
                                            f"below the evacuation headroom of {self.headroom}")
            raise PoolExhaustedError(f"{purpose.value} needs {n} blocks, {self.num_free} free")
        if not n:
            return []
        if self.reserve is None or purpose is Purpose.ADMISSION:
            return [b.block_id for b in self.pool.get_new_blocks(n)]
        self.reserve.lifted = True  # evacuation may use the headroom vLLM is kept out of
        try:
            return [b.block_id for b in self.pool.get_new_blocks(n)]
        finally:
            self.reserve.lifted = False

    def share(self, block_id: int) -> None:
        block = self._block(block_id)
        if block.ref_cnt == 0:
            raise DoubleFreeError(f"cannot share block {block_id}: it is free")
        self.pool.touch([block])

    def free(self, block_ids: Iterable[int]) -> None:
        ids = as_list("blocks to free", block_ids, BlockOutOfRangeError)
        if not ids:
            return
        for b in ids:
            self._block(b)  # every id an int in range before any is hashed or counted
        for b, k in Counter(ids).items():
            held = self._block(b).ref_cnt
            if held < k:
                raise DoubleFreeError(f"block {b} freed {k} time(s) but holds {held} reference(s)")
        self.pool.free_blocks([self.pool.blocks[b] for b in ids])

    # ---- helpers -------------------------------------------------------------
    def _block(self, block_id: int):
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 1 <= block_id < self.num_blocks:
            raise BlockOutOfRangeError(f"block {block_id!r} outside the pool [1, {self.num_blocks}) "
                                       f"(block 0 is vLLM's null block)")
        return self.pool.blocks[block_id]

    def snapshot(self) -> tuple:
        """vLLM's reference counts and free queue, for tests that check a rejected call changed nothing."""
        q, out, node = self.pool.free_block_queue, [], self.pool.free_block_queue.fake_free_list_head.next_free_block
        while node is not None and node is not q.fake_free_list_tail:
            out.append(node.block_id)
            node = node.next_free_block
        return tuple(b.ref_cnt for b in self.pool.blocks), tuple(out)

    def check(self) -> None:
        """P1 over vLLM's pool: free-queue members have ref count 0, and the counts add up."""
        refs, free = self.snapshot()
        if len(set(free)) != len(free):
            raise InvariantViolation("P1", "a block is in vLLM's free queue twice")
        bad = [b for b in free if refs[b] != 0]
        if bad:
            raise InvariantViolation("P1", f"blocks {bad[:5]} are in vLLM's free queue with references")
        if len(free) != self.num_free:
            raise InvariantViolation("P1", f"vLLM's free queue holds {len(free)} blocks, counter says {self.num_free}")
        free_set = set(free)
        leaked = [b for b in range(1, self.num_blocks) if refs[b] == 0 and b not in free_set]
        if leaked:
            raise InvariantViolation("P1", f"blocks {leaked[:5]} have no reference and are not free (leaked)")


def _check_request(n: object, purpose: object) -> Purpose:
    """What ``BlockPool._check_request`` refuses: a count that is not an int, a purpose that is neither a member nor
    its value ("admission", "evacuation"; ``check_enum``). Returns the purpose as a member."""
    if n.__class__ is not int or purpose.__class__ is not Purpose:
        check_int("block count", n, error=InvalidArgumentError, hint=f" (for {purpose!r})")
        return check_enum("purpose", purpose, Purpose, error=InvalidArgumentError)
    return purpose
