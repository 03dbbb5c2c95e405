"""What a relocation planner produces: a ``Plan``, or a typed ``NoPlan`` saying why not.

A plan is computed from one ``RequestSnapshot`` and is only committed if the
request's layout is still the one it was computed from (I4). It is pure data;
the reclamation manager owns its lifecycle (PLANNED -> COPYING -> COMMITTED or
ABORTED).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# NOTE: ``contracts`` in the docstring contracts is core/reference/contracts.py: spec/crosshair_check.py binds it
# here for CrossHair; the runtime never imports an oracle (core/reference/__init__.py)
from .token_table import Move


class PlanKind(enum.Enum):
    COMPACT = "compact"  # pack low-utilization blocks into fresh ones (gather read path)
    DENSIFY = "densify"  # fill holes so live tokens occupy positions [0, n_live) (dense read path)
    RELOCATE = "relocate"  # one block's live tokens to a fresh block, same offsets (the vLLM drill)
    RELEASE = "release"  # drop wholly dead private blocks, no copy: the paper's Naive-Evict (gather read path)


class NoPlanReason(enum.Enum):
    NO_CANDIDATES = "no eligible source blocks"
    NO_STRICT_DECREASE = "packing would not free more blocks than it uses"
    NOT_ENOUGH_HEADROOM = "not enough free blocks for the destinations"
    ALREADY_DENSE = "live tokens already occupy [0, n_live)"
    SHARED_BLOCK = "a shared-prefix block would be written, read or freed"


@dataclass(frozen=True)
class NoPlan:
    reason: NoPlanReason
    detail: str = ""

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True)
class Plan:
    """A set of moves for one request, plus the blocks it takes and releases.

    Attributes:
        kind: which planner made it.
        req_id: the request.
        version: ``(layout_version, total_len)`` of the snapshot it was planned from.
        moves: token relocations; destinations are distinct, sources are live slots.
        src_blocks: blocks the request gives up at commit (empty of its live tokens by then).
        dst_blocks: fresh blocks the plan fills (compact, relocate); held by the plan until commit.
        dense_write_pos: for densify, the append cursor after commit (= n_live).
    """

    kind: PlanKind
    req_id: object
    version: tuple[int, int]
    moves: tuple[Move, ...]
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...] = ()
    dense_write_pos: int | None = None

    def __bool__(self) -> bool:
        return True

    @property
    def blocks_saved(self) -> int:
        return len(self.src_blocks) - len(self.dst_blocks)

    def kept_destinations(self, receives) -> tuple[int, ...]:
        """The destinations a commit keeps, ``receives(move)`` telling whether a move still lands (its token
        is live): compact keeps those receiving a token; relocate keeps its one, which takes the source's
        place whatever it receives (an emptied block stays a block, so the cursor keeps its position)."""
        if self.kind is PlanKind.RELOCATE:
            return self.dst_blocks
        receiving = {m.dst_block for m in self.moves if receives(m)}
        return tuple(b for b in self.dst_blocks if b in receiving)

    def final_layout(self, blocks: list[int], write_pos: int, block_size: int,
                     dst_blocks: tuple[int, ...] | None = None) -> tuple[list[int], int]:
        """The block list and append cursor after commit, given the request's current ones.

        Compact: destinations (``dst_blocks``, default all of the plan's; commit
        passes only those still receiving a token) take the place of the first
        source; all sources lie before the cursor block, so the cursor shifts by
        whole blocks, and blocks appended since planning are kept. Relocate: the
        destination takes its source's index (the cursor's block included), the
        cursor stays. Densify: trailing emptied blocks go and the cursor is n_live.
        Release: compact with no destination (its sources, wholly dead, just leave).

        pre: block_size >= 1 and 0 <= write_pos <= len(blocks) * block_size
        pre: all(b not in blocks[:i] for i, b in enumerate(blocks))  # distinct
        pre: self.kind is not PlanKind.DENSIFY or self.dense_write_pos is not None
        pre: self.kind not in (PlanKind.COMPACT, PlanKind.RELEASE) or contracts.compact_sources_before_the_cursor(self, blocks, write_pos, block_size)
        # relocate: one source in the list, one fresh destination
        pre: self.kind is not PlanKind.RELOCATE or (len(self.src_blocks) == 1 and self.src_blocks[0] in blocks)
        pre: self.kind is not PlanKind.RELOCATE or len(self.dst_blocks if dst_blocks is None else dst_blocks) == 1
        # compact, relocate: distinct destinations, none in the list
        pre: self.kind is PlanKind.DENSIFY or (lambda d: all(b not in blocks and b not in d[:i] for i, b in enumerate(d)))(self.dst_blocks if dst_blocks is None else dst_blocks)
        post: contracts.the_sources_leave_and_the_destinations_join(self, blocks, self.dst_blocks if dst_blocks is None else dst_blocks, __return__[0])
        post: contracts.the_cursor_after_commit(self, blocks, write_pos, block_size, *__return__)
        """
        dsts = self.dst_blocks if dst_blocks is None else dst_blocks
        gone = set(self.src_blocks)
        if self.kind is PlanKind.DENSIFY:
            assert self.dense_write_pos is not None
            return [b for b in blocks if b not in gone], self.dense_write_pos
        if self.kind is PlanKind.RELOCATE:
            [src], [dst] = self.src_blocks, dsts
            return [dst if b == src else b for b in blocks], write_pos
        at = min(blocks.index(b) for b in self.src_blocks)
        kept = [b for b in blocks if b not in gone]  # no source precedes ``at``
        new = kept[:at] + list(dsts) + kept[at:]
        return new, self.compact_cursor(write_pos, block_size, dsts)

    def compact_cursor(self, write_pos: int, block_size: int, dst_blocks: tuple[int, ...] | None = None) -> int:
        """A compact plan's append cursor after commit: it shifts by whole blocks, + S per destination kept
        (``dst_blocks``, default all), - S per source (all lie before the cursor's block). ``final_layout``'s
        cursor, and the one the manager's commit sets."""
        dsts = self.dst_blocks if dst_blocks is None else dst_blocks
        return write_pos + (len(dsts) - len(self.src_blocks)) * block_size
