"""Pool-wide physical occupancy: how many requests hold a live token in each slot.

Per-request bitmasks say which slots *one* request uses; a shared-prefix block
is used by several. Eq. 1's n_b counts a slot as occupied when any request
still needs it, so occupancy is kept here, once for the whole pool, and updated
in O(1) by every claim and release. This makes the global waste ratio F an
O(1) read (Stage 1 of the reclamation backend).
"""

from __future__ import annotations

from array import array

from .checks import check_int
from .errors import BlockOutOfRangeError, ConfigError, DestinationError, DoubleFreeError, InvariantViolation

_MAX_HOLDERS = 2**16 - 1
_ONE = array("H", [1])


def waste_ratio(live_slots: int, allocated_blocks: int, block_size: int) -> float:
    """F, Eq. 1: the share of allocated KV slots that hold no live token, ``1 - live / (allocated x S)``.

    NOTE: the one definition, used by the trigger (``ReclamationManager.waste_ratio``), the metrics
    (``metrics.measure``, recounted from scratch) and vLLM's gauge. ``allocated_blocks`` is
    ``BlockAllocator.num_allocated``: blocks some request holds, never a pool's own (vLLM's null block).
    0 when nothing is allocated. Raises I2 when F leaves [0, 1]: more live slots than allocated ones, or
    fewer than none (the occupancy counts are off)."""
    if allocated_blocks == 0:
        return 0.0
    f = 1.0 - live_slots / (allocated_blocks * block_size)
    if not 0.0 <= f <= 1.0:
        raise InvariantViolation("I2", f"waste ratio {f} out of [0, 1]")
    return f


class SlotOccupancy:
    """Holder counts per slot, distinct occupied slots per block, and their total.

    ``claim`` and ``release`` are the token table's (it validates first); called directly they still
    refuse a slot outside the pool, a release nobody holds and a claim past the counter's limit.
    """

    __slots__ = ("block_size", "_holders", "_block_live", "live_slots")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        check_int("num_blocks", num_blocks, 1, error=ConfigError)
        check_int("block_size", block_size, 1, error=ConfigError)
        self.block_size = block_size
        self._holders = array("H", bytes(2 * num_blocks * block_size))
        self._block_live = array("I", bytes(4 * num_blocks))
        self.live_slots = 0  # sum over blocks of n_b

    def claim(self, slot: int) -> None:
        self._check_slot(slot)
        h = self._holders[slot]
        if h >= _MAX_HOLDERS:
            raise DestinationError(f"slot {slot} has {h} holders, the counter's limit")
        self._holders[slot] = h + 1
        if h == 0:
            self._block_live[slot // self.block_size] += 1
            self.live_slots += 1

    def claim_run(self, first: int, n: int) -> None:
        """``claim`` of slots ``first .. first + n - 1``, all in one block: a prefill's appends, a block at a
        time. Unclaimed slots (the usual case: a private block past the cursor) are set in one C-speed slice;
        otherwise each slot is claimed as ``claim`` would."""
        S = self.block_size
        if not (first.__class__ is int and n.__class__ is int and 0 <= first and 0 <= n <= S - first % S
                and first + n <= len(self._holders)):
            raise BlockOutOfRangeError(f"slots [{first!r}, {first!r} + {n!r}) are not a run within one block of "
                                       f"the pool ({len(self._block_live)} blocks of {S})")
        run = self._holders[first:first + n]
        if run.count(0) != n:  # someone holds some of them already (a shared prefix block): one at a time
            for slot in range(first, first + n):
                self.claim(slot)
            return
        self._holders[first:first + n] = _ONE * n
        self._block_live[first // S] += n
        self.live_slots += n

    def release(self, slot: int) -> None:
        self._check_slot(slot)
        h = self._holders[slot]
        if h == 0:
            raise DoubleFreeError(f"slot {slot} released but no request holds it")
        self._holders[slot] = h - 1
        if h == 1:
            self._block_live[slot // self.block_size] -= 1
            self.live_slots -= 1

    def holders(self, slot: int) -> int:
        self._check_slot(slot)
        return self._holders[slot]

    def holders_of(self, slots: list[int]) -> list[int]:
        """``holders`` of each slot, in order, validated once: a batch of moves' sources or destinations."""
        n = len(self._holders)
        if slots and (not all(s.__class__ is int for s in slots) or min(slots) < 0 or max(slots) >= n):
            for s in slots:
                self._check_slot(s)  # raises for the first bad one (an int subclass passes here)
        h = self._holders
        return [h[s] for s in slots]

    def block_live(self, block_id: int) -> int:
        """n_b of Eq. 1: distinct occupied slots of the block."""
        if block_id.__class__ is not int or not 0 <= block_id < len(self._block_live):
            check_int("block", block_id, 0, len(self._block_live) - 1, error=BlockOutOfRangeError)
        return self._block_live[block_id]

    def occupied_mask(self, block_id: int) -> int:
        """The block's occupied offsets as a bitmask (bit o: slot ``block_id * S + o`` has a holder), O(S).

        NOTE: for a block one request lists alone this *is* that request's mask of live offsets (T1): no
        other request can hold a slot of it, so the token table keeps no mask of its own for it."""
        n = self.block_live(block_id)
        S = self.block_size
        if n == 0 or n == S:
            return (1 << n) - 1  # empty or full: the common cases, O(1)
        m = 0
        for o, h in enumerate(self._holders[block_id * S:(block_id + 1) * S]):
            if h:
                m |= 1 << o
        return m

    def _check_slot(self, slot: int) -> None:
        # negative indices would wrap around to the last block: refuse them (a cheap check, no type dispatch)
        if slot.__class__ is not int or not 0 <= slot < len(self._holders):
            check_int("slot", slot, 0, len(self._holders) - 1, error=BlockOutOfRangeError,
                      hint=f" ({len(self._block_live)} blocks of {self.block_size})")

    def state(self) -> tuple[bytes, bytes, int]:
        return (self._holders.tobytes(), self._block_live.tobytes(), self.live_slots)
