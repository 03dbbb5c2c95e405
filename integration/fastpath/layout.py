"""``FastLayout``: every request's token table as a structure of fixed-capacity arrays (rows = requests).

The core keeps one ``RequestTokens`` object per request (``core/token_table.py``); here a request is a row of
arrays sized once from the engine's limits, as vLLM's block table and SGLang's req_to_token are. The same state,
another shape (names as the core's where they mean the same):

  per row r (a request; ``R`` rows, at most ``T`` tokens, at most ``B`` blocks of ``S`` slots):
    tok_pos[r, t]      the position of token t (index in the block list x S + offset), -1 when evicted or unsynced
    pos_token[r, p]    the live token at position p, -1 for a hole or past the cursor (the inverse of tok_pos)
    blocks[r, i]       the block list; position p lives in blocks[r, p // S] at offset p % S
    counts[r, i]       the row's live tokens in blocks[r, i]
    meta[r, :]         the scalars, indexed by the ``M_*`` constants below
  pool-wide (``NB`` blocks):
    holders[slot]      how many rows hold the slot live (the core's ``SlotOccupancy``)
    block_live[b]      occupied slots of block b (n_b of Eq. 1)
    listed[b]          how many rows list block b (> 1: a shared prefix block)
    pool[:]            the pool's scalars, indexed by ``P_*`` (live slots, the duplicate check's epoch)
    seen[x]            scratch of the duplicate checks (epoch stamps), one entry per token id or block id
  per row, the live ids by rank (the core's ``LiveIndex``): StreamingLLM's k-th live token in O(T / 4096 + 128)
    live_bits[r, w]    bit i of word w: token 64 w + i is live
    word_live[r, w]    live tokens in word w
    group_live[r, g]   live tokens in words [64 g, 64 g + 64)

The core keeps token -> slot; here token -> position, so a slot is read through the block list
(``blocks[p // S] * S + p % S``) and the inverse map needs no pool-wide index: a shared block's offsets are read
from each holder's own ``pos_token``, a private one's likewise. NOTE: the dense path never shifts the blocks
before the cursor (densify only drops tail blocks), so there a live token's position changes only when it is moved;
the gather path's compaction does shift them (its destinations join before the first source, the sources leave), and
its commit rewrites the positions of every block from the first source on (``gather_kernels._rewrite_list``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtoken.core.errors import ConfigError

# meta columns
M_TOTAL_LEN, M_WRITE_POS, M_NUM_LIVE, M_NBLOCKS, M_LAYOUT_VERSION, M_LAST_SYNC_START, M_EMPTIED, M_RUN_POS, \
    M_RUN_TOKEN, M_IN_USE = range(10)
META_COLUMNS = 10
# pool scalars
P_LIVE_SLOTS, P_EPOCH = range(2)
NO_POS = -1


@dataclass(frozen=True)
class Capacity:
    """What the arrays are sized for: requests at once, tokens per request, the pool."""

    rows: int  # vLLM's max_num_seqs
    tokens: int  # per request: vLLM's max_model_len
    num_blocks: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("rows", "tokens", "num_blocks", "block_size"):
            v = getattr(self, name)
            if v.__class__ is not int or v < 1:
                raise ConfigError(f"fast path capacity: {name} must be an int >= 1, got {v!r}")
        if self.num_blocks * self.block_size >= 2**31 or self.rows * self.max_positions >= 2**31:
            raise ConfigError(f"fast path capacity {self} exceeds the arrays' int32 indices")

    @property
    def max_blocks(self) -> int:
        """Blocks one row may list: its tokens' blocks, and one more (vLLM allocates ahead of the cursor)."""
        return -(-self.tokens // self.block_size) + 1

    @property
    def max_positions(self) -> int:
        return self.max_blocks * self.block_size


class FastLayout:
    """The arrays (see the module docstring). Plain numpy: the kernels receive them one by one."""

    def __init__(self, cap: Capacity) -> None:
        self.cap = cap
        R, T, B, P, S = cap.rows, cap.tokens, cap.max_blocks, cap.max_positions, cap.block_size
        self.tok_pos = np.full((R, T), NO_POS, np.int32)
        self.pos_token = np.full((R, P), NO_POS, np.int32)
        self.blocks = np.zeros((R, B), np.int32)
        self.counts = np.zeros((R, B), np.int32)
        self.meta = np.zeros((R, META_COLUMNS), np.int64)
        self.holders = np.zeros(cap.num_blocks * S, np.uint16)
        self.block_live = np.zeros(cap.num_blocks, np.int32)
        self.listed = np.zeros(cap.num_blocks, np.uint16)
        self.pool = np.zeros(2, np.int64)
        self.seen = np.zeros(max(T, P, cap.num_blocks), np.int64)
        W = -(-T // 64)
        self.live_bits = np.zeros((R, W), np.uint64)
        self.word_live = np.zeros((R, W), np.int32)
        self.group_live = np.zeros((R, -(-W // 64)), np.int32)

    def arrays(self) -> tuple:
        """What every kernel takes first, in this order."""
        return (self.tok_pos, self.pos_token, self.blocks, self.counts, self.meta, self.holders, self.block_live,
                self.listed, self.pool, self.seen, self.live_bits, self.word_live, self.group_live)

    def footprint(self) -> dict[str, int]:
        """Bytes of each array and in all: per row, and pool-wide."""
        per = {name: getattr(self, name).nbytes for name in ("tok_pos", "pos_token", "blocks", "counts", "meta",
                                                             "live_bits", "word_live", "group_live")}
        pool = {name: getattr(self, name).nbytes for name in ("holders", "block_live", "listed", "pool", "seen")}
        return {**per, **pool, "per_row": sum(per.values()) // self.cap.rows, "total": sum(per.values()) + sum(pool.values())}
