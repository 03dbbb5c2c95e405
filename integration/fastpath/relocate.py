"""``HostMover``: a step's token moves in a KV cache on the CPU, one compiled call per storage group.

The device layer moves tokens with torch: one gather and one scatter per storage group and plane view
(``PagedKVCache.gather`` / ``scatter``), which on the CPU costs tens of microseconds an operation whatever the
number of tokens, about 0.6 ms a step for vLLM's CPU layout of a four-layer model. This kernel does the same wave
in one call per group over the storage's bits: every source token's elements into a buffer, then every
destination's from it (gather before scatter, as the wave does: a copy may read what it also writes, never what an
earlier copy of its wave writes). Bit-exact for every dtype, fp8 included. The torch path stays the reference:
tests/test_fastpath_relocate.py compares the two on every layout, and strict verify's digests (taken from torch's
read of the sources and of the destinations afterwards) check every verified copy the kernel made.

Plain ABI, as ``kernels``: numpy arrays and ints in (``PagedKVCache.host_groups``), nothing allocated per move.
"""

from __future__ import annotations

from array import array

import numpy as np

from vtoken.core.errors import BlockOutOfRangeError

from . import kernels  # noqa: F401, I001  (first: it keeps vLLM's kernel scan working beside numba, its NOTE)
from .moves import PackedCopies  # noqa: I001
from numba import njit  # noqa: E402


@njit(cache=True, nogil=True)
def relocate(flat, offsets, stride, moves, buf):
    """For every move i (row i of ``moves``: token, source block, source offset, destination block, destination
    offset, ``Move``'s fields) and element e: the token's element from its source to its destination, all read,
    then all written. An element of the token at (block b, offset o) is ``flat[offsets[o, e] + b * stride[e]]``."""
    n, E = moves.shape[0], offsets.shape[1]
    for i in range(n):
        b, o = moves[i, 1], moves[i, 2]
        for e in range(E):
            buf[i, e] = flat[offsets[o, e] + b * stride[e]]
    for i in range(n):
        b, o = moves[i, 3], moves[i, 4]
        for e in range(E):
            flat[offsets[o, e] + b * stride[e]] = buf[i, e]


@njit(cache=True, nogil=True)
def first_outside(moves, num_blocks, block_size):
    """The first move whose source or destination lies outside ``num_blocks`` blocks of ``block_size`` slots, or -1."""
    for i in range(moves.shape[0]):
        if not (0 <= moves[i, 1] < num_blocks and 0 <= moves[i, 2] < block_size
                and 0 <= moves[i, 3] < num_blocks and 0 <= moves[i, 4] < block_size):
            return i
    return -1


@njit(cache=True, nogil=True)
def split_waves(moves, starts, num_blocks, block_size, slot_seen, block_written, stamp, ends):
    """``copy_engine.waves`` over a batch's packed moves, checked as ``check_copies``' fast pass checks them: copy i
    is rows ``starts[i]:starts[i + 1]`` of ``moves``. Returns (-1, waves) with each wave's end (a copy index) in
    ``ends[:waves]``, or (the first move outside the cache or writing a slot an earlier move of the batch writes, 0):
    the caller then checks and splits the batch in Python, which names the culprit or allows it.

    ``slot_seen`` [slots] and ``block_written`` [blocks]: scratch stamps, never reset: a slot is seen in this batch
    when it holds ``stamp``, a block written in the current wave when it holds that wave's stamp (``stamp`` + the
    wave's index); the caller passes a ``stamp`` above every one an earlier batch used."""
    waves, first, wave = 0, 0, stamp
    for i in range(starts.shape[0] - 1):
        a, b = starts[i], starts[i + 1]
        for j in range(a, b):
            if not (0 <= moves[j, 1] < num_blocks and 0 <= moves[j, 2] < block_size
                    and 0 <= moves[j, 3] < num_blocks and 0 <= moves[j, 4] < block_size and moves[j, 0] >= 0):
                return j, 0
            slot = moves[j, 3] * block_size + moves[j, 4]
            if slot_seen[slot] == stamp:
                return j, 0
            slot_seen[slot] = stamp
        if i > first:  # a copy that reads or writes a block an earlier copy of the wave writes starts the next
            for j in range(a, b):
                if block_written[moves[j, 1]] == wave or block_written[moves[j, 3]] == wave:
                    ends[waves] = i
                    waves, first, wave = waves + 1, i, wave + 1
                    break
        for j in range(a, b):
            block_written[moves[j, 3]] = wave
    if starts.shape[0] > 1:
        ends[waves] = starts.shape[0] - 1
        waves += 1
    return -1, waves


WIDTHS = (np.uint8, np.int16, np.int32, np.int64)  # a storage group's bits, by element size (``kv_cache._BITS``)


def warm_up(dtypes=WIDTHS) -> None:
    """Compile (or load from numba's cache) ``relocate`` for storages of ``dtypes``, moving nothing: a worker's first
    step must not pay the compile (seconds, cold)."""
    none, one = np.empty((0, 5), np.int64), np.zeros((1, 1), np.int64)
    first_outside(none, 1, 1)
    split_waves(none, np.zeros(1, np.int64), 1, 1, np.zeros(1, np.int64), np.zeros(1, np.int64), 0,
                np.zeros(1, np.int64))
    for dtype in dtypes:
        relocate(np.empty(1, dtype), one, np.zeros(1, np.int64), none, np.empty((0, 1), dtype))


class HostMover:
    """``mover(moves)``: a wave's moves, packed as the device layer packs them (``copy_engine.packed``: an
    ``array('q')`` of five fields per move, or an int64 array of shape [n, 5]), in every group of a CPU cache. Read
    where they lie: no slot tensors are built for a wave nobody verifies. Every move is checked against the cache
    first (the kernel does not check bounds); nothing is written on a refusal."""

    def __init__(self, groups: list[tuple], block_size: int, num_slots: int) -> None:
        self.groups = groups
        self.block_size, self.num_blocks = block_size, num_slots // block_size
        self.calls = 0  # kernel calls: one per group per wave
        self._slot_seen = np.full(self.num_blocks * block_size, -1, np.int64)  # ``split_waves``' stamps
        self._block_written = np.full(self.num_blocks, -1, np.int64)
        self._stamp = 0
        warm_up(sorted({flat.dtype for flat, _, _ in groups}, key=str))  # at the worker's start, not its first copy

    def __call__(self, moves) -> None:
        if moves.__class__ is array and moves.typecode == "q" and len(moves) % 5 == 0:
            moves = np.frombuffer(moves, np.int64).reshape(-1, 5)
        if moves.__class__ is not np.ndarray or moves.dtype != np.int64 or moves.ndim != 2 or moves.shape[1] != 5:
            raise BlockOutOfRangeError(f"a wave's moves are five int64 fields each, got {type(moves).__name__} "
                                       f"{getattr(moves, 'shape', '')}")
        if moves.shape[0] == 0:
            return
        bad = first_outside(moves, self.num_blocks, self.block_size)
        if bad >= 0:
            raise BlockOutOfRangeError(f"move {tuple(moves[bad].tolist())} leaves the KV cache's {self.num_blocks} "
                                       f"blocks of {self.block_size} slots")
        for flat, offsets, stride in self.groups:
            buf = np.empty((moves.shape[0], offsets.shape[1]), flat.dtype)
            relocate(flat, offsets, stride, moves, buf)
            self.calls += 1


    def waves(self, copies) -> list[tuple[int, int, array]] | None:
        """``copy_engine.waves(check_copies(copies, ...))`` for a batch of (moves, request) copies whose moves are
        packed (``MoveArray``, or the whole batch a ``PackedCopies``), in one kernel call (``split_waves``); None where that call cannot decide (a copy not
        packed, a move outside the cache, a slot written twice): the caller's Python checks then name the culprit,
        or allow the batch and split it."""
        if copies.__class__ is PackedCopies:  # a step's copies, packed already
            flat, starts = copies.fields, copies.starts
        else:
            flat, starts = array("q"), array("q", [0])
            for moves, _ in copies:
                fields = getattr(moves, "fields", None)
                if fields.__class__ is not array or fields.typecode != "q":
                    return None
                flat.extend(fields)
                starts.append(len(flat) // 5)
        if not starts[-1]:
            return None
        ends = np.empty(len(copies), np.int64)
        bad, n = split_waves(np.frombuffer(flat, np.int64).reshape(-1, 5), np.frombuffer(starts, np.int64),
                             self.num_blocks, self.block_size, self._slot_seen, self._block_written, self._stamp, ends)
        self._stamp += len(copies) + 1  # above every stamp this batch used (one per wave, at most one per copy)
        if bad >= 0:
            return None
        out, first = [], 0
        for end in ends[:n].tolist():
            out.append((first, end, flat[5 * starts[first]:5 * starts[end]]))
            first = end
        return out


def host_mover(cache) -> HostMover | None:
    """The compiled mover for ``cache`` (a ``PagedKVCache``) if it lives on the CPU, else None (the device layer's
    torch path moves the tokens). Importing this module needs numba: callers ask ``fastpath.unavailable()`` first."""
    groups = cache.host_groups()
    return None if groups is None else HostMover(groups, cache.block_size, cache.num_slots)
