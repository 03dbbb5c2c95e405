"""The paper's memory metrics, recomputed from scratch (never from incremental counters).

Independent of ``SlotOccupancy`` on purpose: tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_pool import BlockAllocator, blocks_needed
from .occupancy import waste_ratio
from .token_table import NO_SLOT, TokenTable


@dataclass(frozen=True)
class MemoryMetrics:
    allocated_blocks: int
    live_slots: int  # sum of n_b over allocated blocks
    waste_ratio: float  # F, Eq. 1
    low_util_share: float  # share of allocated blocks at <= 50% utilization
    retained_blocks: dict  # request -> blocks in its block list
    ideal_blocks: dict  # request -> ceil(live / S), the ideal packed footprint

    @property
    def total_retained(self) -> int:
        return sum(self.retained_blocks.values())

    @property
    def total_ideal(self) -> int:
        return sum(self.ideal_blocks.values())


def block_occupancy(table: TokenTable) -> dict[int, set[int]]:
    """Block -> offsets holding a live token of any request."""
    S = table.block_size
    occ: dict[int, set[int]] = {}
    for r in table.request_ids():
        for s in table.attention_slots(r):
            if s != NO_SLOT:
                occ.setdefault(s // S, set()).add(s % S)
    return occ


def measure(pool: BlockAllocator, table: TokenTable, low_util: float = 0.5) -> MemoryMetrics:
    S = pool.block_size
    occ = block_occupancy(table)
    allocated = [b for b in range(pool.num_blocks) if pool.ref_count(b) > 0]
    live = sum(len(occ.get(b, ())) for b in allocated)
    low = sum(1 for b in allocated if len(occ.get(b, ())) <= low_util * S)
    n = len(allocated)
    return MemoryMetrics(
        allocated_blocks=n,
        live_slots=live,
        waste_ratio=waste_ratio(live, n, S),
        low_util_share=0.0 if n == 0 else low / n,
        retained_blocks={r: len(table.block_ids(r)) for r in table.request_ids()},
        ideal_blocks={r: blocks_needed(table.num_live(r), S) for r in table.request_ids()},
    )
