"""The block allocator contract and its in-memory implementation.

vtoken never owns GPU memory; it borrows blocks from the serving engine's
allocator through ``BlockAllocator``. ``BlockPool`` is the reference
implementation used by tests, the simulator and the fuzzer; the vLLM adapter
implements the same protocol over vLLM's ``BlockPool``.

Invariants (docs/spec.md, P1-P3):
  P1  a block is free iff its ref count is 0, and every free block is in the
      free queue exactly once;
  P2  ``num_free == len(free queue)`` and ``num_free + allocated == num_blocks``;
  P3  admission allocations never leave fewer than ``headroom`` free blocks.
"""

from __future__ import annotations

import enum
from array import array
from collections import Counter, deque
from typing import Iterable, Protocol, Sequence

from .checks import as_list, check_enum, check_int
from .errors import (
    BlockOutOfRangeError,
    ConfigError,
    DoubleFreeError,
    HeadroomReservedError,
    InvalidArgumentError,
    InvariantViolation,
    PoolExhaustedError,
)


class Purpose(enum.Enum):
    """Why blocks are allocated; decides whether the evacuation headroom may be used."""

    ADMISSION = "admission"  # any growth of a request's KV: new requests and appends
    EVACUATION = "evacuation"  # destination blocks of a relocation plan


class BlockAllocator(Protocol):
    """What the core needs from a block allocator. Small on purpose: the vLLM adapter implements it."""

    block_size: int
    num_blocks: int
    headroom: int

    @property
    def num_free(self) -> int: ...

    @property
    def num_allocated(self) -> int:
        """Blocks some request holds (reference count > 0): the denominator of F. A pool's own blocks (vLLM's
        null block) are neither free nor allocated."""

    def can_allocate(self, n: int, purpose: Purpose) -> bool: ...

    def allocate(self, n: int, purpose: Purpose) -> list[int]: ...

    def free(self, block_ids: Iterable[int]) -> None: ...

    def share(self, block_id: int) -> None: ...

    def ref_count(self, block_id: int) -> int: ...

    def is_cached(self, block_id: int) -> bool:
        """Whether a prefix cache may hand this block to a later request (vLLM: it carries a block hash). Such a
        block is no source of a lazy compaction, only of one under pressure: copying its tokens out would leave
        this request one copy and a later hit another (issue #21)."""


class BlockPool:
    """A fixed pool of ``num_blocks`` blocks of ``block_size`` tokens with ref counts.

    ``headroom`` blocks are carved out of the same pool for evacuation: admission
    allocations must leave at least that many blocks free, evacuation
    allocations may take them. Blocks are handed out in FIFO order of release,
    which keeps every run deterministic.
    """

    def __init__(self, num_blocks: int, block_size: int, headroom: int = 0) -> None:
        check_int("num_blocks", num_blocks, 1, error=ConfigError)
        check_int("block_size", block_size, 1, error=ConfigError)
        check_int("headroom", headroom, 0, num_blocks - 1, error=ConfigError, hint=f" (num_blocks={num_blocks})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.headroom = headroom
        self._ref = array("I", bytes(4 * num_blocks))
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: set[int] = set()  # allocated blocks a later request may map (``cache``)

    # ---- queries -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        self._check_range(block_id)
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        self._check_range(block_id)
        return block_id in self._cached

    def is_allocated(self, block_id: int) -> bool:
        return self.ref_count(block_id) > 0

    def free_block_ids(self) -> list[int]:
        """The free queue, in the order blocks will be handed out."""
        return list(self._free)

    def can_allocate(self, n: int, purpose: Purpose) -> bool:
        """Whether ``allocate(n, purpose)`` would succeed now; a pure query.

        post:
            # P3: admitting n > 0 blocks is allowed iff at least ``headroom`` stay free; evacuation may take
            # every free block; taking nothing is always allowed
            __return__ == (n == 0 or 0 <= n <= self.num_free - (self.headroom if purpose is Purpose.ADMISSION else 0))
        raises: InvalidArgumentError
        """
        purpose = self._check_request(n, purpose)
        reserve = self.headroom if purpose is Purpose.ADMISSION else 0
        # taking nothing never dips into the headroom, even while evacuation has borrowed it
        return n == 0 or 0 <= n <= len(self._free) - reserve

    # ---- mutations -----------------------------------------------------------
    def allocate(self, n: int, purpose: Purpose) -> list[int]:
        """Take ``n`` free blocks, each with ref count 1.

        raises: PoolExhaustedError, HeadroomReservedError, InvalidArgumentError
        post:
            # the first n blocks of the free queue (FIFO), each now allocated once
            __return__ == __old__.self.free_block_ids()[:n] and self.free_block_ids() == __old__.self.free_block_ids()[n:] and all(self.ref_count(b) == 1 for b in __return__)
            # P3: an admission never leaves fewer than ``headroom`` blocks free
            purpose is not Purpose.ADMISSION or n == 0 or self.num_free >= self.headroom
        """
        purpose = self._check_request(n, purpose)
        if n < 0:
            raise PoolExhaustedError(f"cannot allocate a negative number of blocks ({n}) for {purpose.value}")
        if not self.can_allocate(n, purpose):
            if purpose is Purpose.ADMISSION and n <= len(self._free):
                raise HeadroomReservedError(
                    f"admission of {n} blocks would leave {len(self._free) - n} free, "
                    f"below the evacuation headroom of {self.headroom}"
                )
            raise PoolExhaustedError(f"{purpose.value} needs {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        held = [b for b in blocks if self._ref[b]]
        if held:  # P1: handing out a referenced block would give one block to two owners
            self._free.extendleft(reversed(blocks))
            raise InvariantViolation("P1", f"block {held[0]} is in the free queue with ref count {self._ref[held[0]]}")
        for b in blocks:
            self._ref[b] = 1
        return blocks

    def share(self, block_id: int) -> None:
        """Add a reference to an allocated block (a request reusing a cached prefix block).

        pre: block_id in [b for b in range(self.num_blocks) if self.ref_count(b) > 0]  # an allocated block
        raises: DoubleFreeError, BlockOutOfRangeError
        post:
            # one more reference to a block that stays allocated; the free queue is untouched
            self.ref_count(block_id) == __old__.self.ref_count(block_id) + 1 >= 2 and self.free_block_ids() == __old__.self.free_block_ids()
        """
        self._check_range(block_id)
        if self._ref[block_id] == 0:
            raise DoubleFreeError(f"cannot share block {block_id}: it is free")
        self._ref[block_id] += 1

    def cache(self, block_id: int) -> None:
        """Mark an allocated block prefix-cached until it is freed (the simulator's and the fuzzer's stand-in for
        vLLM hashing a full block): a later request may map it, so compaction leaves it where it is.

        raises: DoubleFreeError (a free block), BlockOutOfRangeError
        """
        self._check_range(block_id)
        if self._ref[block_id] == 0:
            raise DoubleFreeError(f"cannot cache block {block_id}: it is free")
        self._cached.add(block_id)

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per listed id; a block whose count reaches 0 joins the free queue.

        The whole batch is validated first, so a rejected call frees nothing.

        raises: DoubleFreeError, BlockOutOfRangeError
        post:
            # freeing only appends to the free queue, and never frees a block still referenced
            self.free_block_ids()[:__old__.self.num_free] == __old__.self.free_block_ids() and all(self.ref_count(b) == 0 for b in self.free_block_ids())
            # P1: every block whose count reached 0 is queued, exactly once
            sorted(self.free_block_ids()) == [b for b in range(self.num_blocks) if self.ref_count(b) == 0]
        """
        ids = as_list("blocks to free", block_ids, BlockOutOfRangeError)
        for b in ids:
            self._check_range(b)
        drops = Counter(ids)
        for b, k in drops.items():
            if self._ref[b] < k:
                raise DoubleFreeError(f"block {b} freed {k} time(s) but holds {self._ref[b]} reference(s)")
        for b in ids:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)
                self._cached.discard(b)

    # ---- helpers -------------------------------------------------------------
    def _check_range(self, block_id: int) -> None:
        if block_id.__class__ is not int and (not isinstance(block_id, int) or isinstance(block_id, bool)) \
                or not 0 <= block_id < self.num_blocks:
            raise BlockOutOfRangeError(f"block {block_id!r} outside the pool [0, {self.num_blocks})")

    @staticmethod
    def _check_request(n: int, purpose: Purpose | str) -> Purpose:
        """The purpose as a member (given as one, or as its value "admission" / "evacuation": ``check_enum``), once
        the count is an int."""
        if n.__class__ is not int or purpose.__class__ is not Purpose:  # (an int and a member: the hot path)
            check_int("block count", n, error=InvalidArgumentError, hint=f" (for {purpose!r})")
            return check_enum("purpose", purpose, Purpose, error=InvalidArgumentError)
        return purpose

    def snapshot(self) -> tuple:
        """The full state, for tests that check a rejected call changed nothing."""
        return (tuple(self._ref), tuple(self._free), tuple(sorted(self._cached)))

    def check(self) -> None:
        """P1 and P2; raises InvariantViolation naming the block at fault."""
        seen: set[int] = set()
        for b in self._free:
            if b in seen:
                raise InvariantViolation("P1", f"block {b} is in the free queue twice")
            seen.add(b)
            if self._ref[b] != 0:
                raise InvariantViolation("P1", f"block {b} is free but has ref count {self._ref[b]}")
        for b in range(self.num_blocks):
            if self._ref[b] == 0 and b not in seen:
                raise InvariantViolation("P1", f"block {b} has ref count 0 but is not in the free queue")
        for b in self._cached:
            if self._ref[b] == 0:
                raise InvariantViolation("P1", f"block {b} is free but still marked prefix-cached")


def blocks_short(running: int, waiting_blocks: int, num_free: int, headroom: int) -> int:
    """The engine's pressure (``VTokenRuntime.set_pressure``), one rule for the simulator and vLLM: how far the free
    blocks less the headroom (what admission may take) fall below a low watermark of one block per running request
    (each may need one within the next S steps, all at once when they advance in step) plus ``waiting_blocks``,
    the blocks of a request waiting for room (0: none)."""
    return max(0, running + waiting_blocks - (num_free - headroom))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size): the ideal packed footprint of ``num_tokens``.

    pre: num_tokens >= 0
    pre: block_size >= 1
    post: num_tokens <= __return__ * block_size < num_tokens + block_size
    """
    if num_tokens.__class__ is not int or block_size.__class__ is not int or num_tokens < 0 or block_size < 1:
        check_int("num_tokens", num_tokens, 0)
        check_int("block_size", block_size, 1, error=ConfigError)
    return -(-num_tokens // block_size)


__all__: Sequence[str] = ["Purpose", "BlockAllocator", "BlockPool", "blocks_needed", "blocks_short"]
