"""The read lists' kernels: the scheduler's per-request change logs, one step's changes taken from them for every
scheduled request at once (``take_reads``), and the workers' patch of their copy of every list (``patch_reads``).

Plain array ABI, as ``kernels``: numpy arrays in, an int code (and the culprit's index and value) out, nothing
changed on a refusal. ``reads.py`` holds the record these kernels fill and read (``StepReads``) and the numpy
reference of the patch.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .layout import M_LAYOUT_VERSION, M_NUM_LIVE, M_TOTAL_LEN, NO_POS
from .reads import (CHECK, EVICTED_MISSING, EVICTED_TWICE, JOINED_ORDER, LIST_ORDER, MOVED_MISSING, NARROW, OK, PATCH,
                    REPLACE, STALE, list_start)


@njit(cache=True, nogil=True)
def log_append(n, log, rows, starts, ids, limit):
    """Append ``ids[starts[k]:starts[k + 1]]`` to row ``rows[k]``'s log (``n[row]`` entries, -1: dropped); a log
    that would hold more than ``limit`` entries is dropped (the core's ``CHANGE_LOG_LIMIT``)."""
    for k in range(rows.shape[0]):
        row = rows[k]
        have, add = n[row], starts[k + 1] - starts[k]
        if have < 0 or add == 0:
            continue
        if have + add > limit:
            n[row] = -1
            continue
        for j in range(add):
            log[row, have + j] = ids[starts[k] + j]
        n[row] = have + add


@njit(cache=True, nogil=True)
def read_sizes(meta, rows, check, ev_n, mv_n, since, joined_from):
    """What ``take_reads`` of ``rows`` may write at most: (evicted ids, moved ids, joined ids, whole lists' ids) over
    all the rows (a rebuilt row, or with ``check`` any row, sends its whole list)."""
    ev = mv = jn = live = 0
    for i in range(rows.shape[0]):
        row = rows[i]
        ev += max(ev_n[row], 0)
        mv += max(mv_n[row], 0)
        jn += max(meta[row, M_TOTAL_LEN] - joined_from[row], 0)
        if check or ev_n[row] < 0 or mv_n[row] < 0 or since[row] == -1:
            live += meta[row, M_NUM_LIVE]
    return ev, mv, jn, live


@njit(cache=True, nogil=True)
def take_reads(tok_pos, blocks, meta, S, rows, check, ev_n, ev_log, mv_n, mv_log, since, joined_from,
               version_out, since_out, whole_out, ev_at, ev_out, mv_at, mv_out, mv_slots, jn_at, jn_out, jn_slots,
               ls_at, ls_ids, ls_slots):
    """``TokenTable.take_changes`` and ``VTokenRuntime.read_changes`` for every row of ``rows`` in order (a row
    named twice answers nothing new the second time, as a second call does), into the flat outputs; with ``check``
    or for a rebuilt row, its whole list too. Each row's log is emptied and its mark moved to now. The outputs must
    hold the logs' entries, the tokens synced since each row's mark and the rows' live tokens (``reads.py`` sizes
    them)."""
    e = m = j = w = 0
    ev_at[0] = mv_at[0] = jn_at[0] = ls_at[0] = 0
    for i in range(rows.shape[0]):
        row = rows[i]
        version, total, jf = meta[row, M_LAYOUT_VERSION], meta[row, M_TOTAL_LEN], joined_from[row]
        rebuilt = ev_n[row] < 0 or mv_n[row] < 0 or since[row] == -1
        version_out[i], since_out[i] = version, since[row]
        whole_out[i] = REPLACE if rebuilt else CHECK if check else PATCH
        if not rebuilt:
            for k in range(ev_n[row]):
                t = ev_log[row, k]
                if t < jf:
                    ev_out[e] = t
                    e += 1
            n = mv_n[row]
            if n:
                moved = np.sort(mv_log[row, :n])
                prev = -1
                for k in range(n):
                    t = moved[k]
                    if t >= jf:
                        break
                    p = tok_pos[row, t]
                    if t != prev and p != NO_POS:
                        mv_out[m], mv_slots[m] = t, blocks[row, p // S] * S + p % S
                        m += 1
                    prev = t
            for t in range(jf, total):
                p = tok_pos[row, t]
                if p != NO_POS:
                    jn_out[j], jn_slots[j] = t, blocks[row, p // S] * S + p % S
                    j += 1
        if whole_out[i] != PATCH:
            for t in range(total):
                p = tok_pos[row, t]
                if p != NO_POS:
                    ls_ids[w], ls_slots[w] = t, blocks[row, p // S] * S + p % S
                    w += 1
        ev_at[i + 1], mv_at[i + 1], jn_at[i + 1], ls_at[i + 1] = e, m, j, w
        ev_n[row] = mv_n[row] = 0
        since[row], joined_from[row] = version, total


@njit(cache=True, nogil=True)
def _find(ids, n, t):
    """Where ``t`` lies in the ascending ``ids[:n]``, or -1."""
    p = np.searchsorted(ids[:n], t)
    return p if p < n and ids[p] == t else -1


_list_start = njit(cache=True, nogil=True)(list_start)  # the one placement rule, compiled


@njit(cache=True, nogil=True)
def batch_rows(t_slots, t_ids, t_start, t_len, rows, pad, out_slots, out_ids):
    """``ReadTable.batch``: row ``rows[i]``'s list into ``out_*[i]``, padded with ``pad`` ids and slot 0."""
    for i in range(rows.shape[0]):
        row, n = rows[i], t_len[rows[i]]
        start = t_start[row]
        out_ids[i, :n], out_slots[i, :n] = t_ids[row, start:start + n], t_slots[row, start:start + n]
        out_ids[i, n:], out_slots[i, n:] = pad, 0


@njit(cache=True, nogil=True)
def patch_reads(t_slots, t_ids, t_start, t_len, t_ver, rows, version, since, whole, ev_at, ev, mv_at, mv, mv_slots,
                jn_at, jn, jn_slots, ls_at, ls_ids, ls_slots, pad, removed, moved_at):
    """The workers' table (``ReadTable``: row ``rows[i]`` holds ``t_len`` slots and ids from column ``t_start``,
    ids ascending, the rest ``pad`` and slot 0) patched by a step's ``StepReads``: a REPLACE row takes its whole list,
    any other must be at version ``since[i]``, its moved ids (found by binary search) take their new slots, its
    evicted ids leave (the positions they held in the list, ascending, into ``removed``), its joined ids are
    appended, and it is at ``version[i]``. Every row is checked before any changes: (OK, 0, 0), or (code, i, the
    culprit) and nothing changed; (NARROW, i, the length) where a row's new list would not fit the table's width
    (``ReadTable`` widens it and asks again).

    NOTE: an eviction closes its gap from the nearer end (``reads.list_start``): the entries before the last evicted
    position move up one per eviction (the list starts later) when they are fewer than those after the first, so
    StreamingLLM's evictions, just past the sinks, move a handful of entries, not the whole list."""
    width, widest, wide_at = t_ids.shape[1], 0, 0
    for i in range(rows.shape[0]):
        row = rows[i]
        if whole[i] == REPLACE:
            for k in range(ls_at[i] + 1, ls_at[i + 1]):
                if ls_ids[k] <= ls_ids[k - 1]:
                    return LIST_ORDER, i, ls_ids[k]
            if ls_at[i + 1] > ls_at[i] and ls_ids[ls_at[i]] < 0:
                return LIST_ORDER, i, ls_ids[ls_at[i]]
            if ls_at[i + 1] - ls_at[i] > widest:
                widest, wide_at = ls_at[i + 1] - ls_at[i], i
            continue
        if t_ver[row] != since[i]:
            return STALE, i, t_ver[row]
        n, ids = t_len[row], t_ids[row, t_start[row]:]
        for k in range(mv_at[i], mv_at[i + 1]):
            moved_at[k] = _find(ids, n, mv[k])
            if moved_at[k] < 0:
                return MOVED_MISSING, i, mv[k]
        a, b = ev_at[i], ev_at[i + 1]
        for k in range(a, b):
            removed[k] = _find(ids, n, ev[k])
            if removed[k] < 0:
                return EVICTED_MISSING, i, ev[k]
        if b - a > 1:  # NOTE: np.sort allocates; a decode step evicts one token a request
            removed[a:b] = np.sort(removed[a:b])
        for k in range(a + 1, b):
            if removed[k] == removed[k - 1]:
                return EVICTED_TWICE, i, ids[removed[k]]
        last, k, p = -1, b - 1, n - 1  # the newest id the row keeps
        while p >= 0 and k >= a and removed[k] == p:
            p -= 1
            k -= 1
        if p >= 0:
            last = ids[p]
        for k in range(jn_at[i], jn_at[i + 1]):
            if jn[k] <= last:
                return JOINED_ORDER, i, jn[k]
            last = jn[k]
        if n - (b - a) + jn_at[i + 1] - jn_at[i] > widest:
            widest, wide_at = n - (b - a) + jn_at[i + 1] - jn_at[i], i
    if widest > width:
        return NARROW, wide_at, widest
    for i in range(rows.shape[0]):
        row = rows[i]
        start, old = t_start[row], t_len[row]
        ids, slots = t_ids[row], t_slots[row]
        if whole[i] == REPLACE:
            at, n = 0, ls_at[i + 1] - ls_at[i]
            ids[:n] = ls_ids[ls_at[i]:ls_at[i + 1]]
            slots[:n] = ls_slots[ls_at[i]:ls_at[i + 1]]
        else:
            for k in range(mv_at[i], mv_at[i + 1]):
                slots[start + moved_at[k]] = mv_slots[k]
            a, b = ev_at[i], ev_at[i + 1]
            joined = jn_at[i + 1] - jn_at[i]
            kept, at = _list_start(start, old, removed[a] if b > a else 0, removed[b - 1] if b > a else 0, b - a,
                                   joined, width)
            if kept > start:  # the kept runs before each removed position moved up, the last run first
                to = start + removed[b - 1] + 1
                for k in range(b - 1, a - 1, -1):
                    for p in range(start + removed[k] - 1, start + (removed[k - 1] if k > a else -1), -1):
                        to -= 1
                        ids[to], slots[to] = ids[p], slots[p]
            elif b > a:  # the kept runs after each removed position moved down, the first run first
                to = start + removed[a]
                for k in range(a, b):
                    end = start + (removed[k + 1] if k + 1 < b else old)
                    for p in range(start + removed[k] + 1, end):
                        ids[to], slots[to] = ids[p], slots[p]
                        to += 1
            n = old - (b - a)
            if at != kept:  # no room after the list: it moves to the row's start (it fits: NARROW)
                for p in range(n):
                    ids[p], slots[p] = ids[kept + p], slots[kept + p]
            for k in range(jn_at[i], jn_at[i + 1]):
                ids[at + n], slots[at + n] = jn[k], jn_slots[k]
                n += 1
        for p in range(start, start + old):  # the old list's columns the new one does not hold
            if p < at or p >= at + n:
                ids[p], slots[p] = pad, 0
        t_start[row], t_len[row], t_ver[row] = at, n, version[i]
    return OK, 0, 0


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel on tiny arrays."""
    from .layout import META_COLUMNS
    one, z = np.zeros(1, np.int64), np.zeros(2, np.int64)
    ev_n, log = np.zeros(1, np.int64), np.zeros((1, 4), np.int32)
    log_append(ev_n, log, one, np.array([0, 1], np.int64), np.array([3], np.int64), 4)
    meta = np.zeros((1, META_COLUMNS), np.int64)
    tok_pos, blocks, out = np.full((1, 4), NO_POS, np.int32), np.zeros((1, 2), np.int32), np.zeros(8, np.int64)
    read_sizes(meta, one, True, ev_n, ev_n, one, one)
    take_reads(tok_pos, blocks, meta, 2, one, True, ev_n, log, ev_n.copy(), log.copy(), one.copy(), one.copy(),
               out[:1], out[:1], np.zeros(1, np.int8), z, out, z.copy(), out, out, z.copy(), out, out, z.copy(), out,
               out)
    table = np.zeros((1, 4), np.int64)
    assert patch_reads(table, table.copy(), np.zeros(1, np.int64), one.copy(), one.copy(), one, one, one,
                       np.ones(1, np.int8), z, out, z, out, out, z, out, out, z, out, out, 2**63 - 1, out.copy(),
                       out.copy())[0] == OK
    batch_rows(table, table.copy(), np.zeros(1, np.int64), one, one, 2**63 - 1, table.copy(), table.copy())
