"""The gather read path's compaction on ``FastLayout``'s arrays (issue #46, part 1): the core's compact planner, its
commit and Naive-Evict's release, compiled by numba with ``kernels``' plain ABI.

The core's pieces, one kernel each (``L`` is ``FastLayout.arrays()``, as in ``kernels``):

  compact_candidates   ``TokenTable.compact_candidates``: the first ``max_sources`` eligible sources of a row
  compact_gate         ``compact.choose_ranked``'s gate over those candidates (no layout: plain arrays)
  compact_fill         ``compact.compact_plan``'s fill: the sources' live tokens, in logical order, into the
                       destinations the caller allocated (the pool allocates in Python, between gate and fill)
  commit_compact       ``ReclamationManager._commit`` of a COMPACT or RELEASE plan: the staleness test, the moves
                       whose token died dropped, ``_check_compact_commit``'s checks, then ``splice`` (the kept
                       destinations before the first source), ``apply_moves`` and ``remove_blocks`` (the sources)
  dead_blocks          ``TokenTable.dead_blocks``: what ``plan_release`` (Naive-Evict) releases
  remove_blocks        ``TokenTable.remove_blocks``
  densify_plan         ``densify.plan_densify`` (or ``plan_densify_tail``, the same plan) without its commit: the
                       pressure round's pack (``ReclamationManager.plan_pack``), made now and committed later
  commit_densify       ``ReclamationManager._commit`` of that DENSIFY plan: the staleness test (the layout version and
                       the total length: an append since planning), the moves whose token died dropped,
                       ``_check_densify_commit``'s checks, then ``apply_moves`` and the tail's ``splice``

The dense path never shifts a block before the cursor, so ``kernels`` keeps a live token's position (index in the
block list x S + offset) fixed unless the token moves. Compaction does shift them: the destinations join before the
first source and the sources leave, so every block from the first source's index on may change its index.
``_rewrite_list`` moves those blocks' position rows (``pos_token``) and their tokens' ``tok_pos`` with them: a commit
costs O(moves + S x blocks from the first source on), where the core's is O(moves + sources + destinations) plus a C
copy of its block list (its slots name blocks, not indices).

Every kernel validates before it mutates; a refused call leaves every array as it was (``seen``, the duplicate
checks' scratch, aside). Codes are ``kernels``' where the meaning is the same (OK, PLANNED, TOKEN_OUT_OF_RANGE,
OVER_BLOCKS); the new ones are below, each with the core's answer it stands for.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernels import (ALREADY_DENSE, DENSE_MISMATCH, OK, OVER_BLOCKS, PLANNED, SHARED_BLOCK, TOKEN_OUT_OF_RANGE,
                      _claim, _listed_by, _movers_and_holes, _release)
from .layout import (M_LAYOUT_VERSION, M_NBLOCKS, M_NUM_LIVE, M_RUN_POS, M_RUN_TOKEN, M_TOTAL_LEN, M_WRITE_POS, NO_POS,
                     P_EPOCH)

# NOTE: OK, PLANNED, ALREADY_DENSE, SHARED_BLOCK, DENSE_MISMATCH, TOKEN_OUT_OF_RANGE and OVER_BLOCKS are kernels' codes,
# imported here so that a caller reads every code of these kernels from this module
# ---- the gate's answers (not errors: the core's NoPlan reasons) ---------------------------------------------------
NO_CANDIDATES = 110  # NoPlanReason.NO_CANDIDATES
NOT_ENOUGH_HEADROOM = 111  # a: the budget                               NoPlanReason.NOT_ENOUGH_HEADROOM
NO_STRICT_DECREASE = 112  # a: live tokens, b: sources                    NoPlanReason.NO_STRICT_DECREASE
# ---- the fill's refusal ---------------------------------------------------------------------------------------------
FILL_MISMATCH = 113  # a: live tokens found, b: the gate's count          InvariantViolation("I4") of compact_plan
# ---- commit_compact's answers: STALE is the core's abort; the others its InvariantViolation("I4") ----------------
STALE = 120  # a: the row's layout version, b: the plan's                 abort "layout changed since the snapshot"
SOURCES_NOT_IN_LIST = 121  # a: the first source not listed after the one before it
DST_NOT_FRESH = 122  # a: the destination: outside the pool, listed by this row, or named twice
DST_LISTED = 123  # a: the destination, listed by another row             (check_splice's refusal)
MOVE_SOURCE_MISMATCH = 124  # a: the move (index into the plan's moves)
MOVE_OUTSIDE = 125  # a: the move, b: the staged cursor                   writes outside the staged list, or past it
MOVE_CLAIMED = 126  # a: the move, b: the slot
MOVED_TWICE = 127  # a: the token
CURSOR_OUTSIDE = 128  # a: the cursor, b: blocks in the list it would have
SOURCE_LIVE = 129  # a: the block that would leave with live tokens
LIVE_AFTER_CURSOR = 130  # a: the block, b: the cursor
# ---- remove_blocks' own refusal (its others: CURSOR_OUTSIDE, SOURCE_LIVE, LIVE_AFTER_CURSOR) ---------------------
BAD_INDICES = 131  # the indices are not ascending, distinct indices of the list     BlockListTooShortError
# ---- commit_densify's own answers (its others: STALE, TOKEN_OUT_OF_RANGE, MOVE_*, MOVED_TWICE, CURSOR_OUTSIDE,
# SOURCE_LIVE, LIVE_AFTER_CURSOR, as commit_compact's) ------------------------------------------------------------
APPENDED = 132  # a: the row's total_len, b: the plan's                 abort "layout changed since the snapshot"
SOURCES_NOT_TAIL = 133  # a: ceil(cursor / S), b: sources     its sources are not blocks [a, a + b) of the list


@njit(cache=True, nogil=True)
def _kept_moves(tok_pos, row, moves, total):
    """The commits' first reads: every move's token in [0, ``total``) (the core reads every move's slot first,
    ``slots_of``: the first bad token is refused), then the moves whose token is still live (one evicted in flight is
    dropped, the token stays dead). Returns (OK, 0, the kept moves' indices) or (TOKEN_OUT_OF_RANGE, token, none)."""
    n = moves.shape[0]
    keep = np.empty(n, np.int64)
    for j in range(n):
        if moves[j, 0] < 0 or moves[j, 0] >= total:
            return TOKEN_OUT_OF_RANGE, moves[j, 0], keep[:0]
    m = 0
    for j in range(n):
        if tok_pos[row, moves[j, 0]] != NO_POS:
            keep[m] = j
            m += 1
    return OK, 0, keep[:m]


@njit(cache=True, nogil=True)
def _claimed_or_moved_twice(holders, pool, seen, moves, keep, src_slot, dst_slot, m):
    """The commits' last move checks (``_check_commit_moves``'): no destination holds a token that does not leave it
    in this batch, and no token moves twice. ``keep``: the moves kept (their token live), ``src_slot``/``dst_slot``
    theirs. Changes nothing but ``seen``. Returns (OK, 0, 0), (MOVE_CLAIMED, move, slot) or (MOVED_TWICE, token, 0)."""
    vacated = np.sort(src_slot)
    for j in range(m):
        v = dst_slot[j]
        h = np.int64(holders[v])
        q = np.searchsorted(vacated, v)
        if q < m and vacated[q] == v:
            h -= 1
        if h:
            return MOVE_CLAIMED, keep[j], v
    pool[P_EPOCH] += 1
    epoch = pool[P_EPOCH]
    for j in range(m):  # NOTE: a token named twice reads one slot: the checks above passed both moves
        t = moves[keep[j], 0]
        if seen[t] == epoch:
            return MOVED_TWICE, t, 0
        seen[t] = epoch
    return OK, 0, 0


# ---- compact's planner --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def compact_candidates(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                       live_bits, word_live, group_live, row, max_sources, movable, out_index, out_count):
    """``TokenTable.compact_candidates(req, max_sources, private)`` with ``private(b)`` = ``movable[b] != 0`` (a
    pool-wide flag per block id: the caller's ``_movable`` or ``_private``): the blocks wholly before the cursor's
    block, not full (live count < S) and movable, lowest live count first, then lowest index; the first
    ``max_sources`` of them as (index in the row's list, live count) into ``out_index``/``out_count``. A counting
    sort of the counts, O(blocks + S). Changes nothing. Returns (OK, candidates, 0)."""
    S = holders.shape[0] // block_live.shape[0]
    end = min(meta[row, M_WRITE_POS] // S, meta[row, M_NBLOCKS])
    start = np.zeros(S + 1, np.int64)  # start[c + 1]: eligible blocks of count c, then their prefix sums
    for i in range(end):
        c = counts[row, i]
        if c < S and movable[blocks[row, i]]:
            start[c + 1] += 1
    for c in range(S):
        start[c + 1] += start[c]
    n = min(start[S], max_sources)
    for i in range(end):  # ascending i within each count: the core's tie order (its C search runs up the list)
        c = counts[row, i]
        if c < S and movable[blocks[row, i]]:
            k = start[c]
            start[c] = k + 1
            if k < n:
                out_index[k] = i
                out_count[k] = c
    return OK, n, 0


@njit(cache=True, nogil=True)
def compact_gate(cand_index, cand_count, n, S, budget, out_sources):
    """``choose_ranked``'s gate over the first ``n`` candidates (``compact_candidates``' order): shrink the set,
    fullest (last) first, until its ceil(live / S) destinations fit ``budget``; plan only if that is strictly fewer
    blocks than the sources. On (OK, sources, live) the chosen indices are in ``out_sources`` ascending (the
    ``SourceChoice``'s block-list order) and the destinations are ceil(live / S); else (NO_CANDIDATES, 0, 0),
    (NOT_ENOUGH_HEADROOM, budget, 0) or (NO_STRICT_DECREASE, live, sources)."""
    if n == 0:
        return NO_CANDIDATES, 0, 0
    live = 0
    for j in range(n):
        live += cand_count[j]
    k = n
    while k > 0 and (live + S - 1) // S > budget:
        k -= 1
        live -= cand_count[k]
    if k == 0:
        return NOT_ENOUGH_HEADROOM, budget, 0
    if (live + S - 1) // S >= k:
        return NO_STRICT_DECREASE, live, k
    out_sources[:k] = np.sort(cand_index[:k])
    return OK, k, live


@njit(cache=True, nogil=True)
def round_candidates(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                     live_bits, word_live, group_live, rows, max_sources, movable, out_index, out_count, out_n):
    """``compact_candidates`` of each row of ``rows``: row k's in ``out_index[k]``, ``out_count[k]`` (``out_n[k]``
    of them). A round's candidates in one call. Changes nothing. Returns (OK, 0, 0)."""
    for k in range(rows.shape[0]):
        _, n, _ = compact_candidates(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool,
                                     seen, live_bits, word_live, group_live, rows[k], max_sources, movable,
                                     out_index[k], out_count[k])
        out_n[k] = n
    return OK, 0, 0


@njit(cache=True, nogil=True)
def excess_order(meta, rows, S, out):
    """A compact round's order: the indices k into ``rows`` whose row lists more blocks than ceil(live / S) (its
    excess), most excess first, ties in the given order (a stable sort, as the manager's ``sorted``), into
    ``out``. Returns how many."""
    m = rows.shape[0]
    excess = np.empty(m, np.int64)
    for k in range(m):
        excess[k] = meta[rows[k], M_NBLOCKS] - (meta[rows[k], M_NUM_LIVE] + S - 1) // S
    order = np.argsort(-excess, kind="mergesort")
    n = 0
    for k in order:
        if excess[k] <= 0:
            break
        out[n] = k
        n += 1
    return n


@njit(cache=True, nogil=True)
def round_gates(cand_index, cand_count, cand_n, S, budget, max_plans, out_sources, out):
    """``compact_gate`` of each row's candidates (``round_candidates``' answer) in order, at the budget left by the
    plans before it (each takes its ceil(live / S) destinations), until ``max_plans`` plans: row k's answer in
    ``out[k]`` (code, a, b), its sources in ``out_sources[k]``. Returns how many rows were gated."""
    plans = 0
    for k in range(cand_n.shape[0]):
        if plans >= max_plans:
            return k
        code, a, b = compact_gate(cand_index[k], cand_count[k], cand_n[k], S, budget, out_sources[k])
        out[k, 0], out[k, 1], out[k, 2] = code, a, b
        if code == OK:
            budget -= (b + S - 1) // S
            plans += 1
    return cand_n.shape[0]


@njit(cache=True, nogil=True)
def compact_fill(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                 live_bits, word_live, group_live, row, sources, num_live, dst_blocks, out_moves):
    """``compact_plan``'s fill: the row's live tokens in the blocks at indices ``sources``, in logical order, fill
    ``dst_blocks`` (the ceil(num_live / S) fresh blocks the caller allocated) one after another; ``out_moves[j]`` =
    ``Move``'s five fields (token, source block, offset, destination block, offset). Changes nothing. Returns
    (PLANNED, moves, 0), or (FILL_MISMATCH, found, num_live) when the sources hold another count than the gate's
    (compact_plan's I4)."""
    S = holders.shape[0] // block_live.shape[0]
    found = 0
    for j in range(sources.shape[0]):
        found += counts[row, sources[j]]
    if found != num_live:
        return FILL_MISMATCH, found, num_live
    # NOTE: counts[row, i] is the row's live tokens in block i (T1), so the positions below hold num_live tokens; a
    # recount that disagrees is a table bug, refused as one before anything is written past ``tokens``
    tokens = np.empty(num_live, np.int64)
    m = 0
    for j in range(sources.shape[0]):
        base = sources[j] * S
        for o in range(S):
            t = pos_token[row, base + o]
            if t != NO_POS:
                if m == num_live:
                    return FILL_MISMATCH, m + 1, num_live
                tokens[m] = t
                m += 1
    if m != num_live:
        return FILL_MISMATCH, m, num_live
    tokens = np.sort(tokens)
    for j in range(m):
        t = tokens[j]
        p = tok_pos[row, t]
        out_moves[j, 0] = t
        out_moves[j, 1] = blocks[row, p // S]
        out_moves[j, 2] = p % S
        out_moves[j, 3] = dst_blocks[j // S]
        out_moves[j, 4] = j % S
    return PLANNED, m, 0


# ---- Naive-Evict: the wholly dead private blocks, and their removal -----------------------------------------------
@njit(cache=True, nogil=True)
def dead_blocks(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                live_bits, word_live, group_live, row, private, among, use_among, out):
    """``TokenTable.dead_blocks(req, private, among)``: the blocks wholly before the cursor's block holding none of
    the row's live tokens with ``private[b] != 0``, in list order, into ``out`` (block ids). ``use_among``: only the
    list indices in ``among`` (any ints: repeats and indices outside the list are ignored, as the core's set
    does), O(len(among)); else every index, O(blocks). Changes nothing but ``seen``. Returns (OK, blocks, 0)."""
    S = holders.shape[0] // block_live.shape[0]
    end = min(meta[row, M_WRITE_POS] // S, meta[row, M_NBLOCKS])
    n = 0
    if not use_among:
        for i in range(end):
            if counts[row, i] == 0 and private[blocks[row, i]]:
                out[n] = blocks[row, i]
                n += 1
        return OK, n, 0
    pool[P_EPOCH] += 1
    epoch = pool[P_EPOCH]
    found = np.empty(min(among.shape[0], end), np.int64)
    k = 0
    for j in range(among.shape[0]):
        i = among[j]
        if 0 <= i < end and seen[i] != epoch and counts[row, i] == 0:
            seen[i] = epoch  # NOTE: seen has >= max_positions entries, more than a row's blocks
            found[k] = i
            k += 1
    found = np.sort(found[:k])
    for j in range(k):
        if private[blocks[row, found[j]]]:
            out[n] = blocks[row, found[j]]
            n += 1
    return OK, n, 0


@njit(cache=True, nogil=True)
def _max_live_offset(pos_token, row, i, S):
    """The highest offset of block index i holding a live token of the row, or -1."""
    for o in range(S - 1, -1, -1):
        if pos_token[row, i * S + o] != NO_POS:
            return o
    return -1


@njit(cache=True, nogil=True)
def _rewrite_list(tok_pos, pos_token, blocks, counts, listed, meta, row, at, insert, src_at, S):
    """The block list becomes blocks[:at] + ``insert`` + blocks[at:] without the indices ``src_at`` (ascending, all
    >= at): the inserted blocks join empty and listed, the removed ones are unlisted, and every kept block from ``at``
    on carries its count, its position row and its live tokens' positions to its new index.
    NOTE: the removed blocks hold none of the row's live tokens (checked by the callers), so no position is lost."""
    nb, d, k = meta[row, M_NBLOCKS], insert.shape[0], src_at.shape[0]
    new_nb = nb + d - k
    old_blocks = blocks[row, at:nb].copy()
    old_counts = counts[row, at:nb].copy()
    old_pos = pos_token[row, at * S:nb * S].copy()
    pos_token[row, at * S:max(nb, new_nb) * S] = NO_POS
    for j in range(d):
        blocks[row, at + j] = insert[j]
        counts[row, at + j] = 0
        listed[insert[j]] += 1
    w, s = at + d, 0
    for i in range(at, nb):
        if s < k and src_at[s] == i:
            listed[old_blocks[i - at]] -= 1
            s += 1
            continue
        blocks[row, w] = old_blocks[i - at]
        counts[row, w] = old_counts[i - at]
        for o in range(S):
            t = old_pos[(i - at) * S + o]
            if t != NO_POS:
                pos_token[row, w * S + o] = t
                tok_pos[row, t] = w * S + o
        w += 1
    for i in range(new_nb, nb):
        blocks[row, i] = 0
        counts[row, i] = 0
    meta[row, M_NBLOCKS] = new_nb


@njit(cache=True, nogil=True)
def _check_remove(pos_token, blocks, counts, meta, row, indices, write_pos, S):
    """``TokenTable.check_remove_blocks`` with the row's own masks, in its order."""
    nb = meta[row, M_NBLOCKS]
    k = indices.shape[0]
    for j in range(k):
        if indices[j] < 0 or indices[j] >= nb or j and indices[j] <= indices[j - 1]:
            return BAD_INDICES, j, nb
    for j in range(k):
        if counts[row, indices[j]]:
            return SOURCE_LIVE, blocks[row, indices[j]], 0
    length = nb - k
    if write_pos < 0 or write_pos > length * S:
        return CURSOR_OUTSIDE, write_pos, length
    s = 0
    for kk in range(write_pos // S, length):  # block kk of the list after the removal: index i before it
        i = kk + s
        while s < k and indices[s] <= i:
            s += 1
            i = kk + s
        if _max_live_offset(pos_token, row, i, S) >= max(0, write_pos - kk * S):
            return LIVE_AFTER_CURSOR, blocks[row, i], write_pos
    return OK, 0, 0


@njit(cache=True, nogil=True)
def remove_blocks(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                  live_bits, word_live, group_live, row, indices, write_pos, out_blocks):
    """``TokenTable.remove_blocks(req, indices, write_pos)``: drop the blocks at ``indices`` (ascending, distinct,
    holding no live token of the row) from its list (into ``out_blocks``) and set the cursor (no live token at or
    after it). Returns (OK, removed, 0), or, nothing changed, (BAD_INDICES, j, blocks) (BlockListTooShortError),
    (SOURCE_LIVE, block, 0) (BlockNotOwnedError), (CURSOR_OUTSIDE, cursor, length) (BlockListTooShortError),
    (LIVE_AFTER_CURSOR, block, cursor) (DestinationError)."""
    S = holders.shape[0] // block_live.shape[0]
    code, a, b = _check_remove(pos_token, blocks, counts, meta, row, indices, write_pos, S)
    if code != OK:
        return code, a, b
    k = indices.shape[0]
    for j in range(k):
        out_blocks[j] = blocks[row, indices[j]]
    if k:
        _rewrite_list(tok_pos, pos_token, blocks, counts, listed, meta, row, indices[0], indices[:0], indices, S)
    meta[row, M_WRITE_POS] = write_pos
    meta[row, M_LAYOUT_VERSION] += 1
    meta[row, M_RUN_POS] = write_pos
    meta[row, M_RUN_TOKEN] = meta[row, M_TOTAL_LEN]
    return OK, k, 0


# ---- compact's (and release's) commit -----------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _is_source(src_at, i):
    for s in range(src_at.shape[0]):
        if src_at[s] == i:
            return True
    return False


@njit(cache=True, nogil=True)
def _final_index(src_at, at, d, i):
    """The index in the final list of the block now at index ``i`` (not a source), once ``d`` destinations join at
    ``at`` and the sources ``src_at`` (ascending) leave."""
    if i < at:
        return i
    gone = 0
    while gone < src_at.shape[0] and src_at[gone] <= i:
        gone += 1
    return i + d - gone


@njit(cache=True, nogil=True)
def _old_index(src_at, at, d, f):
    """The index now of the block at index ``f`` >= at + d of the final list (the inverse of ``_final_index``).
    NOTE: f < the final list's length (the caller's loop), so the walk ends before the list does."""
    i, seen_kept, s = at, -1, 0
    while True:
        while s < src_at.shape[0] and src_at[s] < i:
            s += 1
        if not (s < src_at.shape[0] and src_at[s] == i):
            seen_kept += 1
            if at + d + seen_kept == f:
                return i
        i += 1


@njit(cache=True, nogil=True)
def _check_compact_commit(tok_pos, pos_token, blocks, counts, meta, holders, listed, pool, seen, row, src_blocks,
                          dsts, moves, keep, src_at, dst_final, S):
    """``ReclamationManager._check_compact_commit`` on the row, in its order (the copy's settlement and the blocks'
    references are the caller's): the sources listed in ascending order (``src_at`` their indices, written here),
    the kept destinations ``dsts`` fresh, then ``_check_commit_moves`` of the kept moves (``keep``: their indices
    into ``moves``) against the staged list (destinations before the first source), then the final cursor, the
    emptied sources and the blocks from the final cursor on. ``dst_final[j]`` gets kept move j's destination's
    index in the final list (-1: a source's). Returns (OK, final cursor, kept destinations) or a refusal code."""
    nb, pos = meta[row, M_NBLOCKS], meta[row, M_WRITE_POS]
    NB = listed.shape[0]
    k, d, m = src_blocks.shape[0], dsts.shape[0], keep.shape[0]
    for j in range(k):
        b = src_blocks[j]
        i = _listed_by(blocks, meta, row, b) if 0 <= b < NB and listed[b] > 0 else -1
        if i < 0 or j and i <= src_at[j - 1]:
            return SOURCES_NOT_IN_LIST, j, 0
        src_at[j] = i
    if k == 0:  # NOTE: a plan has sources (compact >= 2, release >= 1); the core's commit reads src_at[0]
        return SOURCES_NOT_IN_LIST, 0, 0
    at = src_at[0]
    staged_pos = pos + d * S
    for j in range(d):
        b = dsts[j]
        twice = False
        for i in range(d):
            twice |= i != j and dsts[i] == b
        if b < 0 or b >= NB or twice or listed[b] > 0 and _listed_by(blocks, meta, row, b) >= 0:
            return DST_NOT_FRESH, b, 0
    for j in range(d):  # NOTE: check_splice's scan for live tokens past the staged cursor is T2 before the commit
        if listed[dsts[j]] > 0:
            return DST_LISTED, dsts[j], 0
    # -- the moves: each reads its token's slot, writes a slot of the staged list below its cursor, unclaimed --
    src_slot = np.empty(m, np.int64)
    dst_slot = np.empty(m, np.int64)
    for j in range(m):
        p = tok_pos[row, moves[keep[j], 0]]
        src_slot[j] = blocks[row, p // S] * S + p % S
        dst_slot[j] = moves[keep[j], 3] * S + moves[keep[j], 4]
    order = np.argsort(dst_slot, kind="mergesort")
    first_dup = m
    for j in range(1, m):
        if dst_slot[order[j]] == dst_slot[order[j - 1]]:
            first_dup = min(first_dup, order[j])  # stable: the later of two equal slots in the plan's order
    for j in range(m):
        mv = moves[keep[j]]
        if not (0 <= mv[2] < S) or mv[1] * S + mv[2] != src_slot[j]:
            return MOVE_SOURCE_MISMATCH, keep[j], 0
        b, off = mv[3], mv[4]
        jd = -1
        for q in range(d):
            if dsts[q] == b:
                jd = q
        i = -1
        if jd < 0 and 0 <= b < NB and listed[b] > 0:
            i = _listed_by(blocks, meta, row, b)
        staged = at + jd if jd >= 0 else (i + d if i >= at else i)
        # NOTE: an offset outside [0, S) is refused here; the core's check passes one whose staged position is
        # below the cursor, and its apply_moves then refuses it after the splice (a commit stopped half-way)
        if staged < 0 or not (0 <= off < S) or staged * S + off >= staged_pos:
            return MOVE_OUTSIDE, keep[j], staged_pos
        if j == first_dup:
            return MOVE_CLAIMED, keep[j], dst_slot[j]
        dst_final[j] = at + jd if jd >= 0 else (-1 if _is_source(src_at, i) else _final_index(src_at, at, d, i))
    code, a, b = _claimed_or_moved_twice(holders, pool, seen, moves, keep, src_slot, dst_slot, m)
    if code != OK:
        return code, a, b
    epoch = pool[P_EPOCH]  # NOTE: the moving tokens' mark in ``seen``, read below
    # -- the final layout: the cursor, the sources emptied, nothing live at or after the cursor --
    length = nb + d - k
    final_pos = pos + (d - k) * S
    if final_pos < 0 or final_pos > length * S:
        return CURSOR_OUTSIDE, final_pos, length
    for j in range(k):  # a source's live tokens after the moves: its count, less the moves out, plus the moves in
        b = blocks[row, src_at[j]]
        live = counts[row, src_at[j]]
        for q in range(m):
            if moves[keep[q], 3] == b:
                live += 1
            if src_slot[q] // S == b:
                live -= 1
        if live:
            return SOURCE_LIVE, src_blocks[j], 0
    for f in range(final_pos // S, length):  # the final list from the cursor's block on (usually 1 or 2 blocks)
        lo = max(0, final_pos - f * S)
        if at <= f < at + d:
            b = dsts[f - at]
        else:
            i = f if f < at else _old_index(src_at, at, d, f)
            b = blocks[row, i]
            for o in range(lo, S):  # its live tokens that stay (a moving token's seen is this epoch)
                t = pos_token[row, i * S + o]
                if t != NO_POS and seen[t] != epoch:
                    return LIVE_AFTER_CURSOR, b, final_pos
        for q in range(m):
            if dst_final[q] == f and moves[keep[q], 4] >= lo:
                return LIVE_AFTER_CURSOR, b, final_pos
    return OK, final_pos, d


@njit(cache=True, nogil=True)
def commit_compact(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                   live_bits, word_live, group_live, row, version, src_blocks, dst_blocks, moves, apply,
                   out_released):
    """``ReclamationManager._commit`` of a COMPACT plan (or a RELEASE: no moves, no destinations) planned at layout
    version ``version``, ``moves`` its m x 5 ``Move`` fields: refused as STALE when the row's version moved (the
    core aborts: the caller frees every destination); the moves whose token died since planning are dropped, and
    only the destinations still receiving a token are kept (``Plan.kept_destinations``); then the checks of
    ``_check_compact_commit`` and, with ``apply``, the commit: the kept destinations join before the first source
    (``splice``), the moves are made (``apply_moves``), the sources leave (``remove_blocks``), the cursor shifts by
    whole blocks (``Plan.compact_cursor``) and the layout version counts each of the three calls that changes
    something, as the core's do. ``out_released``: the blocks the caller frees, the sources then the unused
    destinations, in the plan's order. Returns (OK, blocks to free, kept destinations), or a code and nothing
    changed: (STALE, version now, plan's), (TOKEN_OUT_OF_RANGE, token, total_len), ``_check_compact_commit``'s,
    or (OVER_BLOCKS, blocks, capacity) when the final list outgrows the row."""
    S = holders.shape[0] // block_live.shape[0]
    if meta[row, M_LAYOUT_VERSION] != version:
        return STALE, meta[row, M_LAYOUT_VERSION], version
    total = meta[row, M_TOTAL_LEN]
    code, a, keep = _kept_moves(tok_pos, row, moves, total)
    if code != OK:
        return code, a, total
    m = keep.shape[0]
    nd = dst_blocks.shape[0]
    kept = np.zeros(nd, np.bool_)
    d = 0
    for i in range(nd):
        for j in range(m):
            if moves[keep[j], 3] == dst_blocks[i]:
                kept[i] = True
                d += 1
                break
    dsts = np.empty(d, np.int64)
    w = 0
    for i in range(nd):
        if kept[i]:
            dsts[w] = dst_blocks[i]
            w += 1
    src_at = np.empty(src_blocks.shape[0], np.int64)
    dst_final = np.empty(m, np.int64)
    code, final_pos, _ = _check_compact_commit(tok_pos, pos_token, blocks, counts, meta, holders, listed, pool, seen,
                                               row, src_blocks, dsts, moves, keep, src_at, dst_final, S)
    if code != OK:
        return code, final_pos, _
    k = src_blocks.shape[0]
    if meta[row, M_NBLOCKS] + d - k > blocks.shape[1]:
        return OVER_BLOCKS, meta[row, M_NBLOCKS] + d - k, blocks.shape[1]
    w = 0
    for j in range(k):
        out_released[w] = src_blocks[j]
        w += 1
    for i in range(nd):
        if not kept[i]:
            out_released[w] = dst_blocks[i]
            w += 1
    if not apply:
        return OK, w, d
    # -- checked; mutate: the moves' sources vacated, the list rewritten, the destinations claimed --
    for j in range(m):
        t = moves[keep[j], 0]
        q = tok_pos[row, t]
        pos_token[row, q] = NO_POS
        counts[row, q // S] -= 1
        _release(holders, block_live, pool, blocks[row, q // S] * S + q % S, S)
    _rewrite_list(tok_pos, pos_token, blocks, counts, listed, meta, row, src_at[0], dsts, src_at, S)
    for j in range(m):
        mv = moves[keep[j]]
        p = dst_final[j] * S + mv[4]
        pos_token[row, p] = mv[0]
        tok_pos[row, mv[0]] = p
        counts[row, dst_final[j]] += 1
        _claim(holders, block_live, pool, mv[3] * S + mv[4], S)
    meta[row, M_WRITE_POS] = final_pos
    meta[row, M_LAYOUT_VERSION] += (1 if d else 0) + (1 if m else 0) + 1  # splice, apply_moves, remove_blocks
    meta[row, M_RUN_POS] = final_pos
    meta[row, M_RUN_TOKEN] = total
    return OK, w, d

# ---- densify's plan and its deferred commit: the pressure round's pack ------------------------------------------
# NOTE: ``kernels.densify`` plans and commits in one call (the dense path's); ``densify_plan`` shares its search
# (``_movers_and_holes``) and differs in what it writes: ``Move``'s five fields, and every shared block touched (the
# core's NoPlan names them all), from the pool's references (``shared``: the core's ``_shared_blocks``) where
# ``kernels.densify`` reads the listings
@njit(cache=True, nogil=True)
def densify_plan(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                 live_bits, word_live, group_live, row, evicted, shared, out_moves, out_released, out_shared):
    """``plan_densify`` of the row, committing nothing: the live tokens at positions [n_live, cursor), in logical
    order, into the holes below n_live, ascending (``out_moves[j]``: ``Move``'s five fields); the blocks
    [ceil(n_live / S), ceil(cursor / S)) of the list are released at commit (``out_released``) and the cursor becomes
    n_live. ``evicted``: where the step's evictions were; when they are every dead position before the cursor
    (cursor - n_live distinct holes) the holes are read from them, O(evicted) (``plan_densify_tail``'s search, the same
    plan), else by a scan below n_live. ``shared[b] != 0``: block b has another reference (the pool's count > 1): no
    such block may hold a hole or a mover, be released, or hold position n_live inside it (the cursor's block).
    ``out_moves`` holds cursor - n_live rows, ``out_released`` and ``out_shared`` the row's blocks. Changes nothing.
    Returns (PLANNED, moves, released), (ALREADY_DENSE, 0, 0), (SHARED_BLOCK, blocks, first) with the shared blocks
    touched ascending in ``out_shared``, or (DENSE_MISMATCH, movers, holes): a table bug (I7)."""
    S = holders.shape[0] // block_live.shape[0]
    n, pos, nb = meta[row, M_NUM_LIVE], meta[row, M_WRITE_POS], meta[row, M_NBLOCKS]
    if pos == n:  # no dead position before the cursor (live tokens lie at distinct positions below it, T2)
        return ALREADY_DENSE, 0, 0
    movers, holes, h = _movers_and_holes(pos_token, row, n, pos, evicted)
    m = movers.shape[0]
    if h != m:
        return DENSE_MISMATCH, m, h
    keep, written = -(-n // S), -(-pos // S)
    # every block the plan touches: the holes', the movers', the released, the new cursor's (its tail is rewritten)
    touched = np.empty(2 * m + written - keep + 1, np.int64)
    c = 0
    for j in range(m):
        touched[c] = blocks[row, holes[j] // S]
        touched[c + 1] = blocks[row, tok_pos[row, movers[j]] // S]
        c += 2
    for i in range(keep, written):
        touched[c] = blocks[row, i]
        c += 1
    if n % S and n // S < nb:
        touched[c] = blocks[row, n // S]
        c += 1
    k = 0
    for j in range(c):
        if shared[touched[j]]:
            touched[k] = touched[j]
            k += 1
    if k:
        both = np.sort(touched[:k])
        w = 0
        for j in range(k):
            if j == 0 or both[j] != both[j - 1]:
                out_shared[w] = both[j]
                w += 1
        return SHARED_BLOCK, w, out_shared[0]
    for j in range(m):
        t, q, p = movers[j], tok_pos[row, movers[j]], holes[j]
        out_moves[j, 0] = t
        out_moves[j, 1] = blocks[row, q // S]
        out_moves[j, 2] = q % S
        out_moves[j, 3] = blocks[row, p // S]
        out_moves[j, 4] = p % S
    for i in range(keep, written):
        out_released[i - keep] = blocks[row, i]
    return PLANNED, m, written - keep


@njit(cache=True, nogil=True)
def _live_after(pos_token, seen, epoch, landing, row, p):
    """Whether position p of the row holds a live token once the checked moves are made: a token there that does not
    move (a moving token's ``seen`` is ``epoch``), or a move landing there (``landing``: their positions, sorted)."""
    t = pos_token[row, p]
    if t != NO_POS and seen[t] != epoch:
        return True
    q = np.searchsorted(landing, p)
    return q < landing.shape[0] and landing[q] == p


@njit(cache=True, nogil=True)
def commit_densify(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                   live_bits, word_live, group_live, row, version, total_len, src_blocks, moves, cursor, apply,
                   out_released):
    """``ReclamationManager._commit`` of a DENSIFY plan planned at (``version``, ``total_len``) with its ``moves``
    (m x 5 ``Move`` fields), released blocks ``src_blocks`` and cursor ``cursor`` (its ``dense_write_pos``): refused
    as STALE when the row's layout version moved, APPENDED when its total length did (``is_stale``: the core aborts;
    nothing is written but holes); the moves whose token died since planning are dropped; then
    ``_check_densify_commit``'s checks in its order: each kept move reads its token's slot, writes a slot of the list
    below the row's cursor, unclaimed once the moves' sources are vacated, no token twice; the cursor within the list
    less the sources; the sources are blocks [ceil(cursor / S), + sources) of the list; once the moves are made they
    hold no live token and no block from the cursor's on holds one at or after it (``check_splice``). With ``apply``:
    the moves (``apply_moves``), the sources spliced out (``splice``), the cursor set, the layout version counting
    each of the two calls that changes something as the core's do. The pool's references of the released blocks are
    the caller's to check between a pass without ``apply`` and one with. ``out_released``: the sources. Returns (OK,
    kept moves, released), or a code and nothing changed: (STALE, version now, plan's), (APPENDED, total_len now,
    plan's), (TOKEN_OUT_OF_RANGE, token, total_len), (MOVE_SOURCE_MISMATCH, move, 0), (MOVE_OUTSIDE, move, cursor
    now), (MOVE_CLAIMED, move, slot), (MOVED_TWICE, token, 0), (CURSOR_OUTSIDE, cursor, blocks it would have),
    (SOURCES_NOT_TAIL, ceil(cursor / S), sources), (SOURCE_LIVE, block, 0), (LIVE_AFTER_CURSOR, block, cursor).
    O(blocks + moves log moves + S x blocks from the cursor's on); the core's is O(moves + released blocks)."""
    S = holders.shape[0] // block_live.shape[0]
    if meta[row, M_LAYOUT_VERSION] != version:
        return STALE, meta[row, M_LAYOUT_VERSION], version
    total = meta[row, M_TOTAL_LEN]
    if total != total_len:
        return APPENDED, total, total_len
    code, a, keep = _kept_moves(tok_pos, row, moves, total)
    if code != OK:
        return code, a, total
    m = keep.shape[0]
    nb, pos = meta[row, M_NBLOCKS], meta[row, M_WRITE_POS]
    NB = listed.shape[0]
    # -- the moves (``_check_commit_moves`` against the list as it is, below the row's cursor) --
    pool[P_EPOCH] += 1
    epoch = pool[P_EPOCH]
    index = np.empty(NB, np.int64)  # each listed block's index (``index_in_list``), valid where seen is this epoch
    for i in range(nb):
        seen[blocks[row, i]] = epoch
        index[blocks[row, i]] = i
    src_slot = np.empty(m, np.int64)
    dst_slot = np.empty(m, np.int64)
    dst_idx = np.empty(m, np.int64)
    for j in range(m):
        mv = moves[keep[j]]
        p = tok_pos[row, mv[0]]
        src_slot[j] = blocks[row, p // S] * S + p % S
        dst_slot[j] = mv[3] * S + mv[4]
        b = mv[3]
        dst_idx[j] = index[b] if 0 <= b < NB and seen[b] == epoch else -1
    order = np.argsort(dst_slot, kind="mergesort")
    first_dup = m
    for j in range(1, m):
        if dst_slot[order[j]] == dst_slot[order[j - 1]]:
            first_dup = min(first_dup, order[j])  # stable: the later of two equal slots in the plan's order
    landing = np.empty(m, np.int64)
    for j in range(m):
        mv = moves[keep[j]]
        if not (0 <= mv[2] < S) or mv[1] * S + mv[2] != src_slot[j]:
            return MOVE_SOURCE_MISMATCH, keep[j], 0
        if dst_idx[j] < 0 or not (0 <= mv[4] < S) or dst_idx[j] * S + mv[4] >= pos:
            return MOVE_OUTSIDE, keep[j], pos
        if j == first_dup:
            return MOVE_CLAIMED, keep[j], dst_slot[j]
        landing[j] = dst_idx[j] * S + mv[4]
    code, a, b = _claimed_or_moved_twice(holders, pool, seen, moves, keep, src_slot, dst_slot, m)
    if code != OK:
        return code, a, b
    epoch = pool[P_EPOCH]  # NOTE: the moving tokens' mark in ``seen``, read below
    # -- the splice of the tail: [at, at + k) leaves, the cursor becomes ``cursor`` (``check_splice``) --
    k = src_blocks.shape[0]
    length = nb - k
    if cursor < 0 or cursor > length * S:
        return CURSOR_OUTSIDE, cursor, length
    at = -(-cursor // S)
    for j in range(k):  # NOTE: at + j < nb: at <= length = nb - k (the cursor's check)
        if blocks[row, at + j] != src_blocks[j]:
            return SOURCES_NOT_TAIL, at, k
    landing = np.sort(landing)
    for j in range(k):
        i = at + j
        for o in range(S):
            if _live_after(pos_token, seen, epoch, landing, row, i * S + o):
                return SOURCE_LIVE, blocks[row, i], 0
    for f in range(cursor // S, length):  # block f of the list after the splice: index f, or f + k past the sources
        i = f if f < at else f + k
        for o in range(max(0, cursor - f * S), S):
            if _live_after(pos_token, seen, epoch, landing, row, i * S + o):
                return LIVE_AFTER_CURSOR, blocks[row, i], cursor
    for j in range(k):
        out_released[j] = src_blocks[j]
    if not apply:
        return OK, m, k
    # -- checked; mutate: the moves' sources vacated, their destinations claimed, the tail spliced out --
    for j in range(m):
        q = tok_pos[row, moves[keep[j], 0]]
        pos_token[row, q] = NO_POS
        counts[row, q // S] -= 1
        _release(holders, block_live, pool, src_slot[j], S)
    for j in range(m):
        t, p = moves[keep[j], 0], dst_idx[j] * S + moves[keep[j], 4]
        pos_token[row, p] = t
        tok_pos[row, t] = p
        counts[row, dst_idx[j]] += 1
        _claim(holders, block_live, pool, dst_slot[j], S)
    if k:
        gone = np.arange(at, at + k).astype(np.int64)
        _rewrite_list(tok_pos, pos_token, blocks, counts, listed, meta, row, at, gone[:0], gone, S)
    meta[row, M_WRITE_POS] = cursor
    meta[row, M_LAYOUT_VERSION] += (1 if m else 0) + 1  # apply_moves (when it moves) and the splice
    meta[row, M_RUN_POS] = cursor
    meta[row, M_RUN_TOKEN] = total
    return OK, m, k


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel here on a tiny layout."""
    from . import kernels as K
    from .layout import M_IN_USE, Capacity, FastLayout
    lay = FastLayout(Capacity(rows=1, tokens=12, num_blocks=8, block_size=4))
    L = lay.arrays()
    lay.meta[0, M_IN_USE] = 1
    out = np.empty(16, np.int64)
    assert K.sync(*L, 0, np.array([0, 1, 2, 3], np.int64), 12, out)[0] == OK
    assert K.evict(*L, 0, np.array([0, 1, 2, 5, 6], np.int64), out)[0] == OK
    movable = np.ones(8, np.uint8)
    idx, cnt, src = np.empty(4, np.int64), np.empty(4, np.int64), np.empty(4, np.int64)
    code, n, _ = compact_candidates(*L, 0, 4, movable, idx, cnt)
    code, k, live = compact_gate(idx, cnt, n, 4, 4, src)
    assert excess_order(lay.meta, np.zeros(1, np.int64), 4, out) == 1  # 3 live tokens in 2 blocks
    round_n, gated = np.zeros(1, np.int64), np.zeros((1, 3), np.int64)
    round_candidates(*L, np.zeros(1, np.int64), 4, movable, idx.reshape(1, -1), cnt.reshape(1, -1), round_n)
    assert round_gates(idx.reshape(1, -1), cnt.reshape(1, -1), round_n, 4, 4, 1, src.reshape(1, -1), gated) == 1
    assert gated[0].tolist() == [OK, 2, 3]
    assert code == OK and k == 2 and live == 3
    moves = np.empty((live, 5), np.int64)
    assert compact_fill(*L, 0, src[:k], live, np.array([5], np.int64), moves)[0] == PLANNED
    assert commit_compact(*L, 0, 0, np.array([0, 1], np.int64), np.array([5], np.int64), moves, True, out)[0] == OK
    assert dead_blocks(*L, 0, movable, out[:0], False, out)[0] == OK
    assert remove_blocks(*L, 0, out[:0], lay.meta[0, 1], out)[0] == OK
    assert K.evict(*L, 0, np.array([3], np.int64), out)[0] == OK  # token 3 left a hole below n_live
    fields, shared = np.empty((12, 5), np.int64), np.zeros(8, np.uint8)
    code, m, k = densify_plan(*L, 0, out[:0], shared, fields, out, out.copy())
    assert code == PLANNED
    meta = lay.meta[0]
    assert commit_densify(*L, 0, meta[M_LAYOUT_VERSION], meta[M_TOTAL_LEN], out[:k].copy(), fields[:m].copy(),
                          meta[M_NUM_LIVE], True, out)[0] == OK
