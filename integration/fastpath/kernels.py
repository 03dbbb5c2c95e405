"""The fast path's kernels: the core's token-table mutations over ``FastLayout``'s arrays, compiled by numba.

A plain ABI, so that each ports to C mechanically if it ever must: numpy arrays and ints in, an int code and the
culprit out (``(code, a, b)``: ``a``/``b`` name what was wrong, or what was done), outputs written into arrays the
caller passes. No jitclass, no Python objects, no allocation on the hot path beyond small scratch arrays.

Each kernel validates everything before it changes anything, as the core does: a refused call (code != OK) leaves
every array as it was. The codes map one to one onto the core's errors (``table.FastTable`` raises them with the
core's classes); the behaviour of an accepted call is the core's, field for field (tests/test_fastpath_table.py).

``L`` below is ``FastLayout.arrays()``: (tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed,
pool, seen, live_bits, word_live, group_live).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .layout import (M_EMPTIED, M_IN_USE, M_LAST_SYNC_START, M_LAYOUT_VERSION, M_NBLOCKS, M_NUM_LIVE, M_RUN_POS,
                     M_RUN_TOKEN, M_TOTAL_LEN, M_WRITE_POS, NO_POS, P_EPOCH, P_LIVE_SLOTS)


def _keep_vllms_kernel_scan_working() -> None:
    """NOTE: vLLM 0.32 rebinds its Triton kernels when each worker starts by reading ``vars(x).get("kernel")`` of
    every attribute of every loaded module (``vllm.triton_utils.dispatcher._rebind_kernels``). llvmlite's library
    wrapper (``llvmlite.binding.ffi.lib``, loaded with numba) forwards any attribute it lacks to its ``ctypes.CDLL``
    and wraps the answer, ``__dict__`` included, so ``vars()`` of it is no dict and, in a process that imported
    numba, every later vLLM engine fails to start (AttributeError: '_lib_fn_wrapper' object has no attribute
    'get'). Dunder names are not forwarded any more: the wrapper is then slotted, without ``__dict__``, and the scan
    passes it by. llvmlite reads only C symbols through it. tests/test_fastpath_table.py runs the scan after this
    import."""
    from llvmlite.binding import ffi

    wrapper = type(ffi.lib)
    forward = wrapper.__getattr__
    if getattr(forward, "_vtoken", False):
        return

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return forward(self, name)

    __getattr__._vtoken = True
    wrapper.__getattr__ = __getattr__


_keep_vllms_kernel_scan_working()

# ---- codes: OK, or which of the core's refusals (``table.raise_for`` turns each into the core's error) ----------
OK = 0
TOTAL_LEN_BELOW = 1  # a: total_len                                       TokenOutOfRangeError
BLOCK_OUT_OF_RANGE = 2  # a: the block                                    BlockOutOfRangeError
BLOCK_IN_LIST = 3  # a: the block (already listed, or named twice)        BlockNotOwnedError
LIST_TOO_SHORT = 4  # a: new tokens, b: new blocks                         BlockListTooShortError
SHARED_TOO_MANY = 5  # a: the block                                       BlockNotOwnedError
SHARED_UNFILLED_HOLDER = 6  # a: the block, b: the holder's row           BlockNotOwnedError
SHARED_UNFILLED_HERE = 7  # a: the block, b: the holder's row             BlockNotOwnedError
TOKEN_OUT_OF_RANGE = 8  # a: the token                                    TokenOutOfRangeError
ALREADY_EVICTED = 9  # a: the token                                       TokenAlreadyEvictedError
NAMED_TWICE = 10  # a: the token                                          TokenAlreadyEvictedError
OVER_TOKENS = 11  # a: total_len (past the layout's tokens per row)       ConfigError
OVER_BLOCKS = 12  # a: blocks the row would list                          ConfigError
DENSE_MISMATCH = 13  # a: movers, b: holes (a table bug: I7)              InvariantViolation
# sync_step's answers that send the caller to its other path (not errors)
NOT_USUAL = 20  # a total_len below the synced length: the core's checks, item by item, decide
NEED_SPACE = 21  # a: the words ``out`` needs
# densify's answers (not errors)
PLANNED = 100  # a: moves, b: released blocks
ALREADY_DENSE = 101
SHARED_BLOCK = 102  # a: the first shared block the plan would touch


@njit(cache=True, nogil=True)
def _claim(holders, block_live, pool, slot, S):
    h = holders[slot]
    holders[slot] = h + 1
    if h == 0:
        block_live[slot // S] += 1
        pool[P_LIVE_SLOTS] += 1


@njit(cache=True, nogil=True)
def _release(holders, block_live, pool, slot, S):
    h = holders[slot]
    holders[slot] = h - 1
    if h == 1:
        block_live[slot // S] -= 1
        pool[P_LIVE_SLOTS] -= 1


@njit(cache=True, nogil=True)
def _set_live(live_bits, word_live, group_live, row, t):
    w = t >> 6
    live_bits[row, w] |= np.uint64(1) << np.uint64(t & 63)
    word_live[row, w] += 1
    group_live[row, w >> 6] += 1


@njit(cache=True, nogil=True)
def _clear_live(live_bits, word_live, group_live, row, t):
    w = t >> 6
    live_bits[row, w] &= ~(np.uint64(1) << np.uint64(t & 63))
    word_live[row, w] -= 1
    group_live[row, w >> 6] -= 1


@njit(cache=True, nogil=True)
def _lowest_bit(bits):
    """The index of the lowest set bit of a nonzero uint64."""
    low = bits & (~bits + np.uint64(1))
    i = 0
    while low > np.uint64(1):
        low >>= np.uint64(1)
        i += 1
    return i


@njit(cache=True, nogil=True)
def _select(live_bits, word_live, group_live, row, k):
    """The live id of rank k (0-based, ascending), or -1 when fewer than k + 1 are live: O(groups + 64 + 64)."""
    g = 0
    while g < group_live.shape[1] and k >= group_live[row, g]:
        k -= group_live[row, g]
        g += 1
    if g == group_live.shape[1]:
        return -1
    w = g * 64
    while k >= word_live[row, w]:
        k -= word_live[row, w]
        w += 1
    bits = live_bits[row, w]
    for _ in range(k):
        bits &= bits - np.uint64(1)  # drop the lowest set bit
    return w * 64 + _lowest_bit(bits)


@njit(cache=True, nogil=True)
def _next_live(live_bits, row, t):
    """The smallest live id > t, or -1."""
    t += 1
    w = t >> 6
    W = live_bits.shape[1]
    if w >= W:
        return -1
    bits = live_bits[row, w] & ~((np.uint64(1) << np.uint64(t & 63)) - np.uint64(1))
    while bits == np.uint64(0):
        w += 1
        if w == W:
            return -1
        bits = live_bits[row, w]
    return w * 64 + _lowest_bit(bits)


@njit(cache=True, nogil=True)
def _listed_by(blocks, meta, row, b):
    """Index of block b in the row's list, or -1: O(blocks) (only for blocks other rows list, or named again)."""
    for i in range(meta[row, M_NBLOCKS]):
        if blocks[row, i] == b:
            return i
    return -1


@njit(cache=True, nogil=True)
def _check_sync(tok_pos, blocks, meta, block_live, listed, pool, seen, row, new_blocks, total_len, S):
    """Everything ``sync`` refuses, in the core's order, changing nothing but the duplicate check's scratch."""
    num_blocks = block_live.shape[0]
    old_total, pos, nb = meta[row, M_TOTAL_LEN], meta[row, M_WRITE_POS], meta[row, M_NBLOCKS]
    k = new_blocks.shape[0]
    if total_len < old_total:
        return TOTAL_LEN_BELOW, total_len, old_total
    pool[P_EPOCH] += 1
    epoch = pool[P_EPOCH]
    for j in range(k):
        b = new_blocks[j]
        if b < 0 or b >= num_blocks:
            return BLOCK_OUT_OF_RANGE, b, 0
        if seen[b] == epoch or listed[b] > 0 and _listed_by(blocks, meta, row, b) >= 0:
            return BLOCK_IN_LIST, b, 0
        seen[b] = epoch
    n_new = total_len - old_total
    end = pos + n_new
    if end > (nb + k) * S:
        return LIST_TOO_SHORT, n_new, k
    for j in range(k):
        b = new_blocks[j]
        if listed[b] == 0:
            continue
        if listed[b] >= 0xFFFF:
            return SHARED_TOO_MANY, b, listed[b]
        for o in range(meta.shape[0]):
            if o == row or meta[o, M_IN_USE] == 0:
                continue
            i = _listed_by(blocks, meta, o, b)
            if i >= 0 and (i + 1) * S > meta[o, M_WRITE_POS]:
                return SHARED_UNFILLED_HOLDER, b, o
        if (nb + j) * S + S > end:
            for o in range(meta.shape[0]):
                if o != row and meta[o, M_IN_USE] and _listed_by(blocks, meta, o, b) >= 0:
                    return SHARED_UNFILLED_HERE, b, o
    if total_len > tok_pos.shape[1]:
        return OVER_TOKENS, total_len, tok_pos.shape[1]
    if nb + k > blocks.shape[1]:
        return OVER_BLOCKS, nb + k, blocks.shape[1]
    return OK, n_new, k


@njit(cache=True, nogil=True)
def _apply_sync(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, live_bits, word_live,
                group_live, row, new_blocks, total_len, out_slots, S):
    old_total, pos, nb = meta[row, M_TOTAL_LEN], meta[row, M_WRITE_POS], meta[row, M_NBLOCKS]
    k = new_blocks.shape[0]
    for j in range(k):
        b = new_blocks[j]
        blocks[row, nb + j] = b
        counts[row, nb + j] = 0
        listed[b] += 1
    meta[row, M_NBLOCKS] = nb + k
    n_new = total_len - old_total
    for j in range(n_new):
        p = pos + j
        i = p // S
        slot = blocks[row, i] * S + p % S
        t = old_total + j
        tok_pos[row, t] = p
        pos_token[row, p] = t
        counts[row, i] += 1
        _claim(holders, block_live, pool, slot, S)
        _set_live(live_bits, word_live, group_live, row, t)
        out_slots[j] = slot
    meta[row, M_TOTAL_LEN] = total_len
    meta[row, M_WRITE_POS] = pos + n_new
    meta[row, M_NUM_LIVE] += n_new
    meta[row, M_LAST_SYNC_START] = old_total


@njit(cache=True, nogil=True)
def sync(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
         live_bits, word_live, group_live,
         row, new_blocks, total_len, out_slots):
    """``TokenTable.sync_new_tokens``: tokens up to ``total_len`` at the cursor, ``new_blocks`` appended; their
    write slots into ``out_slots[:total_len - synced]``. Returns (code, a, b); (OK, new tokens, new blocks)."""
    S = holders.shape[0] // block_live.shape[0]
    code, a, b = _check_sync(tok_pos, blocks, meta, block_live, listed, pool, seen, row, new_blocks, total_len, S)
    if code == OK:
        _apply_sync(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, live_bits,
                    word_live, group_live, row, new_blocks, total_len, out_slots, S)
    return code, a, b


@njit(cache=True, nogil=True)
def _undo_sync(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, live_bits, word_live,
               group_live, row, saved_meta, S):
    """The inverse of an ``_apply_sync`` of the row: its new tokens (all live) released, its new blocks unlisted, its
    scalars back to ``saved_meta`` (the row's meta before the sync)."""
    for t in range(saved_meta[M_TOTAL_LEN], meta[row, M_TOTAL_LEN]):
        p = tok_pos[row, t]
        _release(holders, block_live, pool, blocks[row, p // S] * S + p % S, S)
        counts[row, p // S] -= 1
        tok_pos[row, t] = NO_POS
        pos_token[row, p] = NO_POS
        _clear_live(live_bits, word_live, group_live, row, t)
    for i in range(saved_meta[M_NBLOCKS], meta[row, M_NBLOCKS]):
        listed[blocks[row, i]] -= 1
        blocks[row, i] = 0
        counts[row, i] = 0
    for c in range(meta.shape[1]):
        meta[row, c] = saved_meta[c]


@njit(cache=True, nogil=True)
def sync_batch(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
               live_bits, word_live, group_live,
               rows, total_lens, block_start, new_blocks, slot_start, out_slots, apply):
    """``sync`` for a step's rows, in order, all or none: row ``rows[i]`` gets ``new_blocks[block_start[i]:
    block_start[i+1]]`` and its write slots go to ``out_slots[slot_start[i]:]`` (the caller sizes ``slot_start`` from
    the new token counts). Each row is checked against the state the rows before it left, as the core's loop of
    ``sync_new_tokens`` does (vLLM hands a later request of one step a prefix-cache hit on blocks an earlier one
    filled in the same step); a refusal undoes the rows already synced. Without ``apply`` every row is checked
    the same way and then undone. Returns (code, the failing index into ``rows`` or -1, a, b)."""
    S = holders.shape[0] // block_live.shape[0]
    n = rows.shape[0]
    saved = np.empty((n, meta.shape[1]), np.int64)
    for i in range(n):
        row = rows[i]
        mine = new_blocks[block_start[i]:block_start[i + 1]]
        code, a, b = _check_sync(tok_pos, blocks, meta, block_live, listed, pool, seen, row, mine, total_lens[i], S)
        if code != OK:
            _undo_sync_batch(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, live_bits,
                             word_live, group_live, rows, saved, i, S)
            return code, i, a, b
        saved[i, :] = meta[row, :]
        _apply_sync(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, live_bits,
                    word_live, group_live, row, mine, total_lens[i], out_slots[slot_start[i]:], S)
    if not apply:
        _undo_sync_batch(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, live_bits,
                         word_live, group_live, rows, saved, n, S)
    return OK, -1, 0, 0


@njit(cache=True, nogil=True)
def sync_step(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
              live_bits, word_live, group_live,
              rows, total_lens, block_start, new_blocks, max_tokens, out, apply):
    """``sync_batch`` for a step, its outputs in one flat record: ``out`` = write slots' starts [n + 1] | write
    slots. The new token counts (each row's ``total_lens[i]``, at most ``max_tokens``, less its synced length) size it
    here. Before anything changes: (NOT_USUAL, i, 0, 0) if row i's total_len is below its synced length,
    (NEED_SPACE, -1, words, 0) if ``out`` is shorter than the record. Else ``sync_batch``'s answer, with b the words
    used when OK."""
    n = rows.shape[0]
    new = 0
    for i in range(n):
        synced = meta[rows[i], M_TOTAL_LEN]
        if total_lens[i] < synced:
            return NOT_USUAL, i, 0, 0
        new += min(total_lens[i], max_tokens) - synced
    used = n + 1 + new
    if used > out.shape[0]:
        return NEED_SPACE, -1, used, 0
    out[0] = 0
    for i in range(n):
        out[i + 1] = out[i] + min(total_lens[i], max_tokens) - meta[rows[i], M_TOTAL_LEN]
    code, i, a, b = sync_batch(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                               live_bits, word_live, group_live, rows, total_lens, block_start, new_blocks, out[:n + 1],
                               out[n + 1:], apply)
    if code != OK:
        return code, i, a, b
    return OK, -1, 0, used


@njit(cache=True, nogil=True)
def bridge_rows(meta, blocks, rows, out):
    """For each of ``rows``: (total_len, blocks listed, the last of them or -1), three words each into ``out``."""
    for i in range(rows.shape[0]):
        row = rows[i]
        nb = meta[row, M_NBLOCKS]
        out[3 * i], out[3 * i + 1], out[3 * i + 2] = meta[row, M_TOTAL_LEN], nb, blocks[row, nb - 1] if nb else -1


@njit(cache=True, nogil=True)
def footprint(meta, S):
    """(blocks listed, ceil(live / S) summed) over the rows in use: ``retained_vs_ideal``."""
    held = ideal = 0
    for row in range(meta.shape[0]):
        if meta[row, M_IN_USE]:
            held += meta[row, M_NBLOCKS]
            ideal += (meta[row, M_NUM_LIVE] + S - 1) // S
    return held, ideal


@njit(cache=True, nogil=True)
def gap_rows(meta, rows, out):
    """For each of ``rows``: total_len - cursor, into ``out``."""
    for i in range(rows.shape[0]):
        out[i] = meta[rows[i], M_TOTAL_LEN] - meta[rows[i], M_WRITE_POS]


@njit(cache=True, nogil=True)
def _undo_sync_batch(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, live_bits,
                     word_live, group_live, rows, saved, k, S):
    """Undo the syncs of ``rows[:k]``, last first."""
    for j in range(k - 1, -1, -1):
        _undo_sync(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, live_bits, word_live,
                   group_live, rows[j], saved[j], S)


@njit(cache=True, nogil=True)
def _check_evict(tok_pos, meta, pool, seen, row, ids):
    total = meta[row, M_TOTAL_LEN]
    k = ids.shape[0]
    for j in range(k):  # the core's order: every id in range first, then liveness, then repeats
        if ids[j] < 0 or ids[j] >= total:
            return TOKEN_OUT_OF_RANGE, ids[j], total
    for j in range(k):
        if tok_pos[row, ids[j]] == NO_POS:
            return ALREADY_EVICTED, ids[j], 0
    pool[P_EPOCH] += 1
    epoch = pool[P_EPOCH]
    for j in range(k):
        t = ids[j]
        if seen[t] == epoch:
            return NAMED_TWICE, t, 0
        seen[t] = epoch
    return OK, k, 0


@njit(cache=True, nogil=True)
def _apply_evict(tok_pos, pos_token, blocks, counts, meta, holders, block_live, pool, live_bits, word_live, group_live,
                 row, ids, out_positions, S):
    k = ids.shape[0]
    for j in range(k):
        t = ids[j]
        p = tok_pos[row, t]
        i = p // S
        counts[row, i] -= 1
        if counts[row, i] == 0:
            meta[row, M_EMPTIED] += 1
        _release(holders, block_live, pool, blocks[row, i] * S + p % S, S)
        tok_pos[row, t] = NO_POS
        pos_token[row, p] = NO_POS
        _clear_live(live_bits, word_live, group_live, row, t)
        out_positions[j] = p
    meta[row, M_NUM_LIVE] -= k


@njit(cache=True, nogil=True)
def evict(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
          live_bits, word_live, group_live,
          row, ids, out_positions):
    """``TokenTable.evict_tokens``: the tokens ``ids`` die, all or none; the position each held into
    ``out_positions`` (in the order given). Returns (code, a, b); (OK, evicted, 0)."""
    S = holders.shape[0] // block_live.shape[0]
    code, a, b = _check_evict(tok_pos, meta, pool, seen, row, ids)
    if code == OK:
        _apply_evict(tok_pos, pos_token, blocks, counts, meta, holders, block_live, pool, live_bits, word_live,
                     group_live, row, ids, out_positions, S)
    return code, a, b


@njit(cache=True, nogil=True)
def evict_batch(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                live_bits, word_live, group_live,
                rows, id_start, ids, out_positions):
    """``evict`` for a step's victims, all or none: row ``rows[i]`` loses ``ids[id_start[i]:id_start[i+1]]``, their
    positions into the same range of ``out_positions``. The rows must be distinct. Returns (code, failing index
    into ``rows`` or -1, a, b)."""
    S = holders.shape[0] // block_live.shape[0]
    n = rows.shape[0]
    for i in range(n):
        code, a, b = _check_evict(tok_pos, meta, pool, seen, rows[i], ids[id_start[i]:id_start[i + 1]])
        if code != OK:
            return code, i, a, b
    for i in range(n):
        _apply_evict(tok_pos, pos_token, blocks, counts, meta, holders, block_live, pool, live_bits, word_live,
                     group_live, rows[i], ids[id_start[i]:id_start[i + 1]], out_positions[id_start[i]:], S)
    return OK, -1, 0, 0


@njit(cache=True, nogil=True)
def _movers_and_holes(pos_token, row, n, pos, evicted):
    """Densify's search (``densify``, and the gather path's ``gather_kernels.densify_plan``): the live tokens at
    positions [n, pos) in logical order (the movers), and the holes below n ascending, as many as movers; read from
    ``evicted`` (the step's evicted positions) when they are every dead position before the cursor (pos - n distinct
    dead positions: O(evicted)), else by a scan below n. Returns (movers, holes, h): h == len(movers) holes found,
    or another count when the table is broken (I7; one more than the movers as soon as there are more)."""
    movers = np.empty(pos - n, np.int64)  # live tokens at positions [n, pos)
    m = 0
    for p in range(n, pos):
        if pos_token[row, p] != NO_POS:
            movers[m] = pos_token[row, p]
            m += 1
    movers = np.sort(movers[:m])
    holes = np.empty(m, np.int64)
    h = 0
    cand = np.sort(evicted)
    given = cand.shape[0] == pos - n  # the step's evictions, if they are every dead position before the cursor
    for j in range(cand.shape[0]):
        if cand[j] < 0 or cand[j] >= pos or pos_token[row, cand[j]] != NO_POS or j and cand[j] == cand[j - 1]:
            given = False
            break
    if given:
        for j in range(cand.shape[0]):
            if cand[j] < n:
                if h == m:
                    return movers, holes, m + 1
                holes[h] = cand[j]
                h += 1
    else:
        for p in range(n):
            if pos_token[row, p] == NO_POS:
                if h == m:
                    return movers, holes, m + 1
                holes[h] = p
                h += 1
    return movers, holes, h


@njit(cache=True, nogil=True)
def densify(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
            live_bits, word_live, group_live,
            row, evicted, out_moves, out_released):
    """``plan_densify`` and its commit at once: the live tokens at positions >= n_live move, in logical order,
    into the holes below n_live, ascending; the emptied tail blocks leave the list (into ``out_released``) and the
    cursor becomes n_live. ``out_moves[m] = (token, source slot, destination slot)``. ``evicted``: this step's
    evicted positions; when they are all the row's holes (cursor - n_live of them) the holes are found among
    them, O(evicted), else by a scan below n_live. Returns (PLANNED, moves, released), (ALREADY_DENSE, 0, 0),
    (SHARED_BLOCK, block, 0): nothing changed, or (DENSE_MISMATCH, movers, holes): a table bug (I7)."""
    S = holders.shape[0] // block_live.shape[0]
    n, pos, nb = meta[row, M_NUM_LIVE], meta[row, M_WRITE_POS], meta[row, M_NBLOCKS]
    if pos == n:  # no dead position before the cursor: nothing moves (plan_densify's ALREADY_DENSE)
        return ALREADY_DENSE, 0, 0
    movers, holes, h = _movers_and_holes(pos_token, row, n, pos, evicted)
    m = movers.shape[0]
    if h != m:
        return DENSE_MISMATCH, m, h
    keep, written = -(-n // S), -(-pos // S)
    # NOTE: plan_densify's SHARED_BLOCK: no block another row lists may be written, read or freed; the new cursor's
    # block counts as written (the next appends overwrite its tail)
    for j in range(m):
        b = blocks[row, holes[j] // S]
        if listed[b] > 1:
            return SHARED_BLOCK, b, 0
        b = blocks[row, tok_pos[row, movers[j]] // S]
        if listed[b] > 1:
            return SHARED_BLOCK, b, 0
    for i in range(keep, written):
        if listed[blocks[row, i]] > 1:
            return SHARED_BLOCK, blocks[row, i], 0
    if n % S and n // S < nb and listed[blocks[row, n // S]] > 1:
        return SHARED_BLOCK, blocks[row, n // S], 0
    # -- planned; commit: the moves (apply_moves), then the tail's splice --
    for j in range(m):
        t, q, p = movers[j], tok_pos[row, movers[j]], holes[j]
        src, dst = blocks[row, q // S] * S + q % S, blocks[row, p // S] * S + p % S
        counts[row, q // S] -= 1
        counts[row, p // S] += 1
        _release(holders, block_live, pool, src, S)
        _claim(holders, block_live, pool, dst, S)
        tok_pos[row, t] = p
        pos_token[row, p] = t
        pos_token[row, q] = NO_POS
        out_moves[j, 0], out_moves[j, 1], out_moves[j, 2] = t, src, dst
    released = written - keep
    for i in range(keep, written):
        b = blocks[row, i]
        out_released[i - keep] = b
        listed[b] -= 1
    for i in range(written, nb):  # blocks past the old cursor's (allocated ahead, empty) move down
        blocks[row, i - released] = blocks[row, i]
        counts[row, i - released] = counts[row, i]
    meta[row, M_NBLOCKS] = nb - released
    meta[row, M_WRITE_POS] = n
    meta[row, M_LAYOUT_VERSION] += (1 if m else 0) + 1  # apply_moves (when it moves) and the splice
    meta[row, M_RUN_POS] = n
    meta[row, M_RUN_TOKEN] = meta[row, M_TOTAL_LEN]
    return PLANNED, m, released


@njit(cache=True, nogil=True)
def densify_batch(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                  live_bits, word_live, group_live,
                  rows, ev_start, evicted, out_moves, move_start, out_released, released_start, status):
    """``densify`` for each of ``rows`` in turn (the dense path's every non-dense request, in the caller's order),
    with ``evicted[ev_start[i]:ev_start[i+1]]`` its step's evicted positions. Row i's moves land in
    ``out_moves[move_start[i]:move_start[i+1]]`` and its released blocks likewise (both ``*_start`` arrays are
    written here, n + 1 entries); ``status[i]`` is its answer (PLANNED, ALREADY_DENSE, SHARED_BLOCK). Returns
    (OK, -1, moves, released), or (DENSE_MISMATCH, index, movers, holes): a table bug (I7), the rows before it
    committed."""
    n = rows.shape[0]
    move_start[0] = 0
    released_start[0] = 0
    for i in range(n):
        code, a, b = densify(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                             live_bits, word_live, group_live, rows[i], evicted[ev_start[i]:ev_start[i + 1]], out_moves[move_start[i]:],
                             out_released[released_start[i]:])
        if code == DENSE_MISMATCH:
            return code, i, a, b
        status[i] = code
        move_start[i + 1] = move_start[i] + (a if code == PLANNED else 0)
        released_start[i + 1] = released_start[i] + (b if code == PLANNED else 0)
    return OK, -1, move_start[n], released_start[n]


@njit(cache=True, nogil=True)
def streaming_victims(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                      live_bits, word_live, group_live, row, sinks, budget, out, protect=True):
    """``StreamingLLM(sinks).select_victims``: the oldest live tokens past the first min(sinks, budget - 1) (the
    attention sinks), outside the newest budget - sinks (the window) and, with ``protect`` (the dense path), outside
    the blocks another request lists (densify cannot fill holes there), as many as the live tokens over ``budget``;
    ascending, into ``out``. Changes nothing. O(groups + 128 + what is read). Returns (OK, count, 0)."""
    S = holders.shape[0] // block_live.shape[0]
    n = meta[row, M_NUM_LIVE]
    excess = n - budget
    if excess <= 0:
        return OK, 0, 0
    nsinks = min(sinks, budget - 1)
    older = n - (budget - nsinks)  # ranks [nsinks, older) may go
    found = 0
    if nsinks >= older:
        return OK, 0, 0
    t = _select(live_bits, word_live, group_live, row, nsinks)
    for _ in range(older - nsinks):
        if not protect or listed[blocks[row, tok_pos[row, t] // S]] <= 1:
            out[found] = t
            found += 1
            if found == excess:
                break
        t = _next_live(live_bits, row, t)
    return OK, found, 0


@njit(cache=True, nogil=True)
def streaming_victims_batch(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                            live_bits, word_live, group_live, rows, sinks, budgets, out_start, out):
    """``streaming_victims`` for each of ``rows`` (``budgets[i]`` its budget); row i's victims land in
    ``out[out_start[i]:out_start[i+1]]`` (written here, n + 1 entries; ``out`` holds at least the rows' live
    tokens over budget). Changes nothing in the table. Returns (OK, -1, victims, 0)."""
    out_start[0] = 0
    for i in range(rows.shape[0]):
        code, k, _ = streaming_victims(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool,
                                       seen, live_bits, word_live, group_live, rows[i], sinks, budgets[i],
                                       out[out_start[i]:])
        out_start[i + 1] = out_start[i] + k
    return OK, -1, out_start[rows.shape[0]], 0


# ---- Random's draw (``core/policies/random_policy.py``: the same 64-bit words) --------------------------------
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


@njit(cache=True, nogil=True)
def _mix(z):
    """SplitMix64's finaliser (``random_policy.mix``)."""
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


@njit(cache=True, nogil=True)
def random_victims(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                   live_bits, word_live, group_live, row, keep_recent, budget, state, out, protect=True):
    """``RandomPolicy(keep_recent).select_victims``: Floyd's algorithm over the counter-based draws of ``state``
    (``random_policy.request_state`` of the row's request) and the row's total length, among the live tokens but
    the newest ``keep_recent`` and, with ``protect`` (the dense path), those of blocks another request lists;
    ascending, into ``out``. Changes nothing but the duplicate check's scratch (``seen``). Returns (OK, count, 0)."""
    S = holders.shape[0] // block_live.shape[0]
    excess = meta[row, M_NUM_LIVE] - budget
    older = meta[row, M_NUM_LIVE] - keep_recent  # ranks [0, older) may go
    if excess <= 0 or older <= 0:
        return OK, 0, 0
    shared = False
    for i in range(meta[row, M_NBLOCKS] if protect else 0):
        if listed[blocks[row, i]] > 1:
            shared = True
            break
    n = older
    if shared:  # the candidates, ascending, without the protected tokens: O(older)
        cand = np.empty(older, np.int64)
        n = 0
        t = _select(live_bits, word_live, group_live, row, 0)
        for _ in range(older):
            if listed[blocks[row, tok_pos[row, t] // S]] <= 1:
                cand[n] = t
                n += 1
            t = _next_live(live_bits, row, t)
    k = min(excess, n)
    if k == 0:
        return OK, 0, 0
    h = _mix(np.uint64(state) ^ np.uint64(meta[row, M_TOTAL_LEN]))
    pool[P_EPOCH] += 1
    epoch = pool[P_EPOCH]
    for c in range(k):  # Floyd: draw j takes t in [0, j], or j itself when t is taken
        j = n - k + c
        t = np.int64((_mix(h + np.uint64(j + 1) * GOLDEN)) % np.uint64(j + 1))
        if seen[t] == epoch:
            t = j
        seen[t] = epoch
        out[c] = t
    picks = np.sort(out[:k])
    if shared:
        for c in range(k):
            out[c] = cand[picks[c]]
    elif k * 64 < n:  # a few picks: each by rank, O(groups + 128)
        for c in range(k):
            out[c] = _select(live_bits, word_live, group_live, row, picks[c])
    else:  # many: one walk over the ranks up to the last pick
        t = _select(live_bits, word_live, group_live, row, 0)
        rank = 0
        for c in range(k):
            while rank < picks[c]:
                t = _next_live(live_bits, row, t)
                rank += 1
            out[c] = t
    return OK, k, 0


STREAMING, RANDOM = 0, 1  # evict_policy_batch's policies


@njit(cache=True, nogil=True)
def evict_policy_batch(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                       live_bits, word_live, group_live, rows, policy, param, budgets, states, protect, victim_start,
                       victims, positions):
    """A built-in policy's eviction step: for each of ``rows``, its victims at ``budgets[i]`` (``policy`` STREAMING:
    ``streaming_victims`` with ``param`` sinks; RANDOM: ``random_victims`` with ``param`` keep_recent and
    ``states[rows[i]]``; ``protect``: the dense path's protected shared blocks), into
    ``victims[victim_start[i]:victim_start[i+1]]``, and their eviction (the positions they held likewise). The
    victims are valid by construction (live, distinct, unprotected): nothing is refused. Returns (OK, -1, victims,
    0)."""
    S = holders.shape[0] // block_live.shape[0]
    victim_start[0] = 0
    for i in range(rows.shape[0]):
        if policy == STREAMING:
            code, k, _ = streaming_victims(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool,
                                           seen, live_bits, word_live, group_live, rows[i], param, budgets[i],
                                           victims[victim_start[i]:], protect)
        else:
            code, k, _ = random_victims(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool,
                                        seen, live_bits, word_live, group_live, rows[i], param, budgets[i],
                                        states[rows[i]], victims[victim_start[i]:], protect)
        victim_start[i + 1] = victim_start[i] + k
        _apply_evict(tok_pos, pos_token, blocks, counts, meta, holders, block_live, pool, live_bits, word_live,
                     group_live, rows[i], victims[victim_start[i]:victim_start[i + 1]],
                     positions[victim_start[i]:], S)
    return OK, -1, victim_start[rows.shape[0]], 0


@njit(cache=True, nogil=True)
def evict_densify_batch(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                        live_bits, word_live, group_live, rows, policy, param, budgets, states, victim_start, victims,
                        positions, out_moves, move_start, out_released, released_start, status):
    """The dense path's ``evict_and_reclaim`` for a built-in policy in one call: ``evict_policy_batch`` of ``rows``
    (shared blocks protected), then ``densify`` of each row with its victims' positions (``densify_batch``'s
    outputs). Returns ``densify_batch``'s answer."""
    evict_policy_batch(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen, live_bits,
                       word_live, group_live, rows, policy, param, budgets, states, True, victim_start, victims,
                       positions)
    return densify_batch(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
                         live_bits, word_live, group_live, rows, victim_start, positions, out_moves, move_start,
                         out_released, released_start, status)


@njit(cache=True, nogil=True)
def due_rows(meta, rows, ratio, fixed, evict_every, out_due, out_rows, out_budgets, out_at, sizes):
    """The runtime's cadence for a step's ``rows`` (each request's row, in the caller's order): row i is due when
    its live tokens exceed its budget by at least ``evict_every`` (the budget ``fixed`` if > 0, else
    max(1, ceil(``ratio`` x total_len)), the core's ``token_budget`` in the same float64 arithmetic). The due ones,
    in order: their index in ``rows`` (``out_due``), row, budget, and (layout version, total_len) before the step
    (``out_at``, two per row). ``sizes`` gets what ``evict_densify_batch`` may write for them at most: victims
    (+1), moves, released blocks (+1). Changes nothing else. Returns the number due."""
    m, victims, moves, released = 0, 1, 0, 1
    for i in range(rows.shape[0]):
        row = rows[i]
        live, total = meta[row, M_NUM_LIVE], meta[row, M_TOTAL_LEN]
        budget = fixed if fixed > 0 else max(1, np.int64(np.ceil(ratio * np.float64(total))))
        if live - budget >= evict_every:
            out_due[m], out_rows[m], out_budgets[m] = i, row, budget
            out_at[2 * m], out_at[2 * m + 1] = meta[row, M_LAYOUT_VERSION], total
            m += 1
            # NOTE: densify_batch's bound: a row moves at most its dead positions after the eviction and releases at
            # most its blocks
            victims += live - budget
            moves += meta[row, M_WRITE_POS] - budget
            released += meta[row, M_NBLOCKS]
    sizes[0], sizes[1], sizes[2] = victims, moves, released
    return m


HEAD = 8  # step_record's header: m, lost, commits, refused, copies, moves, released, victims


@njit(cache=True, nogil=True)
def step_record(meta, admission, due, rows, m, at, status, vstart, victims, moves, move_start, released,
                released_start, S, out):
    """An ``evict_densify_batch`` step's answer as one flat int64 record (``table.EvictStep`` reads it with one
    conversion): for the ``m`` due rows (``rows``, with their (version, total_len) before the step in ``at`` and their
    index among the caller's requests in ``due``), in ``out``, after a ``HEAD`` header (m, rows that lost tokens,
    commits, refusals, copies, moves, released blocks, victims):
    status [m] | commit index [m] (-1: none) | due [m] | lost rows [lost x 3: row, victims' start, end] | victims |
    commits [commits x 8: row, version, total_len, cursor, first move, end move, first released, end released] |
    refused rows | released blocks | copies' rows [copies] | copies' move starts [copies + 1] | moves [5 each].
    The commits are the PLANNED rows in admission order (``admission`` per layout row); their moves follow in that
    order as ``Move``'s five fields (``S``: block size), from the word ``used - 5 x moves`` on. Returns the words
    used, or -1 if ``out`` is too short (nothing written that a caller reads)."""
    n_lost, n_commit, n_refused = 0, 0, 0
    for k in range(m):
        if vstart[k + 1] > vstart[k]:
            n_lost += 1
        if status[k] == PLANNED:
            n_commit += 1
        elif status[k] != ALREADY_DENSE:
            n_refused += 1
    order = np.empty(n_commit, np.int64)  # the PLANNED rows by admission: insertion sort (they come in it, usually)
    c = 0
    for k in range(m):
        if status[k] == PLANNED:
            j = c
            while j > 0 and admission[rows[order[j - 1]]] > admission[rows[k]]:
                order[j] = order[j - 1]
                j -= 1
            order[j] = k
            c += 1
    n_copies = 0
    for j in range(n_commit):
        if move_start[order[j] + 1] > move_start[order[j]]:
            n_copies += 1
    n_moves, n_released = move_start[m], released_start[m]
    used = HEAD + 3 * m + 3 * n_lost + vstart[m] + 8 * n_commit + n_refused + n_released + 2 * n_copies + 1 \
        + 5 * n_moves
    if used > out.shape[0]:
        return -1
    h = out[:HEAD]
    h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7] = m, n_lost, n_commit, n_refused, n_copies, n_moves, n_released, \
        vstart[m]
    w = HEAD
    for k in range(m):
        out[w + k] = status[k]
        out[w + m + k] = -1
        out[w + 2 * m + k] = due[k]
    for j in range(n_commit):
        out[w + m + order[j]] = j
    w += 3 * m
    for k in range(m):
        if vstart[k + 1] > vstart[k]:
            out[w], out[w + 1], out[w + 2] = k, vstart[k], vstart[k + 1]
            w += 3
    for v in range(vstart[m]):
        out[w + v] = victims[v]
    w += vstart[m]
    commits, w = w, w + 8 * n_commit
    for k in range(m):
        if status[k] != PLANNED and status[k] != ALREADY_DENSE:
            out[w] = k
            w += 1
    for r in range(n_released):
        out[w + r] = released[r]
    first_released, w = w, w + n_released
    copy_rows, copy_starts = w, w + n_copies
    fields = copy_starts + n_copies + 1
    out[copy_starts] = 0
    f, c = 0, 0
    for j in range(n_commit):
        k = order[j]
        a, b = move_start[k], move_start[k + 1]
        r = commits + 8 * j
        out[r], out[r + 1], out[r + 2], out[r + 3] = k, at[2 * k], at[2 * k + 1], meta[rows[k], M_WRITE_POS]
        out[r + 4], out[r + 5] = f, f + b - a
        out[r + 6], out[r + 7] = first_released + released_start[k], first_released + released_start[k + 1]
        for i in range(a, b):
            q = fields + 5 * f
            out[q], out[q + 1], out[q + 2] = moves[i, 0], moves[i, 1] // S, moves[i, 1] % S
            out[q + 3], out[q + 4] = moves[i, 2] // S, moves[i, 2] % S
            f += 1
        if b > a:
            out[copy_rows + c] = k
            out[copy_starts + c + 1] = f
            c += 1
    return used


@njit(cache=True, nogil=True)
def clear_row(tok_pos, pos_token, blocks, counts, meta, holders, block_live, listed, pool, seen,
              live_bits, word_live, group_live, row, out_blocks):
    """``TokenTable.remove_request``: the row's live slots released, its blocks unlisted (into ``out_blocks``),
    the row emptied for reuse. Returns (OK, blocks, 0)."""
    S = holders.shape[0] // block_live.shape[0]
    total, nb = meta[row, M_TOTAL_LEN], meta[row, M_NBLOCKS]
    for t in range(total):
        p = tok_pos[row, t]
        if p != NO_POS:
            _release(holders, block_live, pool, blocks[row, p // S] * S + p % S, S)
            tok_pos[row, t] = NO_POS
            pos_token[row, p] = NO_POS
    live_bits[row, :] = 0
    word_live[row, :] = 0
    group_live[row, :] = 0
    for i in range(nb):
        out_blocks[i] = blocks[row, i]
        listed[blocks[row, i]] -= 1
        counts[row, i] = 0
    for c in range(meta.shape[1]):
        meta[row, c] = 0
    return OK, nb, 0


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel on a tiny layout: the first real call pays nothing."""
    from .layout import Capacity, FastLayout
    lay = FastLayout(Capacity(rows=2, tokens=8, num_blocks=4, block_size=4))
    L = lay.arrays()
    lay.meta[0, M_IN_USE] = 1
    out = np.empty(8, np.int64)
    assert sync(*L, 0, np.array([0, 1], np.int64), 6, out)[0] == OK
    assert evict(*L, 0, np.array([1], np.int64), out)[0] == OK
    assert densify(*L, 0, out[:1], np.empty((8, 3), np.int64), out)[0] == PLANNED
    one, two = np.array([0], np.int64), np.array([0, 1], np.int64)
    assert sync_batch(*L, one, np.array([7], np.int64), np.array([0, 0], np.int64), out[:0], two, out, True)[0] == OK
    assert sync_step(*L, one, np.array([7], np.int64), np.array([0, 0], np.int64), out[:0], 8, np.empty(8, np.int64),
                     True)[0] == OK
    bridge_rows(lay.meta, lay.blocks, one, out)
    gap_rows(lay.meta, one, out)
    assert evict_batch(*L, one, two, np.array([6], np.int64), out)[0] == OK
    starts = np.zeros(2, np.int64)
    assert densify_batch(*L, one, two, out[:1], np.empty((8, 3), np.int64), starts, out, starts.copy(),
                         np.empty(1, np.int64))[0] == OK
    assert streaming_victims(*L, 0, 1, 2, out)[0] == OK
    assert streaming_victims_batch(*L, one, 1, np.array([2], np.int64), starts, out)[0] == OK
    states = np.zeros(2, np.uint64)
    assert random_victims(*L, 0, 1, 2, states[0], out)[0] == OK
    for policy in (STREAMING, RANDOM):
        assert evict_policy_batch(*L, one, policy, 1, np.array([2], np.int64), states, False, starts, out,
                                  out.copy())[0] == OK
        assert evict_densify_batch(*L, one, policy, 1, np.array([2], np.int64), states, starts, out, out.copy(),
                                   np.empty((8, 3), np.int64), starts.copy(), out.copy(), starts.copy(),
                                   np.empty(1, np.int64))[0] == OK
    rows, sizes, at = np.array([0], np.int64), np.zeros(3, np.int64), np.zeros(2, np.int64)
    assert due_rows(lay.meta, rows, 0.5, 0, 1, out, out.copy(), out.copy(), at, sizes) == 0
    assert step_record(lay.meta, out, out, rows, 0, at, starts, starts, out, np.empty((1, 3), np.int64), starts, out,
                       starts, 4, np.zeros(HEAD + 1, np.int64)) == HEAD + 1
    assert clear_row(*L, 0, out)[0] == OK
    assert footprint(lay.meta, 4) == (0, 0)  # row 0 cleared: no row in use
