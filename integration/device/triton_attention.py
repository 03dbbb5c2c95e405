"""Decode attention over each request's live slots, in Triton (the gather read path on a GPU; issue #47, part 3).

The gather read path keeps a request's live tokens wherever they lie in vLLM's paged KV cache and attends them
through a per-request slot list: page size 1, like SGLang's token-level pool. ``gather_attention`` computes that
attention on the CPU (its C kernel, or torch); this module is its decode step on a GPU: one query per request
(``q [R, H, D]``), each request's K and V read in place at its slots, with no gathered copy.

Split-K (flash-decoding): a request's slot list is cut into ``splits`` equal parts, and one program per
(request, KV head, split) scores its part for every query head of that KV head (GQA and MQA: query head h reads
KV head h // (H / KV heads), vLLM's order), keeping an online softmax in fp32: the running maximum, the sum of
exponentials and the weighted sum of V. A second, small kernel merges the splits of each (request, head) and
writes the output in q's dtype (with one split the first kernel writes it: nothing to merge). Many splits keep
the GPU busy when a batch is small and its contexts long.

Where a slot's elements are: slot = block * block_size + offset, and K or V element (head, d) of the token at
(block, offset) is

  * on an affine layout (every layout vLLM uses: its GPU layouts NHD and HND, stacked or not, and its CPU layout
    with K stored dim-major), at ``block * s_block + offset * s_token + head * s_head + d * s_dim`` in the plane's
    strided heads view (``PagedKVCache.heads_view``);
  * on any other, at ``offsets[offset, e] + block * stride[e]`` in the group's flat storage, e = head * D + d
    (``kv_cache.Group``): two more loads per element, for layouts no engine uses.

Agreement (V5; ``check_decode_agreement``). fp16, bf16 and fp32 K, V and q are multiplied and summed in fp32
(products of fp16 or bf16 values are exact in fp32), so before its final rounding the kernel's output x is an
fp32 computation of the same function as ``gather_attention.reference_attention`` run in fp32 over the same
(already rounded) inputs, and ``gather_attention.agreement_bound`` b bounds |x - ref| per (request, head). The
output is x rounded to nearest in q's dtype t: |fl_t(x) - x| <= u_t |x| where x is a normal number of t, and
<= eta_t / 2 below (half the spacing of t's subnormals), so

    |out - ref| <= b + u_t (|ref| + b) + eta_t / 2          per element (|x| <= |ref| + b),

with u_t = 2^-11, eta_t = 2^-24 for fp16; u_t = 2^-8, eta_t = 2^-133 for bf16; and no rounding term for fp32
(the bound is then ``agreement_bound``'s, compared as ``check_agreement`` compares it). Like b, stated, not
proved: the online softmax rescales its partial sums once per tile and the merge once per split, a few u per
element more than the reference's one pass, which the gamma_N terms of b cover on any list of more than a few
tokens (and on one token both are exact). Checked here in Triton's interpreter (numpy's exp, no fused multiply-add);
on a GPU ``tl.exp`` is the hardware's approximate exp2 and products may fuse into FMAs, which ``benchmark`` checks
against the bound before it times anything. A bf16 output is written in fp32 and rounded by torch, to nearest
even (the interpreter's own fp32 -> bf16 conversion truncates).

NOTE: the slot decode (``_block_and_offset``), the causal limit (``_last_attended_id``) and which splits the
merge reads (``_merged``) are small ``triton.jit`` functions of their own, so tests can replace one with a planted
bug (under the interpreter a kernel looks them up when it runs) and see V5 fail: ``tests/test_triton_attention.py``.
No more of them: under the interpreter each call of one costs about as much as a tile's arithmetic.

On the CPU the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is
imported; numpy, slowly): how the tests check them without a GPU. ``benchmark`` times the kernel on a GPU
against torch's fused attention over the same tokens stored densely.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vtoken.core.errors import ConfigError, InvalidArgumentError, InvariantViolation

from .gather_attention import PAD, agreement_bound, reference_attention
from .kv_cache import PagedKVCache
from .kv_layout import Plane, gpu_planes

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # of q, K and V; accumulation is fp32 for all of them
# Output rounding per dtype: (unit roundoff u_t, smallest subnormal eta_t); fp32 output is not rounded again
ROUNDING = {torch.float16: (2.0 ** -11, 2.0 ** -24), torch.bfloat16: (2.0 ** -8, 2.0 ** -133),
            torch.float32: (0.0, 0.0)}
TILE_ELEMENTS = 8192  # a tile's [query heads, tokens, head_dim] products, at most: bounds the registers it takes
MIN_SPLIT_TOKENS = 128  # default_splits never cuts a request's slots into parts shorter than this
MAX_SPLITS = 64  # nor into more parts than this


# ---- device functions (each replaceable by a test: module docstring) ------------------------------------------
# NOTE: the kernels call no function of Triton's standard library that is itself a ``triton.jit`` function (tl.sum,
# tl.max, tl.zeros, tl.cdiv): those are decorated once, when triton is imported, and where that was before
# TRITON_INTERPRET was set (a test session that imported vLLM first) the interpreter cannot call them. The
# reductions they are (``tl.reduce`` with their combine functions) run either way, in numpy under the interpreter.
SUM, MAX = tl.standard._sum_combine, tl.standard._elementwise_max


@triton.jit
def _block_and_offset(slot, block_size):
    """A slot's block and its offset in the block (slot = block * block_size + offset)."""
    return slot // block_size, slot % block_size


@triton.jit
def _last_attended_id(query_pos):
    """The largest logical id a query attends: its own position (causal by logical id; padding's id, PAD, is larger
    than any position)."""
    return query_pos


@triton.jit
def _merged(split, splits):
    """Which splits the merge reads: every one (an empty split holds max -inf and sums 0, and weighs nothing)."""
    return split < splits


@triton.jit
def _partials_kernel(q_ptr, k_base, k_offsets, k_block_strides, v_base, v_offsets, v_block_strides,
                     slots_ptr, ids_ptr, lengths_ptr, query_pos_ptr, max_ptr, sum_ptr, acc_ptr, out_ptr,
                     scale, splits, block_size, out_s_req, out_s_head, out_s_dim,
                     q_s_req, q_s_head, q_s_dim, slots_s_req, slots_s_tok, ids_s_req, ids_s_tok,
                     k_s_block, k_s_token, k_s_head, k_s_dim, v_s_block, v_s_token, v_s_head, v_s_dim, elems,
                     HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, AFFINE: tl.constexpr, FINAL: tl.constexpr):
    """Split ``split`` of request ``request``'s slot list, for the GROUP query heads of KV head ``kv_head``: the
    online softmax's (max, sum of exp, sum of exp-weighted V) over the tokens it attends, in fp32; or, where
    ``FINAL`` (one split: nothing to merge), the output itself, as ``_merge_kernel`` would write it."""
    # NOTE: indices in int64: a cache's element offsets pass 2^31 (and the interpreter checks narrower ones for
    # overflow, op by op, slowly)
    request = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    g = tl.arange(0, BLOCK_G).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    head = kv_head * GROUP + g  # NOTE: query head h reads KV head h // GROUP (GQA as vLLM orders heads)
    is_head = g < GROUP
    is_dim = d < HEAD_DIM
    q = tl.load(q_ptr + request * q_s_req + head[:, None] * q_s_head + d[None, :] * q_s_dim,
                mask=is_head[:, None] & is_dim[None, :], other=0.0).to(tl.float32)
    last_id = _last_attended_id(tl.load(query_pos_ptr + request))
    length = tl.load(lengths_ptr + request)
    chunk = (length + splits - 1) // splits  # equal parts; the last ones shorter, or empty (more splits than tokens)
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    ids_row = ids_ptr + request * ids_s_req
    slots_row = slots_ptr + request * slots_s_req
    if AFFINE:  # the head's first element, and its elements' offsets from it
        k_head, k_dims = k_base + kv_head * k_s_head, d * k_s_dim
        v_head, v_dims = v_base + kv_head * v_s_head, d * v_s_dim
    else:  # the canonical elements of (kv_head, d), K[head][d] (kv_layout), and their block strides in the table
        e = kv_head * HEAD_DIM + d
        k_per_block = tl.load(k_block_strides + e, mask=is_dim, other=0)
        v_per_block = tl.load(v_block_strides + e, mask=is_dim, other=0)
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    tile_pos = tl.arange(0, BLOCK_N).to(tl.int64)
    for first in range(start, end, BLOCK_N):
        pos = first + tile_pos
        inside = pos < end
        token_ids = tl.load(ids_row + pos * ids_s_tok, mask=inside, other=0)
        seen = inside & (token_ids <= last_id)
        # NOTE: K, V and the slot itself are read only where seen: padding and later tokens are never read
        slot = tl.load(slots_row + pos * slots_s_tok, mask=seen, other=0)
        block, offset = _block_and_offset(slot, block_size)
        tile = seen[:, None] & is_dim[None, :]
        if AFFINE:
            k_ptrs = k_head + (block * k_s_block + offset * k_s_token)[:, None] + k_dims[None, :]
            v_ptrs = v_head + (block * v_s_block + offset * v_s_token)[:, None] + v_dims[None, :]
        else:
            in_block = offset[:, None] * elems + e[None, :]
            k_ptrs = k_base + tl.load(k_offsets + in_block, mask=tile, other=0) + block[:, None] * k_per_block[None, :]
            v_ptrs = v_base + tl.load(v_offsets + in_block, mask=tile, other=0) + block[:, None] * v_per_block[None, :]
        k = tl.load(k_ptrs, mask=tile, other=0.0).to(tl.float32)
        scores = tl.reduce(q[:, None, :] * k[None, :, :], 2, SUM) * scale
        scores = tl.where(seen[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.reduce(scores, 1, MAX))
        # NOTE: while nothing is seen the max is -inf; shifting by 0 then gives exp(-inf) = 0, never -inf - -inf
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(running_max - shift)
        weights = tl.exp(scores - shift[:, None])
        v = tl.load(v_ptrs, mask=tile, other=0.0).to(tl.float32)
        running_sum = running_sum * rescale + tl.reduce(weights, 1, SUM)
        acc = acc * rescale[:, None] + tl.reduce(weights[:, :, None] * v[None, :, :], 1, SUM)
        running_max = new_max
    if FINAL:  # NOTE: bit for bit the merge of one split: its weight is exp(0) = 1
        at = out_ptr + request * out_s_req + head[:, None] * out_s_head + d[None, :] * out_s_dim
        out = acc / running_sum[:, None]
        tl.store(at, out.to(out_ptr.dtype.element_ty), mask=is_head[:, None] & is_dim[None, :])
    else:
        row = (request * HEADS + head) * splits + split
        tl.store(max_ptr + row, running_max, mask=is_head)
        tl.store(sum_ptr + row, running_sum, mask=is_head)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=is_head[:, None] & is_dim[None, :])


@triton.jit
def _merge_kernel(max_ptr, sum_ptr, acc_ptr, out_ptr, splits, out_s_req, out_s_head, out_s_dim,
                  HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Head ``head`` of request ``request``: its splits' partials merged (each rescaled to the largest max), the
    weighted V sum over the sum of weights, rounded to nearest in the output's dtype."""
    request = tl.program_id(0).to(tl.int64)  # NOTE: int64 indices, as in _partials_kernel
    head = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    is_dim = d < HEAD_DIM
    kept = _merged(s, splits)
    row = (request * HEADS + head) * splits + s
    maxima = tl.load(max_ptr + row, mask=kept, other=float("-inf"))
    sums = tl.load(sum_ptr + row, mask=kept, other=0.0)
    acc = tl.load(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=kept[:, None] & is_dim[None, :], other=0.0)
    top = tl.reduce(maxima, 0, MAX)
    shift = tl.where(top == float("-inf"), 0.0, top)  # NOTE: nothing attended: 0 / 0, NaN, like the reference
    weight = tl.exp(maxima - shift)
    out = tl.reduce(acc * weight[:, None], 0, SUM) / tl.reduce(sums * weight, 0, SUM)
    tl.store(out_ptr + request * out_s_req + head * out_s_head + d * out_s_dim, out.to(out_ptr.dtype.element_ty),
             mask=is_dim)


# ---- host side --------------------------------------------------------------------------------------------------
class PlaneAddress(NamedTuple):
    """Where a plane's K or V elements are, as ``_partials_kernel`` takes it (module docstring): the strided heads
    view and its four strides (``affine``), or the group's flat storage with its ``offsets [S, E]`` and per-element
    block ``strides [E]`` of the plane's elements."""
    base: torch.Tensor
    affine: bool
    strides: tuple[int, int, int, int]  # (block, token, head, dim); zeros when not affine
    offsets: torch.Tensor  # int64 [S, E]; when affine, any int64 tensor (never read)
    block_strides: torch.Tensor  # int64 [E]; likewise
    heads: int


def plane_address(cache: PagedKVCache, name: str, head_dim: int) -> PlaneAddress:
    """Plane ``name``'s elements as heads of ``head_dim``: through its heads view where the layout has one."""
    # NOTE: the cache's own lookup of a plane (aliases resolved; LayoutError naming the known planes)
    group, a, b = cache.segment(name)
    if (b - a) % head_dim:
        raise InvalidArgumentError(f"decode attention: plane {name!r} holds {b - a} elements per token, not whole "
                                   f"heads of head_dim {head_dim} (q's last dimension)")
    view = cache.heads_view(name, head_dim)
    if view is not None:
        return PlaneAddress(view, True, tuple(view.stride()), group.stride, group.stride, view.shape[2])
    return PlaneAddress(group.flat, False, (0, 0, 0, 0), group.offsets[:, a:b].contiguous(),
                        group.stride[a:b].contiguous(), (b - a) // head_dim)


def interpreted() -> bool:
    """Whether this module's kernels run in Triton's interpreter (TRITON_INTERPRET=1 when it was imported)."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_partials_kernel, InterpretedFunction)


def default_splits(requests: int, kv_heads: int, width: int, device: torch.device) -> int:
    """How many parts to cut each slot list into: enough programs for two per multiprocessor of a GPU, no part
    shorter than MIN_SPLIT_TOKENS of the padded ``width``, at most MAX_SPLITS; one off a GPU (the interpreter)."""
    if device.type != "cuda":
        return 1
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-programs // max(1, requests * kv_heads))
    return max(1, min(wanted, -(-width // MIN_SPLIT_TOKENS), MAX_SPLITS))


def decode_attention(cache: PagedKVCache, layer: str, q: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor,
                     query_pos: torch.Tensor, scale: float, splits: int | None = None,
                     lengths: torch.Tensor | None = None, tile_tokens: int | None = None) -> torch.Tensor:
    """Decode attention: request r's one query ``q[r]`` over its live tokens at or before ``query_pos[r]``.

    Args:
        cache, layer: the KV cache and the layer whose planes ``{layer}.K``, ``{layer}.V`` are read.
        q: ``[R, H, D]``, fp16, bf16 or fp32; H a multiple of the layer's KV heads (GQA, MQA).
        slots, ids: int64 ``[R, N]``: each row a request's live slots and their logical ids, in logical order,
            padded at its end (id ``PAD``), as ``gather_attention.attention`` takes them.
        query_pos: int64 ``[R]``, each query's logical position: it attends the ids at or before it.
        scale: the scores' factor (usually D ** -0.5).
        splits: how many parts each slot list is cut into (default: ``default_splits``).
        lengths: int64 ``[R]``, each row's live count, where the caller keeps it (else counted from ``ids``).
        tile_tokens: tokens a program scores at once, a power of 2 (default: as many as keep a tile's products
            within TILE_ELEMENTS, at most 64).

    Returns:
        ``[R, H, D]`` in q's dtype, accumulated in fp32 (within ``check_decode_agreement``'s bound of the
        reference). A query that attends no token gets NaN, as in the reference.

    NOTE: on a GPU nothing here waits for the device: a live slot outside the cache is not checked (the caller
    checks its slots on the host, ``PagedKVCache.check_slots``); on the CPU (the interpreter) it is refused.
    """
    R, H, D = _check_arguments(cache, layer, q, slots, ids, query_pos, scale, splits, lengths, tile_tokens)
    k, v = plane_address(cache, f"{layer}.K", D), plane_address(cache, f"{layer}.V", D)
    _check_heads(layer, H, k, v)
    if cache.device.type == "cpu":
        _check_on_host(cache, layer, slots, ids)
    splits = default_splits(R, k.heads, slots.shape[1], cache.device) if splits is None else splits
    out = torch.empty(R, H, D, dtype=q.dtype, device=q.device)
    if R:
        lengths = (ids != PAD).sum(dim=1) if lengths is None else lengths
        _launch(cache, k, v, q, slots, ids, lengths, query_pos, float(scale), splits, tile_tokens, out)
    return out


def _launch(cache: PagedKVCache, k: PlaneAddress, v: PlaneAddress, q: torch.Tensor, slots: torch.Tensor,
            ids: torch.Tensor, lengths: torch.Tensor, query_pos: torch.Tensor, scale: float, splits: int,
            tile_tokens: int | None, out: torch.Tensor) -> None:
    """``decode_attention``'s kernels, its arguments checked: the partials (or, with one split, the output), then
    their merge."""
    (R, H, D), final = q.shape, splits == 1
    # NOTE: every (request, head, split) is written by _partials_kernel, an empty split too: no initialisation
    maxima = torch.empty(R, H, 0 if final else splits, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxima)
    acc = torch.empty(R, H, 0 if final else splits, D, dtype=torch.float32, device=q.device)
    # NOTE: a bf16 output is written in fp32 and rounded by torch, to nearest even: the interpreter's fp32 -> bf16
    # truncates (a GPU's rounds), and the bound allows half an ulp
    target = torch.empty(R, H, D, device=q.device) if q.dtype == torch.bfloat16 else out
    group, block_d = H // k.heads, triton.next_power_of_2(D)
    block_g = triton.next_power_of_2(group)
    # NOTE: a power of 2, as Triton's blocks must be: so are TILE_ELEMENTS, block_g and block_d
    block_n = tile_tokens or max(1, min(64, TILE_ELEMENTS // (block_g * block_d)))
    _partials_kernel[(R, k.heads, splits)](
        q, k.base, k.offsets, k.block_strides, v.base, v.offsets, v.block_strides,
        slots, ids, lengths, query_pos, maxima, sums, acc, target,
        scale, splits, cache.block_size, *target.stride(),
        *q.stride(), *slots.stride(), *ids.stride(), *k.strides, *v.strides, k.heads * D,
        HEADS=H, GROUP=group, HEAD_DIM=D, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, AFFINE=k.affine,
        FINAL=final)
    if not final:
        _merge_kernel[(R, H)](maxima, sums, acc, target, splits, *target.stride(),
                              HEADS=H, HEAD_DIM=D, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
    if target is not out:
        out.copy_(target)


def _check_arguments(cache, layer, q, slots, ids, query_pos, scale, splits, lengths,
                     tile_tokens) -> tuple[int, int, int]:
    """(R, H, D), or an InvalidArgumentError naming the argument at fault. Shapes, dtypes and devices only: no
    value is read (on a GPU that would wait for it)."""
    if not isinstance(cache, PagedKVCache):
        raise InvalidArgumentError(f"decode attention: cache must be a PagedKVCache, got {type(cache).__name__}")
    if not isinstance(layer, str):
        raise InvalidArgumentError(f"decode attention: layer must be a string, got {layer!r:.60}")
    if cache.device.type == "cpu" and not interpreted():
        raise InvalidArgumentError("decode attention: the KV cache is on the CPU, where Triton kernels run only in "
                                   "its interpreter (TRITON_INTERPRET=1 set before vtoken's triton_attention is "
                                   "imported)")
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in DTYPES or q.device != cache.device:
        raise InvalidArgumentError(f"decode attention of {layer!r}: q must be a [requests, heads, head_dim] fp16, "
                                   f"bf16 or fp32 tensor on {cache.device}, got {_describe(q)}")
    R, H, D = q.shape
    if min(H, D) < 1:
        raise InvalidArgumentError(f"decode attention of {layer!r}: q has {H} heads of {D} elements")
    for what, t, shape in (("slots", slots, None), ("ids", ids, None), ("query_pos", query_pos, (R,)),
                           ("lengths", lengths, (R,))):
        if what == "lengths" and t is None:
            continue
        want = shape or (R, slots.shape[1] if isinstance(slots, torch.Tensor) and slots.dim() == 2 else -1)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != want \
                or t.device != cache.device:
            raise InvalidArgumentError(f"decode attention of {layer!r}: {what} must be an int64 tensor of shape "
                                       f"{list(want)} on {cache.device} (one row per query), got {_describe(t)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise InvalidArgumentError(f"decode attention of {layer!r}: scale must be a finite number, got {scale!r}")
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
        raise InvalidArgumentError(f"decode attention of {layer!r}: splits must be a positive int, got {splits!r}")
    if tile_tokens is not None and (isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int)
                                    or tile_tokens < 1 or tile_tokens & (tile_tokens - 1)):
        raise InvalidArgumentError(f"decode attention of {layer!r}: tile_tokens must be a power of 2, got "
                                   f"{tile_tokens!r}")
    return R, H, D


def _check_heads(layer: str, heads: int, k: PlaneAddress, v: PlaneAddress) -> None:
    if k.heads != v.heads or heads % k.heads:
        raise InvalidArgumentError(f"decode attention of {layer!r}: q's {heads} heads are not a multiple of the "
                                   f"layer's KV heads (K {k.heads}, V {v.heads})")
    for name, plane in (("K", k), ("V", v)):
        if plane.base.dtype not in DTYPES:
            raise InvalidArgumentError(f"decode attention of {layer!r}: {name} is {plane.base.dtype}; the kernel "
                                       f"reads fp16, bf16 or fp32")


def _check_on_host(cache: PagedKVCache, layer: str, slots: torch.Tensor, ids: torch.Tensor) -> None:
    """What only a look at the values can check, where that costs no device wait: every live slot inside the cache
    (BlockOutOfRangeError naming it), and padding only at the end of a row (the kernel reads each row's first
    ``lengths`` positions)."""
    live = ids != PAD
    if bool((live[:, 1:] & ~live[:, :-1]).any()):
        row = int((live[:, 1:] & ~live[:, :-1]).any(dim=1).nonzero()[0])
        raise InvalidArgumentError(f"decode attention of {layer!r}: row {row} of ids has padding (PAD) before a "
                                   f"live id; padding goes at the end of a row")
    cache.check_slots(slots[live])


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} of shape {list(t.shape)} on {t.device}"
    return f"{type(t).__name__} {t!r:.60}"


# ---- agreement (V5) ---------------------------------------------------------------------------------------------
def fp32_on_host(cache: PagedKVCache) -> PagedKVCache:
    """``cache`` with every plane in fp32 on the CPU, laid out as it is (the same element indices): the cache itself
    when it already is. The reference's inputs for a kernel that read fp16 or bf16 (module docstring)."""
    if cache.device.type == "cpu" and all(g.flat.dtype == torch.float32 for g in cache.groups):
        return cache
    storages: dict[int, torch.Tensor] = {}
    planes = []
    for p in cache.planes:
        storage = p.tensor.untyped_storage()
        if storage.data_ptr() not in storages:
            elems = storage.nbytes() // p.tensor.element_size()
            flat = torch.empty(0, dtype=p.tensor.dtype, device=p.tensor.device).set_(storage, 0, (elems,))
            storages[storage.data_ptr()] = flat.to(device="cpu", dtype=torch.float32)
        tensor = storages[storage.data_ptr()].as_strided(p.tensor.shape, p.tensor.stride(), p.tensor.storage_offset())
        planes.append(Plane(p.layer, tensor, p.block_stride, p.offsets, p.parts))
    copy = PagedKVCache(planes)
    copy.aliases.update(cache.aliases)
    return copy


def decode_reference(cache: PagedKVCache, layer: str, q: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor,
                     query_pos: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(``reference_attention`` in fp32 on the CPU over the same inputs ``[R, H, D]``, and the bound ``[R, H, D]``
    on how far ``decode_attention``'s output in q's dtype may be from it: module docstring). Padding's slots are
    never read by the kernel and may hold anything; the reference reads them, so they are replaced by slot 0."""
    host = fp32_on_host(cache)
    slots, ids, query_pos = slots.cpu(), ids.cpu(), query_pos.cpu()
    slots = torch.where(ids != PAD, slots, torch.zeros_like(slots))
    q32, rows = q.detach().to(device="cpu", dtype=torch.float32), torch.arange(q.shape[0])
    ref, _ = reference_attention(host, layer, q32, slots, ids, rows, query_pos, scale)
    fp32_bound, _ = agreement_bound(host, layer, q32, slots, ids, rows, scale)  # [R, H], float64
    u, eta = ROUNDING[q.dtype]
    b = fp32_bound.unsqueeze(-1)
    return ref, b + u * (ref.to(torch.float64).abs() + b) + eta / 2


def check_decode_agreement(cache: PagedKVCache, layer: str, q: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor,
                           query_pos: torch.Tensor, scale: float, out: torch.Tensor,
                           names: list[str] | None = None) -> None:
    """V5: ``out`` (``decode_attention``'s result for these arguments) within ``decode_reference``'s bound of the
    reference, element by element; a NaN agrees only with a NaN. ``names``: the requests' ids, for the message."""
    ref, bound = decode_reference(cache, layer, q, slots, ids, query_pos, scale)
    got = out.detach().to(device="cpu", dtype=torch.float64)
    gap = (got - ref.to(torch.float64)).abs()
    bad = ~(gap <= bound) & ~(got.isnan() & ref.isnan())
    if bool(bad.any()):
        r, h, d = (int(i) for i in bad.nonzero()[0])
        who = names[r] if names is not None else f"row {r}"
        raise InvariantViolation("V5", f"request {who!r}, layer {layer!r}: decode attention differs from the "
                                       f"reference by {float(gap[r, h, d]):.3g} at head {h}, element {d} "
                                       f"(got {float(got[r, h, d]):.6g}, reference {float(ref[r, h, d]):.6g}), "
                                       f"past the {str(q.dtype).removeprefix('torch.')} bound "
                                       f"{float(bound[r, h, d]):.3g}")


# ---- benchmark (a GPU's, for a device run) ---------------------------------------------------------------------
Timer = Callable[[Callable[[], object]], tuple[float, str]]  # (mean ms per call of a function, how it was timed)


def benchmark(device: str = "cuda", contexts: tuple[int, ...] = (4096, 32768), batches: tuple[int, ...] = (1, 8, 64),
              heads: int = 32, kv_heads: int = 8, head_dim: int = 128, iters: int = 50,
              check_agreement: bool = True) -> dict:
    """Decode attention over scattered slots (``decode_attention``) against torch's fused attention
    (``scaled_dot_product_attention``) over the same live tokens stored densely ``[B, KV heads, n, D]``, fp16, on a
    GPU: per (context, batch), the mean ms of each (CUDA events; each call captured in a CUDA graph where that
    works, so host overhead is not timed) and their ratio. A request's slots are a random draw from the whole
    cache (a token's block neighbours belong to other requests or far-off positions: the gather's worst case);
    ``in_order`` times the same kernel with each request's slots consecutive, as a dense layout would hold them.
    Where ``check_agreement``, batch 1's outputs are checked against the reference (V5's bound, on the CPU) first.

    Returns {"device", "dtype", "cases": [{context, batch, splits, gather_ms, in_order_ms, sdpa_ms, ratio,
    in_order_ratio, max_abs_vs_sdpa, timed_with}], "agreement": [{context, max_gap_over_bound}]}; ratio is gather
    time over sdpa time (above 1: slower)."""
    if interpreted():
        raise ConfigError("decode attention benchmark: the kernels run in Triton's interpreter (TRITON_INTERPRET=1); "
                          "timings would be numpy's")
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        raise ConfigError(f"decode attention benchmark: needs a CUDA device (got device={device!r}; "
                          f"torch.cuda.is_available() is {torch.cuda.is_available()})")
    dev = torch.device(device)
    result = {"device": torch.cuda.get_device_name(dev), "dtype": "float16", "cases": [], "agreement": []}
    timer = lambda fn: _cuda_time_ms(fn, dev, iters)  # noqa: E731
    for context in contexts:
        for batch in batches:
            case, check = bench_case(dev, context, batch, heads, kv_heads, head_dim, timer,
                                     check_agreement and batch == 1)
            result["cases"].append(case)
            if check is not None:
                result["agreement"].append({"context": context, "max_gap_over_bound": check})
            torch.cuda.empty_cache()
    return result


def bench_case(device: torch.device, context: int, batch: int, heads: int, kv_heads: int, head_dim: int,
               timer: Timer, check: bool, dtype: torch.dtype = torch.float16,
               block_size: int = 16) -> tuple[dict, float | None]:
    """One (context, batch) of ``benchmark``: its row, and (where ``check``) the largest gap over V5's bound."""
    gen = torch.Generator(device=device).manual_seed(context * 1000 + batch)
    tokens = batch * context
    blocks = -(-tokens // block_size) + 1
    kv = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen, device=device).to(dtype)
    cache = PagedKVCache(gpu_planes("l", kv))
    order = torch.randperm(blocks * block_size, generator=gen, device=device)[:tokens]
    scattered = order.view(batch, context)
    in_order = torch.arange(tokens, device=device).view(batch, context)
    ids = torch.arange(context, device=device).repeat(batch, 1)
    query_pos = torch.full((batch,), context - 1, device=device)
    lengths = torch.full((batch,), context, device=device)
    q = torch.randn(batch, heads, head_dim, generator=gen, device=device).to(dtype)
    scale = head_dim ** -0.5
    splits = default_splits(batch, kv_heads, context, device)
    gather = lambda slots: (lambda: decode_attention(cache, "l", q, slots, ids, query_pos, scale,  # noqa: E731
                                                     splits, lengths))
    out = gather(scattered)()
    gap = None
    if check:
        ref, bound = decode_reference(cache, "l", q, scattered, ids, query_pos, scale)
        gap = float(((out.cpu().double() - ref.double()).abs() / bound).max())
    # dense: each KV head's tokens in logical order; the G query heads of a KV head are G queries of it (decode
    # has no causal mask within a step), so the fused kernel needs no GQA support
    k = cache.read("l.K", scattered.flatten()).view(batch, context, kv_heads, head_dim).transpose(1, 2).contiguous()
    v = cache.read("l.V", scattered.flatten()).view(batch, context, kv_heads, head_dim).transpose(1, 2).contiguous()
    grouped = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    dense = lambda: F.scaled_dot_product_attention(grouped, k, v, scale=scale)  # noqa: E731
    sdpa_out = dense().reshape(batch, heads, head_dim)
    (gather_ms, how), (in_order_ms, how_in_order), (sdpa_ms, how_sdpa) = \
        timer(gather(scattered)), timer(gather(in_order)), timer(dense)
    row = {"context": context, "batch": batch, "splits": splits, "gather_ms": gather_ms, "in_order_ms": in_order_ms,
           "sdpa_ms": sdpa_ms, "ratio": gather_ms / sdpa_ms, "in_order_ratio": in_order_ms / sdpa_ms,
           "max_abs_vs_sdpa": float((out.float() - sdpa_out.float()).abs().max()),
           "timed_with": sorted({how, how_in_order, how_sdpa})}
    return row, gap


def _cuda_time_ms(fn: Callable[[], object], device: torch.device, iters: int) -> tuple[float, str]:
    """Mean ms per call of ``fn`` on ``device``'s current stream, between CUDA events: ``iters`` replays of a CUDA
    graph of one call where capture works, else ``iters`` eager calls (host overhead included)."""
    for _ in range(3):  # compiles, allocator warm-up
        fn()
    torch.cuda.synchronize(device)
    run, how = fn, "cuda graph"
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except RuntimeError as e:  # capture refused: timed eagerly, and said so
        torch.cuda.synchronize(device)
        run, how = fn, f"eager ({str(e).splitlines()[0][:80] if str(e) else 'capture failed'})"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / iters, how
