"""The gather read path's attention (integration/device/gather_attention.py): the C kernel that reads K and V in
place against the torch reference, on every KV layout vLLM uses (its CPU layout with K stored dim-major, the GPU
layouts, stacked MQA), with GQA, for decode queries and prefill chunks in one batch; within the fp32
``agreement_bound`` (V5), and bit for bit wherever the same tokens lie at other slots (what keeps compact
bit-identical to Naive-Evict)."""
from __future__ import annotations

import pytest
import torch

from vtoken.core.errors import InvalidArgumentError, InvariantViolation
from vtoken.integration.device import gather_attention as GA
from vtoken.integration.device.kv_cache import PagedKVCache
from vtoken.integration.device.kv_layout import LayoutError, cpu_plane, gpu_planes

NB, S = 12, 16


def caches(kvh: int, d: int, dtype=torch.float32, seed: int = 0) -> list[tuple[str, PagedKVCache]]:
    """One layer "l" per layout, random K/V: vLLM's CPU layout, the GPU (K, V) pair, the stacked GPU layout."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(shape, generator=g).to(dtype)  # noqa: E731
    return [("cpu", PagedKVCache([cpu_plane("l", r(NB, kvh, S, 2 * d))])),
            ("gpu pair", PagedKVCache(gpu_planes("l", (r(NB, S, kvh, d), r(NB, S, kvh, d))))),
            ("gpu stacked", PagedKVCache(gpu_planes("l", r(2, NB, S, kvh, d))))]


def batch(seed: int, R: int = 5, H: int = 8, d: int = 32, chunks: tuple = (0, 3)):
    """R requests, each with its own live slots (holes in its ids, blocks in any order), padded to the longest;
    the last has one live token. Requests ``chunks`` are prefill chunks: their last 4 (or fewer) tokens are
    queries, the others' newest token is. Returns (q, slots, ids, query_request, query_pos)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NB * S, generator=g)
    lengths = [int(x) for x in torch.randint(2, 2 * S + 5, (R - 1,), generator=g)] + [1]
    N = max(lengths)
    slots, ids, at = torch.zeros(R, N, dtype=torch.int64), torch.full((R, N), GA.PAD), 0
    qreq, qpos = [], []
    for r, n in enumerate(lengths):
        slots[r, :n] = perm[at:at + n]
        at += n
        ids[r, :n] = torch.sort(torch.randperm(3 * n, generator=g)[:n]).values  # ascending, with holes
        for t in ids[r, max(0, n - 4):n].tolist() if r in chunks else [int(ids[r, n - 1])]:
            qreq.append(r)
            qpos.append(t)
    return torch.randn(len(qreq), H, d, generator=g), slots, ids, torch.tensor(qreq), torch.tensor(qpos)


@pytest.fixture(scope="module")
def built():
    fn = GA.kernel()
    assert fn is not None, "the gather kernel did not build: is a C compiler (cc, or $CC) on PATH?"
    return fn


@pytest.mark.parametrize("heads, kvh, d", [(4, 2, 32), (8, 1, 64), (8, 8, 16), (16, 2, 128)])
def test_the_kernel_agrees_with_the_reference_within_the_fp32_bound_on_every_layout(built, heads, kvh, d):
    for seed in range(3):
        q, slots, ids, qreq, qpos = batch(seed, H=heads, d=d)
        Q = len(qreq)
        every = torch.arange(Q)
        for layout, cache in caches(kvh, d, seed=seed):
            args = (cache, "l", q, slots, ids, qreq, qpos, d ** -0.5)
            assert GA._job(*args, True, every) is not None, layout  # the kernel runs
            out, w = GA.attention(*args, True, every)
            ref_out, ref_w = GA.reference_attention(*args, True, every)
            ob, wb = GA.agreement_bound(cache, "l", q, slots, ids, qreq, d ** -0.5)
            assert out.shape == ref_out.shape == (Q, heads, d) and w.shape == ref_w.shape == (Q, heads, slots.shape[1])
            assert bool(((out - ref_out).abs() <= ob.unsqueeze(-1)).all()), layout
            assert bool(((w - ref_w).abs() <= wb.unsqueeze(-1)).all()), layout
            assert float(ob.max()) < 1e-2 * float(out.abs().max()) and float(wb.max()) < 1e-3  # not a blanket
            attended = ids[qreq] <= qpos.view(-1, 1)
            assert bool((w.permute(0, 2, 1)[~attended] == 0).all())  # causal by logical id; padding weighs nothing
            assert bool((w.permute(0, 2, 1)[attended] > 0).all())
            assert torch.allclose(w.sum(-1), torch.ones(Q, heads), atol=1e-6)
            GA.check_agreement(*args, (out, w), every, [f"r{i}" for i in range(5)])


def test_the_kernel_and_the_reference_differ_in_their_rounding_so_the_bound_is_what_is_compared(built):
    """Summed in other orders, the two are not bit-identical (here, on some element): equality would be the
    wrong check, and the bound is what V5 compares."""
    q, slots, ids, qreq, qpos = batch(1, R=8, H=8, d=64)
    _, cache = caches(2, 64, seed=1)[0]
    out, _ = GA.attention(cache, "l", q, slots, ids, qreq, qpos, 0.125)
    ref, _ = GA.reference_attention(cache, "l", q, slots, ids, qreq, qpos, 0.125)
    assert not torch.equal(out, ref) and torch.allclose(out, ref, atol=1e-5)


def test_the_result_depends_on_the_tokens_in_logical_order_not_on_their_slots_or_the_padding(built):
    """The NOTE compact's bit-identity rests on: the same tokens' K/V at other slots (another block, another
    offset), their request in another row, with more padding, give bit-identical outputs and weights."""
    q, slots, ids, qreq, qpos = batch(2, R=4, H=4, d=32)
    _, cache = caches(2, 32, seed=2)[0]
    every = torch.arange(len(qreq))
    out, w = GA.attention(cache, "l", q, slots, ids, qreq, qpos, 0.2, True, every)
    moved = torch.randperm(NB * S, generator=torch.Generator().manual_seed(9))
    other = PagedKVCache([cpu_plane("l", torch.zeros(NB, 2, S, 64))])
    live = slots[ids != GA.PAD]
    for plane in ("l.K", "l.V"):
        other.write(plane, moved[live], cache.read(plane, live))
    order = torch.tensor([3, 1, 0, 2])  # request r is row where(order == r) now
    row_of = torch.argsort(order)
    padded = lambda t, v: torch.cat([t, torch.full((4, 7), v)], 1)[order]  # noqa: E731
    out2, w2 = GA.attention(other, "l", q, padded(torch.where(ids != GA.PAD, moved[slots], 0), 0),
                            padded(ids, GA.PAD), row_of[qreq], qpos, 0.2, True, every)
    assert torch.equal(out2, out) and torch.equal(w2[:, :, :slots.shape[1]], w)


def test_weights_of_some_queries_only_and_no_values(built):
    q, slots, ids, qreq, qpos = batch(3)
    _, cache = caches(2, 32, seed=3)[0]
    every = torch.arange(len(qreq))
    out, w = GA.attention(cache, "l", q, slots, ids, qreq, qpos, 0.3, True, every)
    some = torch.tensor([len(qreq) - 1, 0])
    none, w2 = GA.attention(cache, "l", q, slots, ids, qreq, qpos, 0.3, False, some)
    assert none is None and torch.equal(w2, w[some])
    out3, nothing = GA.attention(cache, "l", q, slots, ids, qreq, qpos, 0.3)
    assert nothing is None and torch.equal(out3, out)


def test_a_live_slot_outside_the_cache_or_a_query_without_a_request_is_refused_before_anything_is_read(built):
    q, slots, ids, qreq, qpos = batch(4)
    _, cache = caches(2, 32)[0]
    bad = slots.clone()
    bad[1, 0] = NB * S  # one past the end
    with pytest.raises(InvalidArgumentError, match=r"a live slot lies outside the cache's 192 slots"):
        GA.attention(cache, "l", q, bad, ids, qreq, qpos, 0.3)
    with pytest.raises(InvalidArgumentError, match=r"a query's request is not one of the 5 rows"):
        GA.attention(cache, "l", q, slots, ids, torch.where(qreq == 4, 5, qreq), qpos, 0.3)
    pad_at = (ids == GA.PAD).nonzero()[0]  # a padding entry is never read: any slot will do
    bad = slots.clone()
    bad[pad_at[0], pad_at[1]] = -1
    GA.attention(cache, "l", q, bad, ids, qreq, qpos, 0.3)


def test_what_the_kernel_does_not_cover_runs_in_torch():
    """Another dtype (here float64; bfloat16 in vLLM's CPU layout likewise), or a head size that is not a
    multiple of the kernel's 8 partial sums: the reference runs, and gives its own result exactly."""
    for kvh, d, dtype in ((2, 32, torch.float64), (2, 12, torch.float32)):
        q, slots, ids, qreq, qpos = batch(5, H=4, d=d)
        for layout, cache in caches(kvh, d, dtype=dtype, seed=5):
            args = (cache, "l", q.to(dtype), slots, ids, qreq, qpos, 0.3)
            assert GA._job(*args, True, None) is None, layout
            assert all(torch.equal(a, b) for a, b in zip(GA.attention(*args, True, qreq[:2]),
                                                         GA.reference_attention(*args, True, qreq[:2])))


def test_v5_names_the_request_and_layer_where_an_attention_is_wrong(built):
    """The teeth of strict verify's V5: one query that does not attend its own token (the bug of a kernel
    that stops a key early) is past the bound, and the message names its request."""
    q, slots, ids, qreq, qpos = batch(6)
    _, cache = caches(2, 32, seed=6)[0]
    early = qpos.clone()
    i = int((qreq == 2).nonzero()[-1])
    early[i] -= 1
    wrong = GA.attention(cache, "l", q, slots, ids, qreq, early, 0.3)
    with pytest.raises(InvariantViolation, match=r"V5: request 'c', layer 'l': attention differs from the reference"):
        GA.check_agreement(cache, "l", q, slots, ids, qreq, qpos, 0.3, wrong, None, list("abcde"))


def test_a_head_view_reads_what_read_reads_on_every_layout():
    for layout, cache in caches(3, 16, seed=7):
        for plane in ("l.K", "l.V"):
            view = cache.heads_view(plane, 16)
            slots = torch.arange(0, NB * S, 5)
            assert view is not None and tuple(view.shape) == (NB, S, 3, 16), layout
            assert torch.equal(view[slots // S, slots % S].reshape(len(slots), -1), cache.read(plane, slots)), layout
        assert cache.heads_view("l.K", 5) is None  # 48 elements are not heads of 5


def test_a_compiler_that_fails_leaves_the_reference_in_charge(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("VTOKEN_CACHE_DIR", str(tmp_path))
    GA.kernel.cache_clear()
    try:
        assert GA.kernel() is None
        assert "gather attention runs in torch: false failed to build its kernel" in caplog.text
        q, slots, ids, qreq, qpos = batch(7)
        _, cache = caches(2, 32)[0]
        assert GA._job(cache, "l", q, slots, ids, qreq, qpos, 0.3, True, None) is None
    finally:
        GA.kernel.cache_clear()


def test_the_queries_a_caller_sends_to_torch_run_there_and_the_others_in_the_kernel(built):
    """``in_torch`` (inside vLLM: the prompt tokens of long prompts) go to torch: the ``fused`` ones (prompts past
    FUSED_PROMPT) to ``prefill_attention``, the others to the reference; the rest still go to the kernel. The
    result, weights included, is each part's own, in query order."""
    q, slots, ids, qreq, qpos = batch(1, R=4, H=4, d=32, chunks=(0, 3))
    _, cache = caches(2, 32, seed=8)[0]
    every = torch.arange(len(qreq))
    in_torch, fused = (qreq == 0) | (qreq == 3), qreq == 0  # request 0's chunk fused, request 3's in the reference
    assert 1 < int(fused.sum()) < int(in_torch.sum()) < len(qreq)
    out, w = GA.attention(cache, "l", q, slots, ids, qreq, qpos, 0.2, True, every, in_torch, fused)
    ref, ref_w = GA.reference_attention(cache, "l", q, slots, ids, qreq, qpos, 0.2, True, every)
    mine, mine_w = GA.prefill_attention(cache, "l", q[fused], slots, ids, qreq[fused], qpos[fused], 0.2,
                                        True, torch.arange(int(fused.sum())))
    assert torch.equal(out[fused], mine) and torch.equal(w[fused], mine_w)
    assert not torch.equal(out[fused], ref[fused])  # another computation than the reference's
    plain = in_torch & ~fused
    assert torch.equal(out[plain], ref[plain]) and torch.equal(w[plain], ref_w[plain])
    assert torch.equal(w[in_torch], ref_w[in_torch])  # the weights asked for are the reference's
    assert torch.equal(GA.attention(cache, "l", q, slots, ids, qreq, qpos, 0.2, True, every, in_torch)[0][in_torch],
                       ref[in_torch])  # fused not given: torch's queries all in the reference
    GA.check_agreement(cache, "l", q, slots, ids, qreq, qpos, 0.2, (out, w), every, [f"r{i}" for i in range(4)])
    rest = ~in_torch
    alone, alone_w = GA.attention(cache, "l", q[rest], slots, ids, qreq[rest], qpos[rest], 0.2, True,
                                  torch.arange(int(rest.sum())))
    assert torch.equal(out[rest], alone) and torch.equal(w[rest], alone_w)  # the kernel's, as if alone
    assert not torch.equal(out[rest], ref[rest])
    assert torch.equal(GA.attention(cache, "l", q, slots, ids, qreq, qpos, 0.2, True, None,
                                    torch.zeros(len(qreq), dtype=torch.bool))[0],
                       GA.attention(cache, "l", q, slots, ids, qreq, qpos, 0.2)[0])  # none sent: all in the kernel


def test_a_head_view_is_computed_once_and_bad_arguments_are_refused_or_declined():
    _, cache = caches(2, 16)[0]
    assert cache.heads_view("l.K", 16) is cache.heads_view("l.K", 16)  # every layer of every step: cached
    assert cache.heads_view("l.K", 0) is None and cache.heads_view("l.K", True) is None
    with pytest.raises(LayoutError, match=r"a plane name must be a string"):
        cache.heads_view(["l.K"], 16)
    with pytest.raises(LayoutError, match=r"no plane 'l.Q'"):
        cache.heads_view("l.Q", 16)


@pytest.mark.parametrize("heads, kvh, d", [(4, 2, 32), (8, 1, 64), (8, 8, 16)])
def test_prefill_attention_agrees_with_the_reference_within_the_fp32_bound(heads, kvh, d):
    """torch's fused attention (the fast path for long prompts' tokens) against the reference, on every layout,
    prefill chunks and decode queries of requests with holes in their ids, GQA included; its weights are the
    reference's, bit for bit."""
    for seed in range(3):
        q, slots, ids, qreq, qpos = batch(seed, H=heads, d=d, chunks=(0, 1, 3))
        every = torch.arange(len(qreq))
        for layout, cache in caches(kvh, d, seed=seed):
            args = (cache, "l", q, slots, ids, qreq, qpos, d ** -0.5)
            out, w = GA.prefill_attention(*args, True, every)
            ref, ref_w = GA.reference_attention(*args, True, every)
            ob, _ = GA.agreement_bound(cache, "l", q, slots, ids, qreq, d ** -0.5)
            assert bool(((out - ref).abs() <= ob.unsqueeze(-1)).all()), layout
            assert float((out - ref).abs().max()) > 0 or seed, layout  # another computation, not the reference
            assert torch.equal(w, ref_w), layout
            GA.check_agreement(*args, (out, w), every, [f"r{i}" for i in range(5)])
            assert GA.prefill_attention(*args, False, every)[0] is None


def long_prompt(L: int, seed: int, heads: int = 4, kvh: int = 2, d: int = 32):
    """A cache holding one request's L prompt tokens at scattered slots, with some evicted (holes in its ids), and
    a query per live token: (cache, q, slots, ids)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-2 * L // S)
    cache = PagedKVCache([cpu_plane("l", torch.randn(blocks, kvh, S, 2 * d, generator=g))])
    live = torch.sort(torch.randperm(2 * L, generator=g)[:L]).values  # L live ids of 2L: holes everywhere
    slots = torch.randperm(blocks * S, generator=g)[:L]
    return cache, torch.randn(L, heads, d, generator=g), slots.view(1, L), live.view(1, L)


@pytest.mark.parametrize("cuts", [(700,), (1,), (255, 256), (257, 511, 513), (1000, 1001), (1199,)])
def test_how_a_prompt_is_chunked_does_not_change_prefill_attention_by_a_bit(cuts):
    """A chunk's queries attend the tokens live so far: computed as one chunk or as several, every query's output
    is the same to the bit (what keeps prefix caching on and off bit-identical on the gather path)."""
    L = 1200
    cache, q, slots, ids = long_prompt(L, seed=len(cuts))
    one = torch.zeros(L, dtype=torch.int64)
    whole = GA.prefill_attention(cache, "l", q, slots, ids, one, ids[0], 0.17)[0]
    parts, start = [], 0
    for end in cuts + (L,):
        rows = torch.arange(start, end)  # the chunk's queries; the keys: the tokens before its end
        n = end
        parts.append(GA.prefill_attention(cache, "l", q[rows], slots[:, :n], ids[:, :n], one[rows], ids[0, rows],
                                          0.17)[0])
        start = end
    assert torch.equal(torch.cat(parts), whole)


def test_without_the_aligned_shapes_chunking_changes_prefill_attention(monkeypatch):
    """The alignment has teeth: with unpadded shapes (blocks of one) the fused kernel rounds some query differently
    when its prompt is chunked elsewhere."""
    monkeypatch.setattr(GA, "QUERY_BLOCK", 1)
    monkeypatch.setattr(GA, "KEY_BLOCK", 1)
    L = 1200
    cache, q, slots, ids = long_prompt(L, seed=1)
    one = torch.zeros(L, dtype=torch.int64)
    whole = GA.prefill_attention(cache, "l", q, slots, ids, one, ids[0], 0.17)[0]
    differs = 0
    for cut in (257, 511, 513, 700, 1199):
        head = GA.prefill_attention(cache, "l", q[:cut], slots[:, :cut], ids[:, :cut], one[:cut], ids[0, :cut], 0.17)[0]
        tail = GA.prefill_attention(cache, "l", q[cut:], slots, ids, one[cut:], ids[0, cut:], 0.17)[0]
        differs += not torch.equal(torch.cat([head, tail]), whole)
    assert differs
