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


WIDTHS = (np.uint8, np.int16, np.int32, np.int64)  # a storage group's bits, by element size (``kv_cache._BITS``)


def warm_up(dtypes=WIDTHS) -> None:
    """Compile (or load from numba's cache) ``relocate`` for storages of ``dtypes``, moving nothing: a worker's first
    step must not pay the compile (seconds, cold)."""
    none, one = np.empty((0, 5), np.int64), np.zeros((1, 1), np.int64)
    first_outside(none, 1, 1)
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


def host_mover(cache) -> HostMover | None:
    """The compiled mover for ``cache`` (a ``PagedKVCache``) if it lives on the CPU, else None (the device layer's
    torch path moves the tokens). Importing this module needs numba: callers ask ``fastpath.unavailable()`` first."""
    groups = cache.host_groups()
    return None if groups is None else HostMover(groups, cache.block_size, cache.num_slots)
