"""Attention over each request's live slots, read where they lie in a paged KV cache (the gather read path).

Every query of a step at once: a query attends the live tokens of its request at or before it by logical id
(per KV head, its query heads score those keys, take a softmax and sum the values). Decode queries and prefill
chunks are the same call. Implementations of this one function, and the bound on how far they may differ:

  * the kernel (``gather_attention.c``): it reads K and V in place through the planes' strided views, with no
    gathered copy, per (query, KV head) on the OpenMP threads torch uses. The caller may send some queries to
    torch instead (``in_torch``: inside vLLM, the prompt tokens of long prompts, where BLAS wins), which attends
    them in its fused attention (``prefill_attention``, below) where the caller says so (``fused``: inside vLLM,
    prompts past 256 tokens, below which its aligned shapes cost more than they save), else in the reference. Float32 CPU caches whose layout is
    affine per head (every vLLM CPU layout), head sizes a multiple of 8. Built on first use with the C compiler
    (``$CC``, else ``cc``) into ``$VTOKEN_CACHE_DIR`` (else ``~/.cache/vtoken``); ``CC=false`` turns it off.
  * on a GPU cache, the Triton decode kernel (``triton_attention.decode_attention``) for the queries alone in their
    request (decode); prompt chunks run in torch there.
  * the reference, in torch: the queries alone in their request in one batch (one K and one V gather through
    ``PagedKVCache.read``, two batched products), the others request by request. Whatever the kernel does not
    cover (another dtype, device or layout; no compiler) runs here.

``agreement_bound`` is how far two fp32 computations of this attention may differ elementwise; strict verify
runs the reference beside whatever computed a step's attention (the kernel, ``prefill_attention``) and checks the
bound every step (V5, docs/spec.md).

NOTE: all are functions of each request's live tokens in logical order (the order of ``slots``) only, so lazy
compaction stays bit-identical to Naive-Evict on the gather path: the two place the same tokens at different
slots, and the result does not depend on where a token lies.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from vtoken.core.errors import InvalidArgumentError, InvariantViolation

from .kv_cache import PagedKVCache

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gather_attention.c")
FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp")
UNIT_ROUNDOFF = 2.0 ** -24  # fp32
LANES, MAX_D, MAX_G = 8, 512, 64  # gather_attention.c's: head_dim a multiple of LANES, at most MAX_D; at most
                                  # MAX_G query heads per KV head


PAD = torch.iinfo(torch.int64).max  # the logical id of padding: no query attends it
# prefill_attention's call shapes: queries padded to whole blocks of QUERY_BLOCK logical positions (aligned at its
# multiples), keys padded (masked) to a multiple of KEY_BLOCK. Multiples of torch's fused kernel's tiles on CPU
QUERY_BLOCK, KEY_BLOCK = 256, 512


class _Job(ctypes.Structure):  # gather_attention.c's Job, field for field
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("ks", ctypes.c_int64 * 4), ("vs", ctypes.c_int64 * 4),
                ("slots", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("qreq", ctypes.c_void_p),
                ("qpos", ctypes.c_void_p), ("q", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("wrow", ctypes.c_void_p), ("weights", ctypes.c_void_p), ("scratch", ctypes.c_void_p),
                ("R", ctypes.c_int64), ("N", ctypes.c_int64), ("Q", ctypes.c_int64), ("H", ctypes.c_int64),
                ("KVH", ctypes.c_int64), ("D", ctypes.c_int64), ("S", ctypes.c_int64), ("blocks", ctypes.c_int64),
                ("threads", ctypes.c_int64), ("scale", ctypes.c_float)]


@functools.lru_cache(maxsize=1)
def kernel():
    """The compiled kernel's entry point, or None (logged once, with the compiler's first line) when it cannot
    be built. Keyed by the source, the compiler and its flags; written atomically, so processes starting
    together (vLLM's workers) may race to build it."""
    cc = os.environ.get("CC") or "cc"
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + repr((cc, FLAGS, platform.machine())).encode()).hexdigest()[:16]
    where = Path(os.environ.get("VTOKEN_CACHE_DIR") or Path.home() / ".cache" / "vtoken")
    lib = where / f"gather_attention-{key}.so"
    if not lib.exists():
        tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
        try:
            where.mkdir(parents=True, exist_ok=True)
            done = subprocess.run([cc, *FLAGS, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, text=True,
                                  timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("vtoken: gather attention runs in torch: cannot build its kernel (%s)", e)
            return None
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[0]
            log.warning("vtoken: gather attention runs in torch: %s failed to build its kernel: %s", cc, first)
            return None
        os.replace(tmp, lib)
    fn = ctypes.CDLL(str(lib)).vtoken_gather_attention
    fn.argtypes, fn.restype = [ctypes.POINTER(_Job)], ctypes.c_int
    return fn


def attention(cache: PagedKVCache, layer: str, q: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor,
              query_request: torch.Tensor, query_pos: torch.Tensor, scale: float, values: bool = True,
              weights_of: torch.Tensor | None = None, in_torch: torch.Tensor | None = None,
              fused: torch.Tensor | None = None, triton: bool | None = None
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Attention of ``q`` (``[Q, H, D]``) over the live slots of each query's request: (outputs ``[Q, H, D]``, or
    None when not ``values``; the softmax weights ``[len(weights_of), H, N]`` of the queries ``weights_of`` names,
    or None). ``slots``, ``ids``: int64 ``[R, N]``, each row a request's live slots and their logical ids in
    logical order, padded (id ``PAD``); ``query_request``, ``query_pos``: int64 ``[Q]``, each query's row and
    logical position (it attends the ids at or before it). ``in_torch``: bool ``[Q]``, queries torch computes, and
    ``fused`` (bool ``[Q]``, within ``in_torch``) those of them torch's fused attention computes (``prefill_attention``;
    the rest, the reference): the caller's rules, which must not depend on how a request's tokens were chunked or
    cached, or outputs would change with them. Runs the kernel where it applies, else the reference.

    ``triton``: whether the queries alone in their request (decode) and not ``in_torch`` run in the Triton decode
    kernel (``triton_attention.decode_attention``; prompt chunks stay in torch); default: where the cache is on a
    GPU. On the CPU it runs only in Triton's interpreter (the tests')."""
    args = (cache, layer, q, slots, ids, query_request, query_pos, scale, values, weights_of)
    if len(query_request) and not 0 <= int(query_request.min()) <= int(query_request.max()) < slots.shape[0]:
        raise InvalidArgumentError(f"attention of {layer!r}: a query's request is not one of the {slots.shape[0]} "
                                   f"rows")
    torch_part = torch.zeros_like(query_request, dtype=torch.bool) if in_torch is None else in_torch
    if (cache.device.type == "cuda" if triton is None else triton) and values:
        alone = torch.bincount(query_request, minlength=slots.shape[0])[query_request] == 1
        decode = alone & ~torch_part
        if bool(decode.any()):
            fused = torch.zeros_like(decode) if fused is None else fused & torch_part
            return _split(args, ((decode, triton_decode), (fused, prefill_attention),
                                 (torch_part & ~fused, reference_attention), (~decode & ~torch_part, attention)))
    if bool(torch_part.any()):
        fused = torch.zeros_like(torch_part) if fused is None else fused & torch_part
        return _split(args, ((fused, prefill_attention), (torch_part & ~fused, reference_attention),
                             (~torch_part, attention)))
    job = _job(*args)
    if job is None:
        return reference_attention(*args)
    fn, job, out, weights, _alive = job
    code = fn(ctypes.byref(job))
    if code == 1:
        raise InvalidArgumentError(f"attention of {layer!r}: a live slot lies outside the cache's {cache.num_slots} "
                                   f"slots")
    if code == 3:
        raise InvalidArgumentError(f"attention of {layer!r}: a query's request is not one of the {slots.shape[0]} "
                                   f"rows")
    if code != 0:
        raise InvariantViolation("V5", f"attention of {layer!r}: the kernel refused its job (code {code}) after "
                                       f"_job accepted it")
    return out, weights


def _split(args, parts):
    """``attention`` split: ``parts`` pairs a bool ``[Q]`` mask with the function that computes those queries (the
    masks partition the queries); each part computed alone, the results put back in query order."""
    cache, layer, q, slots, ids, query_request, query_pos, scale, values, weights_of = args
    (Q, H, D), N = q.shape, slots.shape[1]
    out = torch.empty(Q, H, D, dtype=q.dtype, device=q.device) if values else None
    weights = None if weights_of is None else torch.empty(len(weights_of), H, N, dtype=q.dtype, device=q.device)
    for rows, run in ((mask.nonzero().flatten(), run) for mask, run in parts):
        if not len(rows):
            continue
        mine = None if weights_of is None else torch.isin(weights_of, rows)
        local = None if weights_of is None else torch.searchsorted(rows, weights_of[mine])
        o, w = run(cache, layer, q[rows], slots, ids, query_request[rows], query_pos[rows], scale, values, local)
        if values:
            out[rows] = o
        if weights_of is not None:
            weights[mine] = w
    return out, weights


def triton_decode(cache: PagedKVCache, layer: str, q: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor,
                  query_request: torch.Tensor, query_pos: torch.Tensor, scale: float, values: bool = True,
                  weights_of: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``attention`` of queries each alone in its request, in the Triton decode kernel: each query's request's
    slot row handed to it as its own row. The weights asked for are the reference's (the kernel keeps none: an
    online softmax). Imported here, not above: Triton is loaded only where a GPU (or a test) asks for it."""
    from .triton_attention import decode_attention
    rows = query_request
    out = decode_attention(cache, layer, q, slots[rows], ids[rows], query_pos, scale) if values else None
    weights = None
    if weights_of is not None:
        weights = reference_attention(cache, layer, q[weights_of], slots, ids, query_request[weights_of],
                                      query_pos[weights_of], scale, False, torch.arange(len(weights_of), device=q.device))[1]
    return out, weights


def prefill_attention(cache: PagedKVCache, layer: str, q: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor,
                      query_request: torch.Tensor, query_pos: torch.Tensor, scale: float, values: bool = True,
                      weights_of: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``attention`` for prompt chunks, request by request, in torch's fused attention (``scaled_dot_product_attention``:
    tiled, an online softmax, no ``[H, m, n]`` score matrix). Its fast path beside ``reference_attention``: about
    2.7x faster on a 1,536-token prompt, within ``agreement_bound`` of it (V5 checks this every step under strict
    verify). The weights asked for (one row per scored request) are the reference's.

    NOTE: how a prompt is chunked must not change a query's result (prefix caching on and off stay bit-identical on
    the gather path). The fused kernel's arithmetic for a row depends on the shapes of the call (its tiles), so
    every call has aligned shapes: the queries placed in whole QUERY_BLOCKs of logical positions, the keys padded
    (masked) to a multiple of KEY_BLOCK. ``tests/test_gather_attention.py`` checks it on the pinned torch, and that
    it fails without the alignment."""
    (R, N), (Q, H, D) = slots.shape, q.shape
    out = torch.empty(Q, H, D, dtype=q.dtype, device=q.device) if values else None
    lengths = (ids != PAD).sum(dim=1)
    for r in (torch.unique(query_request).tolist() if values else []):
        rows = (query_request == r).nonzero().flatten()
        pos = query_pos[rows]
        lo = int(pos.min()) // QUERY_BLOCK * QUERY_BLOCK
        hi = -(-(int(pos.max()) + 1) // QUERY_BLOCK) * QUERY_BLOCK
        n = int(lengths[r])
        width = -(-n // KEY_BLOCK) * KEY_BLOCK
        k = cache.read(f"{layer}.K", slots[r, :n])
        kvh = k.shape[1] // D
        keys, vals = (torch.zeros(width, kvh, D, dtype=q.dtype, device=q.device) for _ in range(2))
        keys[:n] = k.view(n, kvh, D)
        vals[:n] = cache.read(f"{layer}.V", slots[r, :n]).view(n, kvh, D)
        key_ids = torch.full((width,), PAD, dtype=torch.int64, device=q.device)
        key_ids[:n] = ids[r, :n]
        queries = torch.zeros(hi - lo, H, D, dtype=q.dtype, device=q.device)  # rows no query fills attend too, and are dropped
        queries[pos - lo] = q[rows]
        seen = key_ids.view(1, -1) <= torch.arange(lo, hi, device=q.device).view(-1, 1)  # causal by logical id; padding never
        o = F.scaled_dot_product_attention(queries.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                                           vals.transpose(0, 1).unsqueeze(0), attn_mask=seen, scale=scale,
                                           enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)[pos - lo]
    weights = None
    if weights_of is not None:
        weights = reference_attention(cache, layer, q[weights_of], slots, ids, query_request[weights_of],
                                      query_pos[weights_of], scale, False, torch.arange(len(weights_of), device=q.device))[1]
    return out, weights


def _job(cache, layer, q, slots, ids, query_request, query_pos, scale, values, weights_of):
    """The kernel and its arguments (and the tensors they point into, kept alive), or None where it does not
    apply."""
    (R, N), (Q, H, D) = slots.shape, q.shape
    k, v = cache.heads_view(f"{layer}.K", D), cache.heads_view(f"{layer}.V", D)
    if k is None or v is None or k.dtype != torch.float32 or v.dtype != torch.float32 or k.device.type != "cpu" \
            or D % LANES or D > MAX_D or H % k.shape[2] or H // k.shape[2] > MAX_G:
        return None
    fn = kernel()
    if fn is None:
        return None
    threads = torch.get_num_threads()
    q = q.to(torch.float32).contiguous()
    slots, ids = slots.to(torch.int64).contiguous(), ids.to(torch.int64).contiguous()
    qreq, qpos = query_request.to(torch.int64).contiguous(), query_pos.to(torch.int64).contiguous()
    out = torch.empty(Q, H, D) if values else None
    weights = wrow = None
    if weights_of is not None:
        weights = torch.empty(len(weights_of), H, N)
        wrow = torch.full((Q,), -1, dtype=torch.int64)
        wrow[weights_of] = torch.arange(len(weights_of))
    scratch = torch.empty(threads, H // k.shape[2], N)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    job = _Job(k.data_ptr(), v.data_ptr(), (ctypes.c_int64 * 4)(*k.stride()), (ctypes.c_int64 * 4)(*v.stride()),
               slots.data_ptr(), ids.data_ptr(), qreq.data_ptr(), qpos.data_ptr(), q.data_ptr(), ptr(out),
               ptr(wrow), ptr(weights), scratch.data_ptr(), R, N, Q, H, k.shape[2], D, cache.block_size,
               k.shape[0], threads, scale)
    return fn, job, out, weights, (q, slots, ids, qreq, qpos, wrow, scratch, k, v)


def reference_attention(cache: PagedKVCache, layer: str, q: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor,
                        query_request: torch.Tensor, query_pos: torch.Tensor, scale: float, values: bool = True,
                        weights_of: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``attention`` in torch: the queries alone in their request (decode) in one batch, one K (and V) gather of
    their requests' slots and one batched product each; the others (prefill chunks) request by request."""
    (R, N), (Q, H, D) = slots.shape, q.shape
    out = torch.empty(Q, H, D, dtype=q.dtype, device=q.device) if values else None
    weights = wrow = None
    if weights_of is not None:  # only the weights asked for are kept: a long chunk's would be [Q, H, N]
        weights = torch.zeros(len(weights_of), H, N, dtype=q.dtype, device=q.device)
        wrow = torch.full((Q,), -1, dtype=torch.int64, device=q.device)
        wrow[weights_of] = torch.arange(len(weights_of), device=q.device)
    counts = torch.bincount(query_request, minlength=R)
    alone = (counts[query_request] == 1).nonzero().flatten()
    groups = [alone] if len(alone) else []
    groups += [(query_request == r).nonzero().flatten() for r in (counts > 1).nonzero().flatten().tolist()]
    lengths = (ids != PAD).sum(dim=1)
    for rows in groups:
        reqs = query_request[rows]
        one = len(rows) > 1 and bool((reqs == reqs[0]).all())  # one request's queries: read its own slots once
        n = int(lengths[reqs[0]]) if one else N
        reqs = reqs[:1] if one else reqs
        k = cache.read(f"{layer}.K", slots[reqs, :n].flatten())
        kvh = k.shape[1] // D
        k = k.view(len(reqs), n, kvh, D)
        seen = ids[reqs, :n] <= query_pos[rows].view(-1, 1)  # [rows or 1, n]: causal by logical id; padding never
        if one:  # heads side by side ("hmn"): measured faster than grouping by KV head for long chunks
            k = k[0].repeat_interleave(H // kvh, dim=1)
            s = torch.einsum("mhd,nhd->hmn", q[rows], k) * scale
            s.masked_fill_(~seen.view(1, -1, n), float("-inf"))
            w = torch.softmax(s, dim=-1)
            per_query = w.permute(1, 0, 2)
        else:
            qg = q[rows].reshape(len(rows), kvh, H // kvh, D)  # heads grouped by their KV head (GQA)
            s = torch.einsum("rkgd,rnkd->rkgn", qg, k) * scale
            s.masked_fill_(~seen.view(-1, 1, 1, n), float("-inf"))
            w = torch.softmax(s, dim=-1)
            per_query = w.reshape(len(rows), H, n)
        if weights is not None:
            kept = wrow[rows]
            weights[kept[kept >= 0], :, :n] = per_query[kept >= 0]
        if values:
            v = cache.read(f"{layer}.V", slots[reqs, :n].flatten()).view(len(reqs), n, kvh, D)
            if one:
                out[rows] = torch.einsum("hmn,nhd->mhd", w, v[0].repeat_interleave(H // kvh, dim=1))
            else:
                out[rows] = torch.einsum("rkgn,rnkd->rkgd", w, v).reshape(len(rows), H, D)
    return out, weights


def agreement_bound(cache: PagedKVCache, layer: str, q: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor,
                    query_request: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query and head ``[Q, H]``, how far two fp32 computations of ``attention`` may differ: (on an output
    element, on a weight). First-order, with u = 2^-24 and gamma_n = n u / (1 - n u):

      * a score s_n = scale * q . k_n, summed in any order, is off by at most delta = gamma_(D+1) scale
        sum_d |q_d k_nd| <= gamma_(D+1) scale ||q|| max_n ||k_n|| (Cauchy-Schwarz; the + 1: the scale's rounding);
      * exp, the shift by the maximum and the normalisation add a few u per weight; with the scores off by at
        most delta, every weight w_n is off by at most w_n (2 delta + 4 u + gamma_N): the weight bound is that
        with w_n <= 1;
      * an output sum_n w_n v_n is off by at most sum_n |dw_n| |v_n| + gamma_N sum_n w_n |v_n|
        <= (2 delta + 4 u + 2 gamma_N) max_n |v_n|.

    The maxima run over the request's live tokens (a query attends a subset). It is stated, not proved: what
    strict verify (V5) and the tests compare the kernel against the reference with."""
    (R, N), (Q, H, D) = slots.shape, q.shape
    live = (ids != PAD).view(R, N, 1)
    k = cache.read(f"{layer}.K", slots.flatten()).view(R, N, -1, D).to(torch.float64)
    kvh = k.shape[2]
    kmax = k.norm(dim=-1).masked_fill(~live, 0).amax(dim=1)  # [R, kvh]
    vmax = cache.read(f"{layer}.V", slots.flatten()).view(R, N, kvh, D).abs().amax(-1).masked_fill(~live, 0).amax(1)
    per_head = lambda t: t[query_request].repeat_interleave(H // kvh, dim=1)  # noqa: E731  [Q, H]
    gamma = lambda n: n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)  # noqa: E731
    delta = gamma(D + 1) * abs(scale) * q.to(torch.float64).norm(dim=-1) * per_head(kmax)
    weight = 2 * delta + 4 * UNIT_ROUNDOFF + gamma(N)
    return (weight + gamma(N)) * per_head(vmax.to(torch.float64)), weight


def check_agreement(cache: PagedKVCache, layer: str, q: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor,
                    query_request: torch.Tensor, query_pos: torch.Tensor, scale: float,
                    got: tuple[torch.Tensor | None, torch.Tensor | None], weights_of: torch.Tensor | None,
                    names: list[str]) -> None:
    """V5: ``got`` (``attention``'s result for these arguments) against the reference, within ``agreement_bound``,
    per query; ``names``: the requests' ids (rows of ``slots``), for the message."""
    ref_out, ref_w = reference_attention(cache, layer, q, slots, ids, query_request, query_pos, scale,
                                         got[0] is not None, weights_of)
    out_bound, w_bound = agreement_bound(cache, layer, q, slots, ids, query_request, scale)
    bad = torch.zeros(q.shape[0], dtype=torch.bool)
    err_o = torch.zeros(q.shape[0], dtype=torch.float64)
    err_w = torch.zeros(q.shape[0], dtype=torch.float64)
    if got[0] is not None:
        gap = (got[0] - ref_out).abs().to(torch.float64)
        bad |= (gap > out_bound.unsqueeze(-1)).flatten(1).any(dim=1)
        err_o = gap.flatten(1).amax(dim=1)
    if weights_of is not None:
        gap = (got[1] - ref_w).abs().to(torch.float64)
        bad[weights_of] |= (gap > w_bound[weights_of].unsqueeze(-1)).flatten(1).any(dim=1)
        err_w[weights_of] = gap.flatten(1).amax(dim=1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise InvariantViolation("V5", f"request {names[int(query_request[i])]!r}, layer {layer!r}: attention differs "
                                       f"from the reference by {float(err_o[i]):.3g} in an output and "
                                       f"{float(err_w[i]):.3g} in a weight, past the fp32 bound "
                                       f"({float(out_bound[i].max()):.3g}, {float(w_bound[i].max()):.3g})")
