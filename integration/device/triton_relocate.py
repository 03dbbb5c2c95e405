"""Batched token relocation in a paged KV cache as Triton kernels, with strict verify's digests fused in.

The torch path (``copy_engine.TorchCopyEngine``: ``PagedKVCache.gather`` then ``scatter``) issues one gather and one
scatter per storage group and plane view, and strict verify adds two more passes per group (``Verifier``). On a
GPU a model of 32 layers allocated one tensor per layer is 32 storage groups, so a step's few small copies cost
dozens of launches of microseconds each. Here every storage group of one element width is addressed from a single
base pointer (an element's address is its storage's distance from the base plus its own index), so a wave is
two launches per width: one reads every move's source token into a scratch buffer, one writes them to the
destinations (gather before scatter, as the torch wave: a move may read what another move of its wave writes, a
cycle). When the caller knows no move of a wave reads a slot the wave writes (``disjoint``), one launch reads and
writes directly, without the scratch buffer. This is the device twin of ``fastpath.relocate``'s numba kernel,
over the same addressing (``Group``: element e of the token at (block b, offset o) is
``flat[offsets[o, e] + b * stride[e]]``) and the same storage bits: bit-exact for every dtype, fp8 included.

Strict verify, fused: the source digests are summed from the values as the first launch reads them (no extra
pass over the sources), the destination digests from the destinations read back by the launch that wrote them,
tile by tile right after its writes (a barrier between), so before any later wave can legitimately rewrite a
destination (``copy_engine``'s docstring: the check covers what the copy itself wrote). Both are exactly
``Verifier``'s numbers for the same cache and seed: per token and plane, ``(sum_i w_i x_i) mod P`` over the
element's unsigned bits (8-byte dtypes as two 32-bit words), summed as ``Verifier.digest`` sums it (16-bit halves,
int64, no per-element mod). The read-back uses the writes' own addresses, so it checks what was written there (a
lost or torn write, the wrong token from the scratch buffer), not where: a wrong slot decode or row address is
for the bit-exact tests against the torch path to find. A write by another program of the same wave (two moves
writing one slot, refused on the host) may land after a program's read-back and go unseen.

Programs and tiles: a program handles BLOCK_M moves in PLANES planes (a GPU: one), row chunk by row chunk; a row
is LANES consecutive elements, contiguous and aligned in every storage (``Group.run``), so a GPU loads it as
vectors. On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when they are decorated),
which the tests use; there one program covers a whole small batch, every plane (each op costs the same whatever
its size), and the digest is split per plane by a one-hot sum.

Bad input: moves on the CPU are checked on the host before anything is written (``BlockOutOfRangeError`` names
the first slot outside the cache, ``DestinationError`` a slot written twice in one wave, ``InvalidArgumentError``
a wrong shape, dtype, device or wave list). Moves already on an accelerator are not (that would make the host
wait for the device): there a move with a slot outside the cache moves nothing, and its digests are -1 (source)
and -2 (destination), which never match, so strict verify reports it. ``check_moves`` is the host-side check for
callers that hold the moves on the CPU before uploading them.

CUDA graphs: ``relocate_padded`` takes a move buffer of fixed capacity and the valid count as a 1-element device
tensor; programs past the count do nothing, so one captured graph serves every batch up to the capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vtoken.core.errors import BlockOutOfRangeError, DestinationError, InvalidArgumentError

from .copy_engine import packed, waves
from .kv_cache import _BITS, PagedKVCache
from .verify import PRIME, Digests, Verifier

_PRIME = tl.constexpr(PRIME)
_MAX_LANES = 64  # elements per row at most: 128 bytes of fp16, 16-byte vectors per thread
_TILE_ELEMS = 4096  # elements per program and loop iteration on a GPU (rows per iteration on the CPU too)
_INTERPRETER_BLOCK_M = 32  # moves per program in the interpreter, which runs programs one after another...
_INTERPRETER_PLANES = 64  # ...and planes per program (a GPU program does one plane)
_WORD_MASK = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF, 8: 0xFFFFFFFF}
_SOURCE, _DESTINATION = 0, 1  # the column of a move that a read kernel reads


# ---- kernels ------------------------------------------------------------------------------------------------
@triton.jit
def _decode_slot(slot, BLOCK_SIZE: tl.constexpr):
    """(block, offset in block) of a slot: slot = block * BLOCK_SIZE + offset. The one place slots are decoded
    (tests plant an off-by-one here)."""
    return slot // BLOCK_SIZE, slot % BLOCK_SIZE


@triton.jit
def _row_starts(row_start, row_stride, block, offset, rows, rows_per_token, ok, rows_ok, ALIGN: tl.constexpr):
    """[BLOCK_M, ROWS]: where row r of the token at (block, offset) starts, in elements from the base pointer:
    ``row_start[offset, r] + block * row_stride[r]``."""
    start = tl.load(row_start + offset[:, None] * rows_per_token + rows[None, :], mask=ok, other=0)
    stride = tl.load(row_stride + rows, mask=rows_ok, other=0)
    # NOTE: every row starts at a multiple of ALIGN elements (``_Unit``, asserted when it is built): vector loads
    return tl.multiple_of(start + block[:, None] * stride[None, :], [ALIGN, ALIGN])


@triton.jit
def _plane_sums(x, weights, elem, rows_ok, plane_of, plane_ids, WIDE: tl.constexpr, WORD_MASK: tl.constexpr,
                BLOCK_M: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr, PLANES: tl.constexpr):
    """Per move and plane [BLOCK_M, PLANES]: the sums of w * (low 16 bits) and of w * (high 16 bits) over the tile's
    32-bit words in that plane (``Verifier.digest``'s split: each term < 2^47, so a plane of up to 2^16 words sums
    in int64). ``plane_of``: each row's plane."""
    wmask = rows_ok[None, :, None]
    v = x.to(tl.int64)
    if WIDE:  # 8-byte elements: two words each, low word first (little endian, as ``view(torch.int32)``)
        w_low = tl.load(weights + 2 * elem, mask=wmask, other=0)
        w_high = tl.load(weights + 2 * elem + 1, mask=wmask, other=0)
        low = v & 0xFFFFFFFF
        high = (v >> 32) & 0xFFFFFFFF
        lo = (low & 0xFFFF) * w_low + (high & 0xFFFF) * w_high
        hi = (low >> 16) * w_low + (high >> 16) * w_high
    else:
        w = tl.load(weights + elem, mask=wmask, other=0)
        v = v & WORD_MASK  # the element's bits as unsigned
        lo = (v & 0xFFFF) * w
        hi = (v >> 16) * w
    # NOTE: if / else, not an early return: the compiler visits only the branch PLANES selects
    if PLANES == 1:  # a GPU program: its rows are its plane's
        lo_sums = tl.sum(tl.sum(lo, axis=2), axis=1)[:, None]
        hi_sums = tl.sum(tl.sum(hi, axis=2), axis=1)[:, None]
    else:  # the interpreter: every plane in one program, each element counted in its row's plane, one reduction
        in_plane = (plane_of[:, None] == plane_ids[None, :]).to(tl.int64)[None, :, None, :]  # [1, ROWS, 1, PLANES]
        both = tl.join(lo[:, :, :, None] * in_plane, hi[:, :, :, None] * in_plane)
        lo_sums, hi_sums = tl.split(tl.sum(tl.reshape(both, [BLOCK_M, ROWS * LANES, PLANES, 2]), axis=1))
    return lo_sums, hi_sums


@triton.jit
def _store_digests(digests, acc_lo, acc_hi, m64, plane_ids, num_planes, inside, live, OUTSIDE: tl.constexpr):
    """``digests[move, plane]`` = (lo + 2^16 hi) mod P; OUTSIDE for a move with a slot outside the cache."""
    d = (acc_lo % _PRIME + ((acc_hi % _PRIME) << 16)) % _PRIME
    d = tl.where(inside[:, None], d, OUTSIDE)
    tl.store(digests + (m64[:, None] * num_planes + plane_ids[None, :]), d,
             mask=live[:, None] & (plane_ids < num_planes)[None, :])


@triton.jit
def _read_tokens(flat, row_start, row_stride, planes, row_plane, moves, move_row, move_col, n, count, buf, elems,
                 weights, digests, dst_digests, num_planes, rows_per_token, num_slots,
                 SIDE: tl.constexpr, KEEP: tl.constexpr, DIRECT: tl.constexpr, DIGEST: tl.constexpr,
                 PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr, LANES: tl.constexpr, ALIGN: tl.constexpr,
                 WIDE: tl.constexpr, WORD_MASK: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                 PLANES: tl.constexpr):
    """Planes [PLANES * program_id(1), + PLANES) of the tokens at column SIDE of moves [BLOCK_M * program_id(0),
    + BLOCK_M): read into ``buf`` (KEEP), or straight to the moves' destinations (DIRECT); with DIGEST, digested
    into ``digests[move, plane]`` as read, and (DIRECT) the destinations read back into ``dst_digests``."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    limit = n
    if PADDED:
        limit = tl.load(count)  # NOTE: rows past the count are padding: never read, so never dereferenced
    live = m < limit
    m64 = m.to(tl.int64)
    slot = tl.load(moves + m64 * move_row + SIDE * move_col, mask=live, other=0).to(tl.int64)
    inside = live & (slot >= 0) & (slot < num_slots)
    block, offset = _decode_slot(slot, BLOCK_SIZE)
    if DIRECT:
        dst = tl.load(moves + m64 * move_row + move_col, mask=live, other=0).to(tl.int64)
        inside = inside & (dst >= 0) & (dst < num_slots)
        dst_block, dst_offset = _decode_slot(dst, BLOCK_SIZE)
    plane_ids = tl.program_id(1) * PLANES + tl.arange(0, PLANES)
    first = tl.load(planes + 2 * tl.program_id(1) * PLANES)  # NOTE: planes are consecutive row ranges, in order
    end = tl.load(planes + 2 * tl.minimum(tl.program_id(1) * PLANES + PLANES, num_planes) - 1)
    lanes = tl.arange(0, LANES)
    src_lo = tl.zeros([BLOCK_M, PLANES], dtype=tl.int64)
    src_hi = tl.zeros([BLOCK_M, PLANES], dtype=tl.int64)
    dst_lo = tl.zeros([BLOCK_M, PLANES], dtype=tl.int64)
    dst_hi = tl.zeros([BLOCK_M, PLANES], dtype=tl.int64)
    for r0 in range(first, end, ROWS):
        rows = (r0 + tl.arange(0, ROWS)).to(tl.int64)
        rows_ok = rows < end
        ok = inside[:, None] & rows_ok[None, :]
        at = _row_starts(row_start, row_stride, block, offset, rows, rows_per_token, ok, rows_ok, ALIGN)
        x = tl.load(flat + (at[:, :, None] + lanes[None, None, :]), mask=ok[:, :, None], other=0)
        elem = rows[None, :, None] * LANES + lanes[None, None, :]  # canonical element index in the unit
        if KEEP:
            tl.store(buf + (m64[:, None, None] * elems + elem), x, mask=ok[:, :, None])
        if DIRECT:
            to = _row_starts(row_start, row_stride, dst_block, dst_offset, rows, rows_per_token, ok, rows_ok, ALIGN)
            tl.store(flat + (to[:, :, None] + lanes[None, None, :]), x, mask=ok[:, :, None])
        if DIGEST:
            plane_of = tl.load(row_plane + rows, mask=rows_ok, other=-1)
            lo, hi = _plane_sums(x, weights, elem, rows_ok, plane_of, plane_ids, WIDE, WORD_MASK,
                                 BLOCK_M, ROWS, LANES, PLANES)
            src_lo += lo
            src_hi += hi
            if DIRECT:  # NOTE: the barrier makes every thread's writes of the tile visible to the read-back
                tl.debug_barrier()
                y = tl.load(flat + (to[:, :, None] + lanes[None, None, :]), mask=ok[:, :, None], other=0,
                            volatile=True)
                lo, hi = _plane_sums(y, weights, elem, rows_ok, plane_of, plane_ids, WIDE, WORD_MASK,
                                     BLOCK_M, ROWS, LANES, PLANES)
                dst_lo += lo
                dst_hi += hi
    if DIGEST:  # a slot outside the cache: -1 / -2, never equal (module docstring)
        _store_digests(digests, src_lo, src_hi, m64, plane_ids, num_planes, inside, live, -1 - SIDE)
        if DIRECT:
            _store_digests(dst_digests, dst_lo, dst_hi, m64, plane_ids, num_planes, inside, live, -2)


@triton.jit
def _write_tokens(flat, row_start, row_stride, planes, row_plane, moves, move_row, move_col, n, count, buf, elems,
                  weights, digests, num_planes, rows_per_token, num_slots,
                  DIGEST: tl.constexpr, PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr, LANES: tl.constexpr,
                  ALIGN: tl.constexpr, WIDE: tl.constexpr, WORD_MASK: tl.constexpr, BLOCK_M: tl.constexpr,
                  ROWS: tl.constexpr, PLANES: tl.constexpr):
    """Planes [PLANES * program_id(1), + PLANES) of the tokens in ``buf`` (``_read_tokens`` with KEEP) written to
    the moves' destinations, and with DIGEST read back into ``digests[move, plane]``. A move with either slot
    outside the cache writes nothing."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    limit = n
    if PADDED:
        limit = tl.load(count)
    live = m < limit
    m64 = m.to(tl.int64)
    src = tl.load(moves + m64 * move_row, mask=live, other=0).to(tl.int64)
    dst = tl.load(moves + m64 * move_row + move_col, mask=live, other=0).to(tl.int64)
    inside = live & (src >= 0) & (src < num_slots) & (dst >= 0) & (dst < num_slots)
    block, offset = _decode_slot(dst, BLOCK_SIZE)
    plane_ids = tl.program_id(1) * PLANES + tl.arange(0, PLANES)
    first = tl.load(planes + 2 * tl.program_id(1) * PLANES)
    end = tl.load(planes + 2 * tl.minimum(tl.program_id(1) * PLANES + PLANES, num_planes) - 1)
    lanes = tl.arange(0, LANES)
    acc_lo = tl.zeros([BLOCK_M, PLANES], dtype=tl.int64)
    acc_hi = tl.zeros([BLOCK_M, PLANES], dtype=tl.int64)
    for r0 in range(first, end, ROWS):
        rows = (r0 + tl.arange(0, ROWS)).to(tl.int64)
        rows_ok = rows < end
        ok = inside[:, None] & rows_ok[None, :]
        elem = rows[None, :, None] * LANES + lanes[None, None, :]
        x = tl.load(buf + (m64[:, None, None] * elems + elem), mask=ok[:, :, None], other=0)
        to = _row_starts(row_start, row_stride, block, offset, rows, rows_per_token, ok, rows_ok, ALIGN)
        tl.store(flat + (to[:, :, None] + lanes[None, None, :]), x, mask=ok[:, :, None])
        if DIGEST:  # NOTE: the barrier makes every thread's writes of the tile visible to the read-back
            tl.debug_barrier()
            y = tl.load(flat + (to[:, :, None] + lanes[None, None, :]), mask=ok[:, :, None], other=0, volatile=True)
            plane_of = tl.load(row_plane + rows, mask=rows_ok, other=-1)
            lo, hi = _plane_sums(y, weights, elem, rows_ok, plane_of, plane_ids, WIDE, WORD_MASK,
                                 BLOCK_M, ROWS, LANES, PLANES)
            acc_lo += lo
            acc_hi += hi
    if DIGEST:
        _store_digests(digests, acc_lo, acc_hi, m64, plane_ids, num_planes, inside, live, -2)


# ---- storage units: the groups of one width, from one base pointer -------------------------------------------
@dataclass
class _Unit:
    """Storage groups of one element width, addressed from the lowest-addressed one's storage (``base``): one
    launch moves all of them. Elements in canonical order: the member groups' (``cache.groups`` order), each in
    its own canonical order; rows of ``lanes`` elements; planes are rows [first, end) (``planes``).

    NOTE: the other storages are reached by raw address from the base pointer: right on a GPU and in the
    interpreter on the CPU (which hands the kernels the tensors' own memory), wrong in the interpreter over CUDA
    tensors (which copies each argument's storage to the host)."""

    base: torch.Tensor  # the base storage as its bits
    members: list[int]  # indices into cache.groups
    lanes: int
    align: int  # every row starts at a multiple of this many elements from ``base``
    elems: int
    row_start: torch.Tensor  # int64 [block_size, rows]
    row_stride: torch.Tensor  # int64 [rows]
    planes: torch.Tensor  # int64 [planes, 2]: (first row, end row), consecutive
    row_plane: torch.Tensor  # int32 [rows]: the plane each row belongs to
    columns: list[tuple[int, int, int]]  # (group, first plane, end plane): a group's planes in the unit's
    max_plane_rows: int
    weights: torch.Tensor | None  # int64 words, ``Verifier``'s weights of the members, concatenated

    @property
    def num_planes(self) -> int:
        return self.planes.shape[0]

    @property
    def wide(self) -> bool:
        return self.base.element_size() == 8


def _largest_pow2_dividing(x: int, cap: int) -> int:
    p = 1
    while p < cap and x % (2 * p) == 0:
        p *= 2
    return p


def _units(cache: PagedKVCache, weights: list[torch.Tensor] | None) -> list[_Unit]:
    """The cache's groups by (element width, storage address mod width), each as one ``_Unit``."""
    by_kind: dict[tuple[int, int], list[int]] = {}
    for gi, g in enumerate(cache.groups):
        width = g.flat.element_size()
        by_kind.setdefault((width, g.flat.data_ptr() % width), []).append(gi)
    return [_unit(cache, members, weights) for members in by_kind.values()]


def _unit(cache: PagedKVCache, members: list[int], weights: list[torch.Tensor] | None) -> _Unit:
    groups = [cache.groups[gi] for gi in members]
    width = groups[0].flat.element_size()
    base = min(groups, key=lambda g: g.flat.data_ptr())
    # NOTE: the same residue mod width (``_units``), so every storage lies a whole number of elements from the base
    deltas = [(g.flat.data_ptr() - base.flat.data_ptr()) // width for g in groups]
    sizes = [b - a for g in groups for a, b in g.segments]
    lanes = _largest_pow2_dividing(math.gcd(*(g.run for g in groups), *sizes), _MAX_LANES)
    align = _largest_pow2_dividing(math.gcd(lanes, *deltas), lanes)
    starts, strides, planes, columns, first_elem = [], [], [], [], 0
    for gi, g, delta in zip(members, groups, deltas):
        S, E = g.offsets.shape
        heads = g.offsets[:, ::lanes]
        # NOTE: a row is ``lanes`` consecutive elements in every block: lanes divides the group's run (find_run)
        assert torch.equal(g.offsets.view(S, E // lanes, lanes),
                           heads.unsqueeze(-1) + torch.arange(lanes, device=heads.device)), g.names
        assert torch.equal(g.stride.view(E // lanes, lanes), g.stride[::lanes].unsqueeze(-1).expand(-1, lanes))
        starts.append(heads + delta)
        strides.append(g.stride[::lanes])
        assert [a for a, _ in g.segments] == [0] + [b for _, b in g.segments[:-1]] and g.segments[-1][1] == E
        columns.append((gi, len(planes), len(planes) + len(g.segments)))
        planes += [((first_elem + a) // lanes, (first_elem + b) // lanes) for a, b in g.segments]
        first_elem += E
    row_start, row_stride = torch.cat(starts, 1).contiguous(), torch.cat(strides).contiguous()
    assert bool((row_start % align == 0).all()) and bool((row_stride % align == 0).all())
    unit_weights = None
    if weights is not None:
        unit_weights = torch.cat([weights[gi] for gi in members]).to(torch.int64).contiguous()
    row_plane = torch.cat([torch.full((b - a,), p, dtype=torch.int32) for p, (a, b) in enumerate(planes)])
    return _Unit(base.flat.view(_BITS[width]), members, lanes, align, first_elem, row_start, row_stride,
                 torch.tensor(planes, dtype=torch.int64, device=cache.device), row_plane.to(cache.device), columns,
                 max(b - a for a, b in planes), unit_weights)


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


# ---- waves and moves on the host ------------------------------------------------------------------------------
def copy_moves(copies, block_size: int) -> tuple[torch.Tensor, list[int]]:
    """A batch of (moves, request) copies (``Move``s or packed moves) as one int64 tensor [n, 2] of (source slot,
    destination slot) on the CPU, and each copy's first move (``starts``, one more entry than copies)."""
    fields, starts = [], [0]
    for moves, _ in copies:
        f = packed(moves)
        fields.extend(f)
        starts.append(starts[-1] + len(f) // 5)
    m = torch.tensor(fields, dtype=torch.int64).view(-1, 5)
    return torch.stack([m[:, 1] * block_size + m[:, 2], m[:, 3] * block_size + m[:, 4]], 1), starts


def wave_ends(moves: torch.Tensor, block_size: int, copy_starts: list[int] | None = None) -> list[int]:
    """Where each wave of ``moves`` (int [n, 2] slots, read on the host) ends, as move indices: ``copy_engine.waves``'
    rule itself, a new wave wherever a copy reads or writes a block an earlier copy of the wave writes. Copies are
    ``copy_starts`` (each copy's first move, then n), whose moves may read what their own copy writes (a cycle):
    ``TorchCopyEngine``'s waves. Without them each move is a copy of its own: the moves then act as if made one
    after another (a swap of two slots becomes two waves and no swap). An empty batch has no waves."""
    _check_shape(moves)
    slots = moves.cpu().tolist()
    starts = list(range(len(slots) + 1)) if copy_starts is None else list(copy_starts)
    if not starts or starts[0] != 0 or starts[-1] != len(slots) or any(a > b for a, b in zip(starts, starts[1:])):
        raise InvalidArgumentError(f"copy_starts must rise from 0 to {len(slots)} (the number of moves), got "
                                   f"{copy_starts!r:.80}")
    batches = [[(0, *divmod(s, block_size), *divmod(d, block_size)) for s, d in slots[a:b]]
               for a, b in zip(starts, starts[1:])]
    ends, out = [starts[end] for _, end, _ in waves(batches)], []
    for end in ends:
        if end > (out[-1] if out else 0):  # NOTE: a wave of empty copies only moves nothing: no wave of its own
            out.append(end)
    return out


# ---- checks (host) ----------------------------------------------------------------------------------------------
def _check_shape(moves: object, what: str = "moves") -> None:
    if not isinstance(moves, torch.Tensor) or moves.dtype not in (torch.int32, torch.int64) \
            or moves.dim() != 2 or moves.shape[1] != 2:
        got = f"{moves.dtype} of shape {tuple(moves.shape)}" if isinstance(moves, torch.Tensor) else \
            f"{type(moves).__name__} {moves!r:.60}"
        raise InvalidArgumentError(f"{what} must be an int32 or int64 tensor [n, 2] of (source slot, "
                                   f"destination slot), got {got}")


def _check_type(cache: PagedKVCache, moves: object, what: str = "moves") -> None:
    _check_shape(moves, what)
    if moves.device != cache.device:
        raise InvalidArgumentError(f"{what} are on {moves.device}, the KV cache on {cache.device}")


def _checked_ends(ends: object, n: int) -> list[int]:
    """``wave_ends`` as a list (default: one wave of every move; none for no moves)."""
    if ends is None:
        return [n] if n else []
    ok = isinstance(ends, (list, tuple)) and all(type(e) is int for e in ends) and \
        all(a < b for a, b in zip([0, *ends], ends)) and (list(ends[-1:]) == [n] if n else not ends)
    if not ok:
        raise InvalidArgumentError(f"wave_ends must be increasing ints, each wave at least one move, the last "
                                   f"{n} (the number of moves), got {ends!r:.80}")
    return list(ends)


def _check_on_host(cache: PagedKVCache, moves: torch.Tensor, ends: list[int], disjoint: bool) -> None:
    """Every slot inside the cache, no slot written twice in one wave, and with ``disjoint`` no move reading a slot
    its wave writes; raises naming the first culprit. ``moves`` on the CPU."""
    S = cache.block_size
    bad = ((moves < 0) | (moves >= cache.num_slots)).flatten().nonzero()
    if bad.numel():
        i, side = divmod(int(bad[0]), 2)
        s = int(moves[i, side])
        raise BlockOutOfRangeError(
            f"move {i}: {('source', 'destination')[side]} slot {s} (block {s // S}, offset {s % S}) outside the "
            f"KV cache's {cache.num_blocks} blocks of {S} slots")
    slots, first = moves.tolist(), 0
    for end in ends:
        written: dict[int, int] = {}  # slot -> the move of this wave that writes it
        for i in range(first, end):
            dst = slots[i][1]
            if dst in written:
                raise DestinationError(f"move {i} writes slot {dst}, which move {written[dst]} of its wave (moves "
                                       f"{first}..{end - 1}) writes too")
            written[dst] = i
        if disjoint:
            for i in range(first, end):
                if slots[i][0] in written:
                    raise InvalidArgumentError(
                        f"disjoint=True, but move {i} reads slot {slots[i][0]}, which move {written[slots[i][0]]} "
                        f"of its wave (moves {first}..{end - 1}) writes")
        first = end


def check_moves(cache: PagedKVCache, moves: torch.Tensor, wave_ends: list[int] | None = None,
                disjoint: bool = False) -> None:
    """The host-side check of ``relocate``'s moves (a CPU tensor [n, 2]) against ``cache``, for callers that upload
    them to the device afterwards (on a device ``relocate`` checks nothing: module docstring)."""
    if not isinstance(moves, torch.Tensor) or moves.device.type != "cpu":
        raise InvalidArgumentError(f"check_moves reads the moves on the host: a CPU tensor [n, 2], got {moves!r:.60}")
    _check_shape(moves)
    _check_on_host(cache, moves, _checked_ends(wave_ends, moves.shape[0]), disjoint)


# ---- the relocator --------------------------------------------------------------------------------------------
class TritonRelocator:
    """Moves tokens of one ``PagedKVCache`` with the Triton kernels; built once per cache (its address tables)."""

    def __init__(self, cache: PagedKVCache, verifier: Verifier | None = None) -> None:
        """``verifier``: whose digest weights (its seed) the fused digests use; without one, no digests."""
        if not isinstance(cache, PagedKVCache):
            raise InvalidArgumentError(f"a TritonRelocator takes a PagedKVCache, got {type(cache).__name__}")
        if verifier is not None and (not isinstance(verifier, Verifier) or verifier.cache is not cache):
            raise InvalidArgumentError(f"the verifier must be a Verifier of this very cache, got {verifier!r:.80}")
        self.cache = cache
        self.block_size, self.num_slots = cache.block_size, cache.num_slots
        # NOTE: the verifier's digest weights, per group and word: the same draws, so the same digests
        self.units = _units(cache, None if verifier is None else verifier.digest_weights)
        self.launches = 0

    def _check_digests(self, digests: bool) -> None:
        if digests and self.units[0].weights is None:
            raise InvalidArgumentError("digests need the verifier's weights: TritonRelocator(cache, verifier)")

    # ---- relocation -------------------------------------------------------------------------------------------
    def relocate(self, moves: torch.Tensor, wave_ends: list[int] | None = None, *, digests: bool = False,
                 disjoint: bool = False) -> tuple[Digests, Digests] | None:
        """Move the token at each ``moves[i, 0]`` (a slot) to ``moves[i, 1]``, wave after wave.

        Args:
            moves: int32 or int64 [n, 2] on the cache's device.
            wave_ends: each wave's end (move index, increasing, the last n); default one wave. Within a wave all
                reads happen before all writes (``wave_ends`` derives them as ``TorchCopyEngine`` does).
            digests: also return strict verify's source and destination digests (needs a verifier).
            disjoint: the caller's promise that no move reads a slot its wave writes: one launch per wave and
                width, no scratch buffer (checked on the host when the moves are on the CPU).
        Returns:
            (source digests, destination digests), each per group [n, planes] like ``Verifier``'s; or None.
        """
        _check_type(self.cache, moves)
        n = moves.shape[0]
        ends = _checked_ends(wave_ends, n)
        self._check_digests(digests)
        if moves.device.type == "cpu":
            _check_on_host(self.cache, moves, ends, disjoint)
        outs = self._digest_outputs(n) if digests else None
        first = 0
        for end in ends:
            rows = slice(first, end)
            wave_outs = None if outs is None else [(s[rows], d[rows]) for s, d in outs]
            self._launch_wave(moves[rows], end - first, None, wave_outs, disjoint)
            first = end
        return None if outs is None else self._as_digests(outs)

    def relocate_padded(self, moves: torch.Tensor, count: torch.Tensor, *, digests: bool = False,
                        disjoint: bool = False) -> tuple[Digests, Digests] | None:
        """One wave of the first ``count`` moves of a fixed-capacity buffer (CUDA-graph capture: the launches
        depend on the capacity only). ``count``: a 1-element integer tensor on the cache's device. Rows past the
        count are padding: nothing reads them. Digests as ``relocate``'s, [capacity, planes], rows past count 0."""
        _check_type(self.cache, moves)
        if not isinstance(count, torch.Tensor) or count.numel() != 1 or count.dtype not in (torch.int32, torch.int64) \
                or count.device != self.cache.device:
            raise InvalidArgumentError(f"count must be a 1-element int32 or int64 tensor on {self.cache.device}, "
                                       f"got {count!r:.80}")
        self._check_digests(digests)
        capacity = moves.shape[0]
        if moves.device.type == "cpu":
            valid = int(count.reshape(()))
            if not 0 <= valid <= capacity:
                raise InvalidArgumentError(f"count {valid} outside [0, {capacity}] (the move buffer's capacity)")
            _check_on_host(self.cache, moves[:valid], [valid] if valid else [], disjoint)
        outs = self._digest_outputs(capacity, zero=True) if digests else None
        if capacity:
            self._launch_wave(moves, capacity, count.reshape(1), outs, disjoint)
        return None if outs is None else self._as_digests(outs)

    def digests_at(self, slots: torch.Tensor) -> Digests:
        """Strict verify's digests of the tokens at ``slots`` (1-D int32/int64 on the cache's device), per group
        [n, planes]: ``Verifier.destination_digests``' numbers, one launch per width."""
        self._check_digests(True)
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise InvalidArgumentError(f"slots must be a 1-D int32 or int64 tensor, got {slots!r:.60}")
        as_moves = slots.unsqueeze(1).expand(-1, 2)  # a view: both columns are the slot
        _check_type(self.cache, as_moves, "slots")
        if slots.device.type == "cpu":
            _check_on_host(self.cache, as_moves, [], False)
        outs = self._digest_outputs(slots.numel())
        for unit, (_, out) in zip(self.units, outs):
            if slots.numel():
                self._read(unit, as_moves, slots.numel(), None, _DESTINATION, out=out)
        return self._as_digests(outs)[1]

    # ---- launches ---------------------------------------------------------------------------------------------
    def _digest_outputs(self, n: int, zero: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        make = torch.zeros if zero else torch.empty
        return [tuple(make((n, u.num_planes), dtype=torch.int64, device=self.cache.device) for _ in range(2))
                for u in self.units]

    def _as_digests(self, outs) -> tuple[Digests, Digests]:
        src, dst = [None] * len(self.cache.groups), [None] * len(self.cache.groups)
        for unit, (s, d) in zip(self.units, outs):
            for gi, a, b in unit.columns:
                src[gi], dst[gi] = s[:, a:b], d[:, a:b]
        return Digests(src), Digests(dst)

    def _launch_wave(self, moves: torch.Tensor, capacity: int, count: torch.Tensor | None, outs, disjoint: bool):
        """One wave (all reads before all writes) in every unit: read, then write and read back (or both in one
        direct launch). ``count``: the padded variant's device count, else all ``capacity`` moves count."""
        for ui, unit in enumerate(self.units):
            src_out, dst_out = (None, None) if outs is None else outs[ui]
            if disjoint:
                self._read(unit, moves, capacity, count, _SOURCE, out=src_out, dst_out=dst_out, direct=True)
            else:
                buf = torch.empty((capacity, unit.elems), dtype=unit.base.dtype, device=self.cache.device)
                self._read(unit, moves, capacity, count, _SOURCE, out=src_out, buf=buf)
                self._write(unit, moves, capacity, count, buf, out=dst_out)

    def _tile(self, unit: _Unit, capacity: int) -> tuple[int, int, int, int]:
        """(BLOCK_M, ROWS, PLANES, num_warps). The interpreter runs programs one after another, each op costing
        tens of microseconds whatever its size: one program for a small batch, every plane. A GPU: one plane per
        program, about ``_TILE_ELEMS`` elements per program and iteration."""
        if self.cache.device.type == "cpu":
            rows = min(_pow2_at_least(unit.row_plane.numel()), max(1, _TILE_ELEMS // unit.lanes))
            planes = min(_pow2_at_least(unit.num_planes), _INTERPRETER_PLANES)
            return min(_pow2_at_least(capacity), _INTERPRETER_BLOCK_M), rows, planes, 1
        rows = min(_pow2_at_least(unit.max_plane_rows), max(1, _TILE_ELEMS // unit.lanes))
        return max(1, min(_pow2_at_least(capacity), _TILE_ELEMS // (rows * unit.lanes))), rows, 1, 4

    def _read(self, unit: _Unit, moves, capacity, count, side, out=None, dst_out=None, buf=None,
              direct=False) -> None:
        block_m, rows, planes, warps = self._tile(unit, capacity)
        grid = (triton.cdiv(capacity, block_m), triton.cdiv(unit.num_planes, planes))
        digest, unused = out is not None, unit.row_start  # NOTE: a pointer the kernel never reads
        _read_tokens[grid](
            unit.base, unit.row_start, unit.row_stride, unit.planes, unit.row_plane, moves, moves.stride(0),
            moves.stride(1), capacity, moves if count is None else count, unused if buf is None else buf,
            unit.elems, unit.weights if digest else unused, out if digest else unused,
            unused if dst_out is None else dst_out, unit.num_planes, unit.row_start.shape[1], self.num_slots,
            SIDE=side, KEEP=buf is not None, DIRECT=direct, DIGEST=digest, PADDED=count is not None,
            BLOCK_SIZE=self.block_size, LANES=unit.lanes, ALIGN=unit.align, WIDE=unit.wide,
            WORD_MASK=_WORD_MASK[unit.base.element_size()], BLOCK_M=block_m, ROWS=rows, PLANES=planes,
            num_warps=warps)
        self.launches += 1

    def _write(self, unit: _Unit, moves, capacity, count, buf, out=None) -> None:
        block_m, rows, planes, warps = self._tile(unit, capacity)
        grid = (triton.cdiv(capacity, block_m), triton.cdiv(unit.num_planes, planes))
        digest, unused = out is not None, unit.row_start
        _write_tokens[grid](
            unit.base, unit.row_start, unit.row_stride, unit.planes, unit.row_plane, moves, moves.stride(0),
            moves.stride(1), capacity, moves if count is None else count, buf, unit.elems,
            unit.weights if digest else unused, out if digest else unused, unit.num_planes, unit.row_start.shape[1],
            self.num_slots, DIGEST=digest, PADDED=count is not None, BLOCK_SIZE=self.block_size, LANES=unit.lanes,
            ALIGN=unit.align, WIDE=unit.wide, WORD_MASK=_WORD_MASK[unit.base.element_size()], BLOCK_M=block_m,
            ROWS=rows, PLANES=planes, num_warps=warps)
        self.launches += 1


def relocate(cache: PagedKVCache, moves: torch.Tensor, wave_ends: list[int] | None = None,
             verifier: Verifier | None = None, disjoint: bool = False) -> tuple[Digests, Digests] | None:
    """``TritonRelocator(cache, verifier).relocate(moves, wave_ends, digests=verifier is not None, disjoint=...)``:
    a one-off call (it builds the address tables; hold a ``TritonRelocator`` to move every step)."""
    return TritonRelocator(cache, verifier).relocate(moves, wave_ends, digests=verifier is not None,
                                                     disjoint=disjoint)


# ---- GPU benchmark (a device run only) ------------------------------------------------------------------------
def bench_cache(layers: int, heads: int, head_size: int, block_size: int, num_blocks: int,
                dtype: torch.dtype = torch.float16, device: str = "cuda") -> PagedKVCache:
    """A FLASH_ATTN-like cache: one ``[2, num_blocks, block_size, heads, head_size]`` tensor per layer (vLLM's
    GPU allocation), random contents."""
    from .kv_layout import gpu_planes
    gen = torch.Generator(device=device).manual_seed(0)
    planes = []
    for layer in range(layers):
        t = torch.empty((2, num_blocks, block_size, heads, head_size), dtype=dtype, device=device)
        t.view(torch.int16 if t.element_size() == 2 else torch.uint8).random_(generator=gen)
        planes += gpu_planes(f"l{layer}", t)
    return PagedKVCache(planes)


def _median_ms(fn, reps: int) -> float:
    """Median time of ``fn`` on the current stream, by CUDA events, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _graph_ms(fn, reps: int) -> float:
    """Median time of one replay of ``fn`` captured as a CUDA graph (the kernels alone, no host launch cost)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _median_ms(graph.replay, reps)


def benchmark(device: str = "cuda", layers: int = 32, heads: int = 8, head_size: int = 128, block_size: int = 16,
              sizes_mb: tuple[int, ...] = (512, 16), reps: int = 20) -> dict:
    """Relocation bandwidth as a fraction of a plain device-to-device copy (``dst.copy_(src)`` of the same bytes),
    both timed in this run by CUDA events, for random moves of ``sizes_mb`` MB (source and destination slots drawn
    without repetition from one FLASH_ATTN-like fp16 cache). Fractions: ``copy_ms / relocation_ms`` for the staged
    kernels (scratch buffer), the direct one (``disjoint``), each with the fused digests, and torch's gather +
    scatter; those include the host's launch cost (the events bracket the calls), the ``graph_*`` ones (the padded
    variant replayed as a CUDA graph) do not. Needs CUDA; not run by the tests. Returns {size: {name: number}}."""
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        raise InvalidArgumentError(f"benchmark needs a CUDA device, got {device!r} (cuda available: "
                                   f"{torch.cuda.is_available()})")
    per_token = layers * 2 * heads * head_size * 2
    most = max(sizes_mb) * 2 ** 20 // per_token
    num_blocks = -(-2 * most * 5 // 4 // block_size)  # room for disjoint sources and destinations, 25% spare
    cache = bench_cache(layers, heads, head_size, block_size, num_blocks, torch.float16, device)
    verifier = Verifier(cache)
    mover = TritonRelocator(cache, verifier)
    gen = torch.Generator(device=device).manual_seed(1)
    out: dict = {"device": torch.cuda.get_device_name(device), "bytes_per_token": cache.bytes_per_token,
                 "units": len(mover.units), "groups": len(cache.groups)}
    for mb in sizes_mb:
        n = mb * 2 ** 20 // per_token
        perm = torch.randperm(cache.num_slots, generator=gen, device=device)
        moves = torch.stack([perm[:n], perm[n:2 * n]], 1).contiguous()
        nbytes = n * cache.bytes_per_token
        src_bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst_bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)
        copy_ms = _median_ms(lambda: dst_bytes.copy_(src_bytes), reps)
        timed = {
            "staged": lambda: mover.relocate(moves),
            "direct": lambda: mover.relocate(moves, disjoint=True),
            "staged_digest": lambda: mover.relocate(moves, digests=True),
            "direct_digest": lambda: mover.relocate(moves, digests=True, disjoint=True),
            "torch": lambda: cache.scatter(moves[:, 1], cache.gather(moves[:, 0])),
        }
        row = {"moves": n, "bytes": nbytes, "copy_ms": copy_ms, "copy_GBps": nbytes / copy_ms / 1e6}
        for name, fn in timed.items():
            ms = _median_ms(fn, reps)
            row[f"{name}_ms"], row[f"{name}_fraction"] = ms, copy_ms / ms
        count = torch.tensor([n], dtype=torch.int32, device=device)
        for name, options in (("graph_staged", {}), ("graph_direct", {"disjoint": True}),
                              ("graph_direct_digest", {"disjoint": True, "digests": True})):
            try:
                ms = _graph_ms(lambda: mover.relocate_padded(moves, count, **options), reps)
                row[f"{name}_ms"], row[f"{name}_fraction"] = ms, copy_ms / ms
            except RuntimeError as e:  # a capture that fails is a finding, not the end of the run
                row[f"{name}_error"] = repr(e)[:300]
        src, dst = mover.relocate(moves, digests=True)  # the tokens moved, and the digests agree with Verifier's
        want = verifier.source_digests(cache.gather(moves[:, 0]))
        row["digests_checked"] = all(torch.equal(a, b) and torch.equal(a, c)
                                     for a, b, c in zip(src.per_group, dst.per_group, want.per_group))
        row["bits_checked"] = all(torch.equal(a, b)
                                  for a, b in zip(cache.gather(moves[:, 0]), cache.gather(moves[:, 1])))
        out[f"{mb}MB"] = row
        src_bytes = dst_bytes = None  # the next size allocates its own
    return out
