"""The torch device layer on the CPU: layouts, batched out-of-place moves, strict verify."""

from __future__ import annotations

import json
import random
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.core.block_pool import BlockPool, Purpose
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.errors import BlockOutOfRangeError, DestinationError, MoveSourceMismatchError, TokenOutOfRangeError
from vtoken.core.plan import PlanKind
from vtoken.core.reclamation import ReclaimConfig, ReclamationManager
from vtoken.core.token_table import Move, TokenTable
from vtoken.integration.device.copy_engine import TorchCopyEngine
from vtoken.integration.device.kv_cache import PagedKVCache
from vtoken.integration.device.kv_layout import (LayoutError, cpu_plane, default_cpu_block_order, gpu_planes,
                                          probe_block_order)
from vtoken.integration.device.tensor_tags import TORN, TensorTagStore
from vtoken.integration.device.verify import RelocationMismatch, Verifier, VerifyConfig

NB, S, H, D = 8, 4, 2, 3
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def fp8_dtypes():
    out = []
    for name in ("float8_e4m3fn", "float8_e5m2"):
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        try:  # the ops the engine needs must exist for the dtype on this build
            t = torch.zeros(8, dtype=dt)
            t[torch.tensor([1])] = t[torch.tensor([2])]
            t.view(torch.int8)
        except (RuntimeError, TypeError):
            continue
        out.append(dt)
    return out


def rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype) if dtype.is_floating_point and dtype.itemsize > 1 else \
        torch.randint(-100, 100, shape, generator=gen).to(torch.float32).div(8).to(dtype)


def random_copies(rng: random.Random, requests: int = 4) -> list:
    """A step's copies for a ``mixed_cache``: up to ``requests`` requests, each up to 6 moves to distinct destinations
    (a destination may be a source of the same copy: a cycle); copies may read or write what earlier ones write
    (new waves). The movers' tests (compiled, Triton) compare against the torch path with these."""
    copies = []
    for r in range(rng.randint(1, requests)):
        dsts = rng.sample(range(NB * S), rng.randint(0, 6))
        moves = [Move(i, *divmod(rng.randrange(NB * S), S), *divmod(d, S)) for i, d in enumerate(dsts)]
        copies.append((moves, f"r{r}"))
    return copies


def mixed_cache(dtype=torch.float32, seed=0, shared=False):
    """Three layers in the three layouts (plus a fourth sharing layer 0's buffers if ``shared``)."""
    gen = torch.Generator().manual_seed(seed)
    k0, v0 = rand((NB, S, H, D), dtype, gen), rand((NB, S, H, D), dtype, gen)
    stacked = rand((2, NB, S, 1, D), dtype, gen)  # MQA: one KV head
    cpu = rand((NB, H, S, 2 * D), dtype, gen)
    planes = gpu_planes("l0", (k0, v0)) + gpu_planes("l1", stacked) + [cpu_plane("l2", cpu)]
    if shared:
        planes += gpu_planes("l3", (k0, v0))
    return PagedKVCache(planes), (k0, v0, stacked, cpu)


def snapshot(cache):
    return {n: cache.read(n, torch.arange(NB * S)).clone() for n in cache.plane_names()}


# ---- layouts -------------------------------------------------------------------------------------------
def test_each_layout_puts_a_token_where_vllm_does():
    cache, (k0, v0, stacked, cpu) = mixed_cache()
    slot = torch.tensor([5 * S + 2])
    for name in cache.plane_names():
        h = 1 if name.startswith("l1") else H
        cache.write(name, slot, torch.arange(h * D, dtype=torch.float32).view(1, -1) + 100)
    want = torch.arange(H * D, dtype=torch.float32).view(H, D) + 100
    assert torch.equal(k0[5, 2], want) and torch.equal(v0[5, 2], want)
    assert torch.equal(stacked[0, 5, 2], want[:1]) and torch.equal(stacked[1, 5, 2], want[:1])
    cpu_rows = cpu.view(NB, H, 2 * S, D)  # vLLM's view: K rows [0, S) (stored dim-major), V rows [S, 2S)
    assert torch.equal(cpu_rows[5, :, :S].reshape(H, D * S)[:, 2::S], want)
    assert torch.equal(cpu_rows[5, :, S + 2], want)
    assert cache.bytes_per_token == (2 * H * D + 2 * D + 2 * H * D) * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_read_through_the_strided_view_equals_the_element_by_element_read(dtype):
    """``read`` goes through a plane's strided view (two indices per token) where its layout is affine, which
    every layout here is (vLLM's GPU layouts, stacked MQA, vLLM's CPU layout with K stored dim-major); the
    gather path's attention reads through it every layer. It must give exactly what gathering each element
    gives, and a slot past the cache still raises."""
    cache, _ = mixed_cache(dtype, seed=3)
    slots = torch.randperm(NB * S, generator=torch.Generator().manual_seed(1))[: NB * S // 2]
    for name in cache.plane_names():
        g, a, b = cache.segment(name)
        assert g.strided(a, b) is not None, name
        assert torch.equal(cache.read(name, slots), g.flat[g.index(slots, S, a, b)]), name
    with pytest.raises(BlockOutOfRangeError):
        cache.read("l2.K", torch.tensor([NB * S]))


@pytest.mark.parametrize("dtype", DTYPES + fp8_dtypes())
def test_moves_through_token_views_equal_moves_through_rows(dtype):
    """A move (``gather`` + ``scatter``) goes through a group's strided token views where its rows are short
    (vLLM's CPU layout: K stored dim-major, runs of one element) and through rows of ``run`` elements elsewhere.
    The row move is the reference: forced on a second cache, both must move the same bits."""
    fast, _ = mixed_cache(dtype, seed=3)
    ref, _ = mixed_cache(dtype, seed=3)
    for g in ref.groups:
        g._strided["tokens"] = None  # the reference: every group moves rows
    assert [g.token_views() is not None for g in fast.groups] == [g.run == 1 for g in fast.groups]
    assert any(g.token_views() is not None for g in fast.groups)  # the CPU layer's group takes the views
    perm = torch.randperm(NB * S, generator=torch.Generator().manual_seed(1))
    src, dst = perm[:12], perm[12:24]
    got, want = fast.gather(src), ref.gather(src)
    assert [v.dtype for v in got] == [v.dtype for v in want]
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    fast.scatter(dst, got)
    ref.scatter(dst, want)
    after_fast, after_ref = snapshot(fast), snapshot(ref)
    assert all(torch.equal(after_fast[n].view(torch.uint8), after_ref[n].view(torch.uint8)) for n in after_ref)
    assert [tuple(v.shape) for v in fast.gather(src[:0])] == [tuple(v.shape) for v in want_empty(ref)]
    with pytest.raises(BlockOutOfRangeError):
        fast.gather(torch.tensor([NB * S]))


def want_empty(cache):
    return cache.gather(torch.zeros(0, dtype=torch.int64))


def test_layout_shapes_are_checked_with_the_layer_named():
    with pytest.raises(LayoutError, match="layer 'x'.*stacked"):
        gpu_planes("x", torch.zeros(3, NB, S, H, D))
    with pytest.raises(LayoutError, match="layer 'y'.*CPU"):
        cpu_plane("y", torch.zeros(NB, H, S, 2 * D + 1))
    with pytest.raises(LayoutError, match="layer 'z'"):
        PagedKVCache(gpu_planes("a", (torch.zeros(NB, S, H, D),) * 2) + gpu_planes("z", (torch.zeros(NB, 2 * S, H, D),) * 2))


def transposed_k_writer(key, value, cache, slots):
    """A reference cache-write op in vLLM's vec/vec16 order: per head, K stored dim-major ([D, S]) in the
    first D*S elements, V token-major ([S, D]) after it."""
    nb, h, s, d2 = cache.shape
    d = d2 // 2
    flat = cache.view(nb, h, 2 * d * s)
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, s)
        for hh in range(h):
            flat[b, hh, torch.arange(d) * s + o] = key[t, hh]
            flat[b, hh, d * s + o * d + torch.arange(d)] = value[t, hh]


def row_major_writer(key, value, cache, slots):
    """Another order: token o's row holds K[h] in its first D columns and V[h] after them."""
    nb, h, s, d2 = cache.shape
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, s)
        cache[b, :, o, : d2 // 2] = key[t]
        cache[b, :, o, d2 // 2:] = value[t]


@pytest.mark.parametrize("writer", [transposed_k_writer, row_major_writer])
def test_probe_learns_the_in_block_order_of_a_kernel(writer):
    order = probe_block_order(writer, H, S, D)
    assert torch.equal(order, default_cpu_block_order(H, S, D)) == (writer is transposed_k_writer)
    cache_t = torch.zeros(NB, H, S, 2 * D)
    cache = PagedKVCache([cpu_plane("l", cache_t, order)])
    k, v = torch.randn(1, H, D), torch.randn(1, H, D)
    writer(k, v, cache_t, torch.tensor([3 * S + 1]))
    assert torch.equal(cache.read("l.K", torch.tensor([3 * S + 1])), k.view(1, -1))
    assert torch.equal(cache.read("l.V", torch.tensor([3 * S + 1])), v.view(1, -1))
    if writer is row_major_writer:  # the default order reads that token wrongly: probing matters
        wrong = PagedKVCache([cpu_plane("l", cache_t)])
        assert not torch.equal(wrong.read("l.K", torch.tensor([3 * S + 1])), k.view(1, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_probe_against_vllms_own_cpu_cache_write_op(dtype, block_size):
    pytest.importorskip("vllm")
    from vtoken.integration.vllm.vllm_cpu_writer import vllm_cpu_writer
    heads, head_size = 2, 64
    write, isa = vllm_cpu_writer(dtype, block_size, head_size)
    order = probe_block_order(write, heads, block_size, head_size, dtype)
    if isa in ("vec", "vec16"):
        assert torch.equal(order, default_cpu_block_order(heads, block_size, head_size))
    cache_t = torch.zeros(4, heads, block_size, 2 * head_size, dtype=dtype)
    cache = PagedKVCache([cpu_plane("l", cache_t, order)])
    k, v = torch.randn(3, heads, head_size).to(dtype), torch.randn(3, heads, head_size).to(dtype)
    slots = torch.tensor([block_size + 5, 2 * block_size, 3 * block_size + block_size - 1])
    write(k, v, cache_t, slots)  # the kernel writes; vtoken reads through the probed order
    assert torch.equal(cache.read("l.K", slots), k.view(3, -1)) and torch.equal(cache.read("l.V", slots), v.view(3, -1))
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict")))
    h = eng.submit([Move(0, 1, 5, 0, 0)])
    assert eng.poll(h) is CopyStatus.DONE and torch.equal(cache.read("l.V", torch.tensor([0])), v[0].view(1, -1))


@pytest.mark.parametrize("bad, match", [
    (lambda k, v, c, s: c.view(-1)[: k.numel()].copy_(k.flatten()), "block 0"),
    (lambda k, v, c, s: transposed_k_writer(k * 2, v, c, s), "changed values"),
    (lambda k, v, c, s: transposed_k_writer(k, torch.zeros_like(v), c, s), "not written"),
])
def test_probe_rejects_a_kernel_that_is_not_a_pure_in_block_copy(bad, match):
    with pytest.raises(LayoutError, match=match):
        probe_block_order(bad, H, S, D)


# ---- moves ----------------------------------------------------------------------------------------------
def random_moves(rng: random.Random, n: int) -> list[Move]:
    slots = rng.sample(range(NB * S), 2 * n)
    src, dst = slots[:n], slots[n:]
    if n > 1:  # a chain: one move's destination is another's source
        dst[0] = src[1]
    return [Move(i, s // S, s % S, d // S, d % S) for i, (s, d) in enumerate(zip(src, dst))]


@pytest.mark.parametrize("dtype", DTYPES + fp8_dtypes(), ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_a_copy_moves_exactly_its_moves_in_every_layer(dtype, seed):
    cache, _ = mixed_cache(dtype, seed)
    before = snapshot(cache)
    moves = random_moves(random.Random(seed), 1 + seed * 3)
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict", seed=seed)))
    h = eng.submit(moves, req_id="r")
    assert eng.poll(h) is CopyStatus.DONE and eng.verifier.counters.verified == 1
    want = {n: t.clone() for n, t in before.items()}
    for m in moves:
        for n in want:
            want[n][m.dst_block * S + m.dst_offset] = before[n][m.src_block * S + m.src_offset]
    after = snapshot(cache)
    for n in want:  # compare bits (NaN-safe)
        assert torch.equal(after[n].view(torch.uint8), want[n].view(torch.uint8)), n
    assert eng.launches == 2 * len(cache.groups)  # one gather, one scatter per storage: not per token or layer


def test_a_cycle_of_moves_is_copied_out_of_place():
    cache, _ = mixed_cache()
    before = snapshot(cache)
    cycle = [Move(0, 0, 0, 0, 1), Move(1, 0, 1, 0, 2), Move(2, 0, 2, 0, 0)]
    eng = TorchCopyEngine(cache)
    assert eng.poll(eng.submit(cycle)) is CopyStatus.DONE
    after = snapshot(cache)
    for n in before:
        assert torch.equal(after[n][[1, 2, 0]], before[n][[0, 1, 2]])


def run_one_by_one(copies, dtype=torch.float32):
    cache, _ = mixed_cache(dtype)
    eng = TorchCopyEngine(cache)
    for moves, r in copies:
        assert eng.poll(eng.submit(moves, req_id=r)) is CopyStatus.DONE
    return snapshot(cache)


def bits_equal(a, b) -> bool:
    return all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def test_a_batch_of_requests_copies_is_one_launch_and_equals_copying_them_one_by_one():
    # three requests' densify-like plans over disjoint blocks, as one step's outbox
    copies = [([Move(0, 0, 3, 0, 1), Move(1, 1, 0, 0, 2)], "a"), ([Move(5, 2, 2, 2, 0)], "b"),
              ([Move(9, 4, 1, 3, 0), Move(10, 4, 2, 3, 1), Move(11, 5, 0, 3, 2)], "c")]
    cache, _ = mixed_cache()
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict")))
    handles = eng.submit_batch(copies)
    assert [eng.poll(h) for h in handles] == [CopyStatus.DONE] * 3
    assert eng.launches == 2 * len(cache.groups)  # one gather and one scatter per storage, for all three
    c = eng.verifier.counters
    assert (c.relocations, c.verified, c.mismatches) == (3, 3, 0)
    assert bits_equal(snapshot(cache), run_one_by_one(copies))


def test_a_copy_reading_what_an_earlier_one_of_the_batch_writes_starts_a_second_launch():
    """The same request's drill after its densify: the second copy reads block 1, which the first writes. One
    gather-then-scatter for both would read block 1 before the first copy wrote it."""
    copies = [([Move(0, 0, 0, 1, 0)], "a"), ([Move(0, 1, 0, 2, 0)], "a"), ([Move(4, 5, 0, 6, 0)], "b")]
    cache, _ = mixed_cache()
    before = snapshot(cache)
    eng = TorchCopyEngine(cache)
    assert [eng.poll(h) for h in eng.submit_batch(copies)] == [CopyStatus.DONE] * 3
    assert eng.launches == 2 * 2 * len(cache.groups)  # two waves: [a], [a, b]
    after = snapshot(cache)
    assert bits_equal(after, run_one_by_one(copies))
    for n in after:  # slot 0's K/V went to block 1, then on to block 2; a single wave would carry block 1's old one
        assert torch.equal(after[n][2 * S], before[n][0]) and not torch.equal(before[n][S], before[n][0])


def test_a_copy_writing_what_an_earlier_one_of_the_batch_writes_starts_a_second_launch():
    """Two copies into one slot: one by one the later one's value stays; a single scatter of both might keep
    either (a repeated index), so the second goes in a wave of its own."""
    copies = [([Move(0, 1, 0, 4, 0)], "a"), ([Move(3, 2, 0, 4, 0)], "b")]
    cache, _ = mixed_cache()
    before = snapshot(cache)
    eng = TorchCopyEngine(cache)
    assert [eng.poll(h) for h in eng.submit_batch(copies)] == [CopyStatus.DONE] * 2
    assert eng.launches == 2 * 2 * len(cache.groups)
    after = snapshot(cache)
    assert all(torch.equal(after[n][4 * S], before[n][2 * S]) for n in after)  # b's, as one by one


@pytest.mark.parametrize("bad, error, message", [
    (Move(7, 5, 0, 10**6, 0), DestinationError, r"request 'b': move .* writes a slot outside the KV cache"),
    (Move(7, 5, 0, 6, True), DestinationError, r"request 'b': move .* writes a slot outside the KV cache"),
    (Move(7, 5, 1.0, 6, 0), MoveSourceMismatchError, r"request 'b': move .* reads a slot outside the KV cache"),
    ((7, 5, 0), MoveSourceMismatchError, r"request 'b': malformed moves")])
def test_a_bad_move_anywhere_in_a_batch_is_refused_naming_its_request_before_anything_runs(bad, error, message):
    """A step's copies are checked in one pass over all their moves; one that fails names its own copy's request,
    as ``check_moves`` does copy by copy, and nothing is launched or registered."""
    copies = [([Move(0, 0, 3, 0, 1)], "a"), ([Move(5, 2, 2, 2, 0), bad], "b"), ([Move(9, 4, 1, 3, 0)], "c")]
    cache, _ = mixed_cache()
    before = snapshot(cache)
    eng = TorchCopyEngine(cache)
    with pytest.raises(error, match=message):
        eng.submit_batch(copies)
    assert eng.launches == 0 and eng._copies == {} and bits_equal(snapshot(cache), before)


def test_packed_moves_copy_what_the_same_moves_as_tuples_copy_and_a_bad_one_is_named():
    """The fast path's copies arrive as ``MoveArray``s: one pass checks them without unpacking a ``Move``, the wave
    copies the same bits as the tuples would, and a bad field (never made by the planner, forged here) is refused
    naming its request before anything runs."""
    from array import array

    from vtoken.integration.device.copy_engine import packed
    from vtoken.integration.fastpath.moves import MoveArray
    copies = [([Move(0, 0, 3, 0, 1), Move(1, 1, 0, 0, 2)], "a"), ([Move(5, 2, 2, 2, 0)], "b")]
    as_arrays = [(MoveArray(packed(m)), r) for m, r in copies]
    cache, _ = mixed_cache()
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict")))
    handles = eng.submit_batch(as_arrays)
    assert [eng.poll(h) for h in handles] == [CopyStatus.DONE] * 2 and eng.verifier.counters.mismatches == 0
    assert all(eng._copies[h].moves is m for h, (m, _) in zip(handles, as_arrays))  # checked as they are
    assert bits_equal(snapshot(cache), run_one_by_one(copies))
    cache, _ = mixed_cache()
    before = snapshot(cache)
    eng = TorchCopyEngine(cache)
    forged = [as_arrays[0], (MoveArray(array("q", [5, 2, 2, 10**6, 0])), "b")]
    with pytest.raises(DestinationError, match=r"request 'b': move .* writes a slot outside the KV cache"):
        eng.submit_batch(forged)
    assert eng.launches == 0 and eng._copies == {} and bits_equal(snapshot(cache), before)


def test_a_mismatch_in_a_batch_fails_only_its_own_request(tmp_path):
    cache, _ = mixed_cache()
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict", on_mismatch="quarantine",
                                                              evidence_dir=str(tmp_path))))
    copies = [([Move(0, 0, 0, 5, 0)], "a"), ([Move(1, 2, 0, 6, 0), Move(2, 2, 1, 6, 1)], "b"),
              ([Move(3, 3, 0, 7, 0)], "c")]
    with torn_writes(cache, "l1.K", 6 * S + 1):
        handles = eng.submit_batch(copies)
    assert [eng.poll(h) for h in handles] == [CopyStatus.DONE, CopyStatus.FAILED, CopyStatus.DONE]
    assert list(eng.verifier.quarantined) == ["b"]
    ev = json.loads(eng.verifier.quarantined["b"].read_text())
    assert ev["plan"] == [[1, 2, 0, 6, 0], [2, 2, 1, 6, 1]] and [m["token"] for m in ev["mismatches"]] == [2]
    c = eng.verifier.counters
    assert (c.verified, c.mismatches) == (3, 1)


def test_only_the_sampled_copies_of_a_batch_are_hashed_and_a_mismatch_finds_its_own(tmp_path):
    cache, _ = mixed_cache()
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict", on_mismatch="quarantine",
                                                              evidence_dir=str(tmp_path))))
    chosen = iter([True, False, True])
    eng.verifier.select = lambda: next(chosen)  # as the sampler might: the middle copy is not verified
    copies = [([Move(0, 0, 0, 5, 0)], "a"), ([Move(1, 2, 0, 6, 0)], "b"),
              ([Move(3, 3, 0, 7, 0), Move(4, 3, 1, 7, 1)], "c")]
    with torn_writes(cache, "l0.V", 7 * S + 1), torn_writes(cache, "l0.V", 6 * S):
        handles = eng.submit_batch(copies)
    # b's torn write goes unseen (not verified); c's is found and is c's
    assert [eng.poll(h) for h in handles] == [CopyStatus.DONE, CopyStatus.DONE, CopyStatus.FAILED]
    assert list(eng.verifier.quarantined) == ["c"]
    per_token = sum(g.elems * g.flat.element_size() for g in cache.groups)
    assert eng.verifier.counters.bytes_hashed == 2 * 3 * per_token  # a's and c's moves, source and destination


@pytest.mark.parametrize("chosen", [[True], [True, False]], ids=["strict, alone", "sampled, beside one unverified"])
def test_a_verified_copy_of_no_moves_fails_nothing(chosen):
    """Regression: a wave whose verified copies move nothing hashed no tokens, and the digest of none raised, which
    failed every copy of the wave (a sampled step's real copies too). Now it is DONE, and so are the others."""
    cache, _ = mixed_cache()
    want = snapshot(cache)
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict")))
    picks = iter(chosen)
    eng.verifier.select = lambda: next(picks)
    copies = [([], "a"), ([Move(0, 1, 0, 5, 0)], "b")][:len(chosen)]
    handles = eng.submit_batch(copies)
    assert [eng.poll(h) for h in handles] == [CopyStatus.DONE] * len(copies)
    if len(copies) == 2:
        want = {n: t.clone() for n, t in want.items()}
        for n in want:
            want[n][5 * S] = want[n][1 * S]
    assert all(torch.equal(snapshot(cache)[n], want[n]) for n in want)


def test_layers_sharing_a_buffer_are_moved_once():
    cache, (k0, _, _, _) = mixed_cache(shared=True)
    assert cache.aliases == {"l3": "l0"} and "l3.K" not in cache.plane_names()
    before = k0.clone()
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict")))
    eng.poll(eng.submit([Move(0, 1, 0, 2, 0), Move(1, 2, 0, 3, 0)]))  # moving twice would carry 1.0 into 3.0
    assert torch.equal(k0[3, 0], before[2, 0]) and torch.equal(k0[2, 0], before[1, 0])
    assert torch.equal(cache.read("l3.K", torch.tensor([2 * S])), before[1, 0].view(1, -1))


def test_bad_moves_are_rejected_and_change_nothing():
    cache, _ = mixed_cache()
    eng = TorchCopyEngine(cache)
    before = snapshot(cache)
    with pytest.raises(DestinationError, match="outside the KV cache"):
        eng.submit([Move(0, 0, 0, NB, 0)], req_id="r")
    with pytest.raises(DestinationError, match="same slot"):
        eng.submit([Move(0, 0, 0, 1, 0), Move(1, 0, 1, 1, 0)], req_id="r")
    after = snapshot(cache)
    assert all(torch.equal(after[n], before[n]) for n in before) and eng.pending() == []


@pytest.mark.parametrize("move, error, culprit", [
    (Move(0, 1.0, 0, 2, 0), MoveSourceMismatchError, "1.0"),  # torch.tensor would read it as block 1
    (Move(0, 1, 0, 2.7, 0), DestinationError, "2.7"),  # ... and this as block 2
    (Move(0, 1, 0, 2, True), DestinationError, "True"),  # ... and this as offset 1
    (Move(0, False, 0, 2, 0), MoveSourceMismatchError, "False"),
    (Move(0.5, 1, 0, 2, 0), TokenOutOfRangeError, "0.5"),
    (Move(0, 1, -1, 2, 0), MoveSourceMismatchError, "-1"),
    (Move(0, 1, 0, 2, S), DestinationError, f"dst_offset={S}"),
    ((0, 1, 0, 2), MoveSourceMismatchError, "(0, 1, 0, 2)"),  # four fields
])
def test_submit_refuses_moves_that_are_not_exact_slots_and_changes_nothing(move, error, culprit):
    cache, _ = mixed_cache()
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict")))
    before = snapshot(cache)
    with pytest.raises(error, match="'r'") as e:
        eng.submit([Move(5, 3, 0, 4, 0), move], req_id="r")
    assert culprit in str(e.value), str(e.value)
    after = snapshot(cache)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert eng.pending() == [] and eng.launches == 0 and eng.verifier.counters.relocations == 0


class FakeEvent:
    """A CUDA event on the CPU: ``query()`` is False until the test fires it (a copy not yet seen complete)."""

    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.fired = True


class LateEngine(TorchCopyEngine):
    """The CPU engine with each copy's completion reported late, as on CUDA when the host looks steps later."""

    def _launch(self, wave, src, rows):
        super()._launch(wave, src, rows)
        for c in wave.copies:
            c.event = FakeEvent()


@pytest.mark.parametrize("on_mismatch, release_first", [("raise", True), ("raise", False), ("quarantine", False)])
def test_a_later_copy_into_the_same_slot_is_no_mismatch(on_mismatch, release_first, tmp_path):
    """Two chained ORDERED copies write slot 5*S: copy 1 (request "a"), then copy 2 (request "b", after "a"'s
    plan committed and the slot was freed and planned again), before the host sees copy 1 complete. Copy 1
    wrote its destination correctly, so it verifies clean. Taking its destination digest when it is first
    seen complete read copy 2's value: RelocationMismatch, or under quarantine a failed healthy request."""
    cache, _ = mixed_cache()
    before = snapshot(cache)
    eng = LateEngine(cache, Verifier(cache, VerifyConfig("strict", on_mismatch=on_mismatch,
                                                         evidence_dir=str(tmp_path))))
    first = eng.submit([Move(0, 1, 0, 5, 0)], req_id="a")
    assert eng.order_before_compute(first) is CopyStatus.ORDERED and eng.poll(first) is CopyStatus.ORDERED
    if release_first:
        eng.release(first)  # "a"'s plan committed under EVENT ordering
    second = eng.submit([Move(1, 2, 0, 5, 0)], req_id="b")
    assert eng.order_before_compute(second) is CopyStatus.ORDERED
    for h in (first, second):
        eng._get(h).event.fired = True
    assert (eng.poll(first), eng.poll(second)) == (CopyStatus.DONE, CopyStatus.DONE)
    c = eng.verifier.counters
    assert (c.relocations, c.verified, c.mismatches) == (2, 2, 0)
    assert eng.verifier.quarantined == {} and list(tmp_path.iterdir()) == []
    after = snapshot(cache)
    for n in before:  # slot 5*S holds copy 2's source, block 1's first token is still there
        assert torch.equal(after[n][5 * S], before[n][2 * S]) and torch.equal(after[n][1 * S], before[n][1 * S])


def test_a_torn_write_is_still_caught_when_completion_is_seen_late():
    """The same late completion does not blunt the check: a copy that wrote its destination wrongly fails."""
    cache, _ = mixed_cache()
    eng = LateEngine(cache, Verifier(cache, VerifyConfig("strict")))
    with torn_writes(cache, "l1.V", 5 * S):
        first = eng.submit([Move(0, 1, 0, 5, 0)], req_id="a")
    eng.order_before_compute(first)
    second = eng.submit([Move(1, 2, 0, 6, 0)], req_id="b")
    eng._get(first).event.fired = eng._get(second).event.fired = True
    with pytest.raises(RelocationMismatch, match=r"'a'.*l1\.V"):
        eng.poll(first)
    assert eng.poll(second) is CopyStatus.DONE


# ---- strict verify ----------------------------------------------------------------------------------------
def flip_one_element(cache, name, slot, elem=0):
    raw = cache.read(name, torch.tensor([slot]))
    raw.view(torch.uint8).view(-1)[elem * raw.element_size()] ^= 1
    cache.write(name, torch.tensor([slot]), raw)


@contextmanager
def torn_writes(cache, name, slot, elem=0):
    """A faulty copy kernel: every scatter that writes ``slot`` flips one element of it in plane ``name``.

    Strict verify checks what a copy itself wrote (its destination digests are taken right after its scatter),
    so corruption is planted inside the copy, not after it: a write after the copy is later work's, not the
    copy's (test_a_later_copy_into_the_same_slot_is_no_mismatch)."""
    real, outer = cache.scatter, cache.__dict__.get("scatter")  # outer: another torn_writes around this one

    def scatter(slots, values):
        real(slots, values)
        if slot in slots.tolist():
            flip_one_element(cache, name, slot, elem)

    cache.scatter = scatter
    try:
        yield
    finally:
        if outer is None:
            del cache.scatter  # the class's method again
        else:
            cache.scatter = outer


def test_strict_detects_one_flipped_element_and_names_everything():
    cache, _ = mixed_cache()
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict")))
    with torn_writes(cache, "l2.V", 4 * S + 2, elem=4):
        h = eng.submit([Move(7, 1, 0, 4, 3), Move(8, 1, 1, 4, 2)], req_id="req-9")
    with pytest.raises(RelocationMismatch) as e:
        eng.poll(h)
    assert "req-9" in str(e.value) and "token 8" in str(e.value) and "l2.V" in str(e.value)
    assert f"slot {1 * S + 1} -> {4 * S + 2}" in str(e.value)
    assert e.value.evidence["mismatches"][0]["plane"] == "l2.V" and len(e.value.evidence["mismatches"]) == 1
    assert eng.verifier.counters.mismatches == 1


def test_off_misses_the_same_corruption():
    cache, _ = mixed_cache()
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("off")))
    with torn_writes(cache, "l0.K", 4 * S + 3):
        h = eng.submit([Move(7, 1, 0, 4, 3)], req_id="r")
    assert eng.poll(h) is CopyStatus.DONE and eng.verifier.counters.verified == 0


def test_sampled_detects_at_the_expected_rate():
    cache, _ = mixed_cache()
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("sampled", sample_every=4, on_mismatch="quarantine",
                                                              evidence_dir="/tmp/vtoken-test-evidence", seed=3)))
    detected = 0
    with torn_writes(cache, "l1.K", 1 * S):
        for i in range(200):
            h = eng.submit([Move(0, 0, 0, 1, 0)], req_id=i)
            detected += eng.poll(h) is CopyStatus.FAILED
    c = eng.verifier.counters
    assert c.relocations == 200 and detected == c.verified == c.mismatches
    assert 30 <= detected <= 70  # 1 in 4 of 200 (binomial: mean 50, sd 6.1), fixed by the seed


def test_quarantine_fails_that_relocation_keeps_others_and_writes_evidence(tmp_path):
    cache, _ = mixed_cache()
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict", on_mismatch="quarantine",
                                                              evidence_dir=str(tmp_path))))
    with torn_writes(cache, "l0.K", 5 * S):
        bad = eng.submit([Move(0, 0, 0, 5, 0)], req_id="a")
        good = eng.submit([Move(0, 2, 0, 6, 0)], req_id="b")
    b_after_copy = snapshot(cache)
    assert eng.poll(bad) is CopyStatus.FAILED and eng.poll(good) is CopyStatus.DONE
    assert list(eng.verifier.quarantined) == ["a"]
    ev = json.loads(eng.verifier.quarantined["a"].read_text())
    assert ev["request"] == "'a'" and ev["plan"] == [[0, 0, 0, 5, 0]] and ev["mismatches"][0]["plane"] == "l0.K"
    now = snapshot(cache)
    assert all(torch.equal(now[n][6 * S], b_after_copy[n][6 * S]) for n in now)  # b's K/V intact


def test_a_quarantined_copy_is_aborted_by_the_manager_and_the_sources_stay_authoritative(tmp_path):
    """The core aborts a FAILED copy: the old layout (whose K/V the copy never wrote) stays in use."""
    cache, _ = mixed_cache()
    store = TensorTagStore(cache)
    pool, table = BlockPool(NB, S, headroom=1), TokenTable(NB, S)
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict", on_mismatch="quarantine",
                                                              evidence_dir=str(tmp_path))))
    mgr = ReclamationManager(pool, table, eng, ReclaimConfig(planner=PlanKind.COMPACT, theta_f=0.0))
    table.add_request("r")
    blocks = pool.allocate(3, Purpose.ADMISSION)
    table.sync_new_tokens("r", blocks, 3 * S)
    for t, s in enumerate(table.write_slots("r")):
        store.write(s, 1000 + t)
    for t in range(3 * S):
        if t % S:  # leave one live token per block: 3 blocks pack into 1
            table.evict_token("r", t)
    rec = mgr.plan_request("r")
    assert rec and len(rec.plan.src_blocks) == 3 and len(rec.plan.dst_blocks) == 1
    d = rec.plan.moves[0]
    with torn_writes(cache, "l1.V", d.dst_block * S + d.dst_offset):
        assert mgr.launch() == []  # launched (a torn write is no launch failure)
    [done] = mgr.settle()
    assert done.state.value == "aborted" and "r" in eng.verifier.quarantined
    assert [store.read(s) for s in table.attention_slots("r")] == [1000, 1000 + S, 1000 + 2 * S]


def test_the_tag_store_sees_a_torn_token():
    cache, _ = mixed_cache(torch.bfloat16)
    store = TensorTagStore(cache)
    store.write(9, 123456789)
    assert store.read(9) == 123456789
    flip_one_element(cache, "l2.K", 9)
    assert store.read(9) == TORN


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 5), token=st.integers(0, 4), elem=st.integers(0, 5),
       byte=st.integers(0, 7), bit=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_any_single_element_change_changes_the_digest(dtype, n, token, elem, byte, bit, seed):
    cache, _ = mixed_cache(dtype)
    ver = Verifier(cache, VerifyConfig("strict", seed=seed))
    gen = torch.Generator().manual_seed(seed)
    values = rand((n, cache.groups[0].elems), dtype, gen)
    changed = values.clone()
    raw = changed.view(torch.uint8).view(n, -1)
    token, elem, byte = token % n, elem % changed.shape[1], byte % changed.element_size()
    raw[token, elem * changed.element_size() + byte] ^= 1 << bit
    a, b = ver.digest(0, values), ver.digest(0, changed)
    diff = (a != b).nonzero().tolist()
    assert len(diff) == 1 and diff[0][0] == token  # exactly the changed token's plane


def test_an_in_place_engine_breaks_a_cycle_the_out_of_place_one_copies():
    """Planted bug: copying move by move (no staging) corrupts a cycle; the check above has teeth."""
    cache, _ = mixed_cache()
    before = snapshot(cache)
    for m in [Move(0, 0, 0, 0, 1), Move(1, 0, 1, 0, 2), Move(2, 0, 2, 0, 0)]:
        src, dst = torch.tensor([m.src_block * S + m.src_offset]), torch.tensor([m.dst_block * S + m.dst_offset])
        cache.scatter(dst, cache.gather(src))
    after = snapshot(cache)
    assert not all(torch.equal(after[n][[1, 2, 0]], before[n][[0, 1, 2]]) for n in before)


def test_planes_that_partly_overlap_in_one_buffer_are_refused():
    k = torch.zeros(NB + 1, S, H, D)
    v1, v2 = torch.zeros(NB, S, H, D), torch.zeros(NB, S, H, D)
    with pytest.raises(LayoutError, match=r"layers \['a', 'b'\] overlap in one buffer"):
        PagedKVCache(gpu_planes("a", (k[:-1], v1)) + gpu_planes("b", (k[1:], v2)))
