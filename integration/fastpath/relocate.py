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

import numpy as np

from vtoken.core.errors import BlockOutOfRangeError

from . import kernels  # noqa: F401, I001  (first: it keeps vLLM's kernel scan working beside numba, its NOTE)
from numba import njit  # noqa: E402


@njit(cache=True, nogil=True)
def relocate(flat, offsets, stride, src, dst, block_size, buf):
    """Element e of the token at slot ``src[i]`` to slot ``dst[i]``, for every i and e: all read, then all written.
    An element of the token at (block b, offset o) is ``flat[offsets[o, e] + b * stride[e]]``."""
    n, E = src.shape[0], offsets.shape[1]
    for i in range(n):
        b, o = src[i] // block_size, src[i] % block_size
        for e in range(E):
            buf[i, e] = flat[offsets[o, e] + b * stride[e]]
    for i in range(n):
        b, o = dst[i] // block_size, dst[i] % block_size
        for e in range(E):
            flat[offsets[o, e] + b * stride[e]] = buf[i, e]


WIDTHS = (np.uint8, np.int16, np.int32, np.int64)  # a storage group's bits, by element size (``kv_cache._BITS``)


def warm_up(dtypes=WIDTHS) -> None:
    """Compile (or load from numba's cache) ``relocate`` for storages of ``dtypes``, moving nothing: a worker's first
    step must not pay the compile (seconds, cold)."""
    none, one = np.empty(0, np.int64), np.zeros((1, 1), np.int64)
    for dtype in dtypes:
        relocate(np.empty(1, dtype), one, np.zeros(1, np.int64), none, none, 1, np.empty((0, 1), dtype))


class HostMover:
    """``mover(src, dst)``: the tokens at slots ``src`` (int64 tensors on the CPU) to slots ``dst``, in every group of
    a CPU cache. Slots are checked against the cache first (the kernel does not check bounds); nothing is written
    on a refusal."""

    def __init__(self, groups: list[tuple], block_size: int, num_slots: int) -> None:
        self.groups = groups
        self.block_size, self.num_slots = block_size, num_slots
        self.calls = 0  # kernel calls: one per group per wave
        warm_up(sorted({flat.dtype for flat, _, _ in groups}, key=str))  # at the worker's start, not its first copy

    def __call__(self, src, dst) -> None:
        s, d = src.numpy(), dst.numpy()
        if s.shape != d.shape or s.ndim != 1:
            raise BlockOutOfRangeError(f"a move needs one source slot per destination, got {s.shape} and {d.shape}")
        if s.size == 0:
            return
        lo, hi = min(int(s.min()), int(d.min())), max(int(s.max()), int(d.max()))
        if lo < 0 or hi >= self.num_slots:
            raise BlockOutOfRangeError(f"slot {lo if lo < 0 else hi} outside the KV cache's {self.num_slots} slots")
        for flat, offsets, stride in self.groups:
            buf = np.empty((s.size, offsets.shape[1]), flat.dtype)
            relocate(flat, offsets, stride, s, d, self.block_size, buf)
            self.calls += 1


def host_mover(cache) -> HostMover | None:
    """The compiled mover for ``cache`` (a ``PagedKVCache``) if it lives on the CPU, else None (the device layer's
    torch path moves the tokens). Importing this module needs numba: callers ask ``fastpath.unavailable()`` first."""
    groups = cache.host_groups()
    return None if groups is None else HostMover(groups, cache.block_size, cache.num_slots)
