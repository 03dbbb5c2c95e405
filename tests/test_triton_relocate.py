"""The Triton relocation kernels (``integration/device/triton_relocate.py``) in Triton's interpreter on the CPU,
against their references: the device layer's torch moves (``TorchCopyEngine``, the same waves leave the same bits
in every layout and dtype of ``mixed_cache``) and strict verify's ``Verifier`` (the fused digests are its numbers).
Bad moves are refused before anything is written; planted bugs (a slot decode off by one, a missed wave boundary)
are caught. The GPU benchmark is not run here (no GPU): only its refusal and its cache layout."""

from __future__ import annotations

import importlib
import os
import random
import re

import pytest

# NOTE: Triton reads TRITON_INTERPRET when a kernel is decorated (its own library's too) and again while one runs
# (a lazy import asserts it), so the interpreter is chosen for a whole process from its start: `make test` runs these
# files in a process of their own with it set, and the rest of the suite never sees it
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter tests run in their own process (TRITON_INTERPRET=1 from its start; make test)",
                allow_module_level=True)
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from test_device_layer import DTYPES, NB, S, bits_equal, fp8_dtypes, mixed_cache, snapshot  # noqa: E402
from test_device_layer import random_copies as device_layer_copies  # noqa: E402
from vtoken.core.copy_engine import CopyStatus  # noqa: E402
from vtoken.core.errors import BlockOutOfRangeError, DestinationError, InvalidArgumentError  # noqa: E402
from vtoken.core.token_table import Move  # noqa: E402
from vtoken.integration.device import triton_relocate as tr  # noqa: E402
from vtoken.integration.device.copy_engine import TorchCopyEngine, waves  # noqa: E402
from vtoken.integration.device.verify import RelocationMismatch, Verifier, VerifyConfig  # noqa: E402

if not isinstance(tr._read_tokens, InterpretedFunction):  # imported earlier, without the interpreter
    tr = importlib.reload(tr)


@triton.jit
def _decode_offset_one_along(slot, BLOCK_SIZE: tl.constexpr):
    """Planted: the in-block offset off by one (wrapping, so every address stays inside the cache)."""
    return slot // BLOCK_SIZE, (slot + 1) % BLOCK_SIZE


ALL_DTYPES = DTYPES + fp8_dtypes()
SEED = 11  # the verifiers' seed, both sides


def random_copies(rng: random.Random) -> list:
    return device_layer_copies(rng, requests=3)


def reference(copies, dtype):
    """The torch path under strict verify: the bits it leaves, and its per-wave digests (taken as part of each
    wave's work, so read before the first poll compares and drops them), per group [n, planes]."""
    cache, _ = mixed_cache(dtype, seed=3)
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict", seed=SEED)))
    handles = eng.submit_batch(copies)
    wave_list = []
    for h in handles:
        w = eng._get(h).wave
        if not wave_list or wave_list[-1] is not w:
            wave_list.append(w)
    src = [torch.cat([w.src_digests.per_group[g] for w in wave_list]) for g in range(len(cache.groups))]
    dst = [torch.cat([w.dst_digests.per_group[g] for w in wave_list]) for g in range(len(cache.groups))]
    assert [eng.poll(h) for h in handles] == [CopyStatus.DONE] * len(copies)
    return snapshot(cache), src, dst, len(wave_list)


def direct_allowed(moves: torch.Tensor, ends: list[int]) -> bool:
    first = 0
    for end in ends:
        if set(moves[first:end, 0].tolist()) & set(moves[first:end, 1].tolist()):
            return False
        first = end
    return True


def triton_run(copies, dtype, disjoint=False, int32=False):
    cache, _ = mixed_cache(dtype, seed=3)
    mover = tr.TritonRelocator(cache, Verifier(cache, VerifyConfig("strict", seed=SEED)))
    moves, starts = tr.copy_moves(copies, S)
    ends = tr.wave_ends(moves, S, starts)
    src, dst = mover.relocate(moves.to(torch.int32) if int32 else moves, ends, digests=True, disjoint=disjoint)
    return snapshot(cache), src.per_group, dst.per_group, ends, mover


def check_against_reference(copies, dtype, disjoint=False, int32=False) -> None:
    want, want_src, want_dst, want_waves = reference(copies, dtype)
    got, src, dst, ends, mover = triton_run(copies, dtype, disjoint, int32)
    assert bits_equal(got, want), f"bits differ: {copies}"
    assert len(ends) == want_waves or not ends and want_waves == 1  # an empty batch: the engine's one empty wave
    assert all(torch.equal(a, b) for a, b in zip(src, want_src)), f"source digests differ: {copies}"
    assert all(torch.equal(a, b) for a, b in zip(dst, want_dst)), f"destination digests differ: {copies}"
    per_wave = (1 if disjoint else 2) * len(mover.units)
    assert mover.launches == per_wave * len(ends)


# ---- bit-exact and Verifier-exact ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_the_kernels_leave_the_torch_paths_bits_and_verifiers_digests(dtype):
    """34 random steps per dtype (204 in all), every layout of ``mixed_cache`` (two GPU layouts, stacked MQA,
    vLLM's CPU layout) in one launch per phase: the bits the torch waves leave, and per move and plane exactly the
    source and destination digests strict verify takes; staged (scratch buffer) and, where no move of a wave
    reads what the wave writes, direct; int64 and int32 moves."""
    rng = random.Random(f"triton-relocate-{dtype}")
    direct = several_waves = 0
    for case in range(34):
        copies = random_copies(rng)
        moves, starts = tr.copy_moves(copies, S)
        ends = tr.wave_ends(moves, S, starts)
        disjoint = case % 2 == 1 and direct_allowed(moves, ends)
        direct += disjoint
        several_waves += len(ends) > 1
        check_against_reference(copies, dtype, disjoint=disjoint, int32=case % 3 == 2)
    assert direct >= 3 and several_waves >= 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, *fp8_dtypes()[:1]], ids=str)
def test_edges_the_pools_last_slot_cycles_and_empty_batches(dtype):
    last = divmod(NB * S - 1, S)
    cases = [
        [([Move(0, *last, 0, 0), Move(1, 0, 0, *last)], "swap first and last")],  # a cycle within one copy
        [([Move(0, 2, 1, 3, 1), Move(1, 3, 1, 4, 1), Move(2, 4, 1, 2, 1)], "three-cycle")],
        [([Move(0, 1, 0, *last)], "a"), ([Move(0, *last, 5, 0)], "b")],  # b reads what a wrote: two waves
        [([], "empty")],
        [([], "empty"), ([Move(0, *last, *last)], "onto itself"), ([], "empty")],
    ]
    for copies in cases:
        check_against_reference(copies, dtype)


@pytest.mark.parametrize("planes", [1, 4], ids=["one plane a program (a GPU's)", "blocks of 4 planes"])
def test_tiles_smaller_than_the_batch_and_planes_longer_than_a_row_chunk(monkeypatch, planes):
    """Several programs along the moves and along the planes (of 6: with 4 a program, the last block is short), and
    several row chunks per plane: the GPU's shape of work, in small."""
    monkeypatch.setattr(tr, "_INTERPRETER_BLOCK_M", 4)
    monkeypatch.setattr(tr, "_TILE_ELEMS", 2)
    monkeypatch.setattr(tr, "_INTERPRETER_PLANES", planes)
    rng = random.Random(f"small-tiles-{planes}")
    copies = random_copies(rng)
    while tr.copy_moves(copies, S)[0].shape[0] <= 4:  # more moves than a program takes
        copies = random_copies(rng)
    check_against_reference(copies, torch.float16 if planes == 1 else torch.float64)


def test_a_cache_laid_out_as_the_benchmarks_moves_rows_as_vectors():
    """``bench_cache`` (one stacked [2, blocks, S, heads, dim] tensor per layer, fp16): rows of 16 elements, aligned,
    across four storages from one base pointer; bit-exact against the torch path, digests against Verifier's."""
    cache = tr.bench_cache(layers=4, heads=2, head_size=8, block_size=S, num_blocks=NB, device="cpu")
    ref = tr.bench_cache(layers=4, heads=2, head_size=8, block_size=S, num_blocks=NB, device="cpu")
    verifier = Verifier(cache, VerifyConfig("strict", seed=SEED))
    mover = tr.TritonRelocator(cache, verifier)
    [unit] = mover.units
    assert unit.lanes == 16 and unit.align == 16 and len(unit.members) == 4
    perm = torch.randperm(NB * S, generator=torch.Generator().manual_seed(5))
    moves = torch.stack([perm[:10], perm[10:20]], 1)
    want_src = verifier.source_digests(ref.gather(moves[:, 0]))
    ref.scatter(moves[:, 1], ref.gather(moves[:, 0]))
    src, dst = mover.relocate(moves, digests=True, disjoint=True)
    assert bits_equal(snapshot_all(cache), snapshot_all(ref))
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(src.per_group, dst.per_group,
                                                                            want_src.per_group))


def snapshot_all(cache):
    return {n: cache.read(n, torch.arange(cache.num_slots)).clone() for n in cache.plane_names()}


# ---- waves --------------------------------------------------------------------------------------------------------
def test_wave_ends_are_copy_engine_waves_in_move_indices():
    rng = random.Random("wave-ends")
    for _ in range(100):
        copies = random_copies(rng)
        moves, starts = tr.copy_moves(copies, S)
        want = [starts[end] for _, end, _ in waves([m for m, _ in copies])]
        want = [e for i, e in enumerate(want) if e > ([0] + want)[i]]
        assert tr.wave_ends(moves, S, starts) == want
    swap = torch.tensor([[0, 5], [5, 0]])
    assert tr.wave_ends(swap, S, [0, 2]) == [2]  # one copy: a swap
    assert tr.wave_ends(swap, S) == [1, 2]  # each move a copy: one after the other, no swap
    assert tr.wave_ends(torch.zeros((0, 2), dtype=torch.int64), S) == []
    with pytest.raises(InvalidArgumentError, match="copy_starts"):
        tr.wave_ends(swap, S, [0, 1])


# ---- the padded variant (CUDA-graph capture) ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_padding_rows_past_the_count_are_never_read(dtype):
    """A buffer of 12 moves, of which the first k count (a device tensor); the padding holds slots that would move
    tokens, and slots outside the cache. Exactly the first k moves happen, their digests are Verifier's; the
    padding's digest rows stay 0."""
    rng = random.Random(f"padded-{dtype}")
    for case in range(10):
        k = (0, 1, 12)[case] if case < 3 else rng.randint(0, 12)
        dsts = rng.sample(range(NB * S), 12)
        copy = [Move(i, *divmod(rng.randrange(NB * S), S), *divmod(d, S)) for i, d in enumerate(dsts[:k])]
        want, want_src, want_dst, _ = reference([(copy, "r")], dtype)
        cache, _ = mixed_cache(dtype, seed=3)
        mover = tr.TritonRelocator(cache, Verifier(cache, VerifyConfig("strict", seed=SEED)))
        buf = torch.tensor([[rng.randrange(NB * S), d] for d in dsts], dtype=torch.int64)
        buf[:k] = tr.copy_moves([(copy, "r")], S)[0]
        buf[k::2] = torch.tensor([-7, 10 ** 9])  # outside the cache: never read, so never checked
        src, dst = mover.relocate_padded(buf, torch.tensor([k], dtype=torch.int32), digests=True,
                                         disjoint=direct_allowed(buf[:k], [k]) and case % 2 == 0)
        assert bits_equal(snapshot(cache), want), case
        for got, ref in zip(src.per_group + dst.per_group, want_src + want_dst):
            assert torch.equal(got[:k], ref) and not got[k:].any() and got.shape[0] == 12, case


# ---- digests -------------------------------------------------------------------------------------------------------
def flip_bit(cache, slot: int, gi: int, element: int, bit: int) -> None:
    g = cache.groups[gi]
    bits = g.flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[g.flat.element_size()])
    width = 8 * g.flat.element_size()
    mask = 1 << bit if bits.dtype == torch.uint8 or bit < width - 1 else -(1 << bit)  # the sign bit, as signed
    bits[g.index(torch.tensor([slot]), S, element, element + 1).item()] ^= mask


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_flipped_bit_in_a_copied_row_changes_exactly_its_digest(dtype):
    """After a verified relocation, 20 random single-bit flips per dtype (120 in all) in a moved token's
    destination: the read-back digest of that token and plane changes, no other; ``digests_at`` is
    ``Verifier.destination_digests`` throughout; flipped back, everything matches again."""
    rng = random.Random(f"flips-{dtype}")
    cache, _ = mixed_cache(dtype, seed=3)
    verifier = Verifier(cache, VerifyConfig("strict", seed=SEED))
    mover = tr.TritonRelocator(cache, verifier)
    perm = rng.sample(range(NB * S), 12)
    moves = torch.tensor([perm[:6], perm[6:]]).T.contiguous()
    src, dst = mover.relocate(moves, digests=True, disjoint=True)
    assert all(torch.equal(a, b) for a, b in zip(src.per_group, dst.per_group))
    for trial in range(20):
        j, gi = rng.randrange(6), rng.randrange(len(cache.groups))
        g = cache.groups[gi]
        element, bit = rng.randrange(g.elems), rng.randrange(8 * g.flat.element_size())
        plane = next(p for p, (a, b) in enumerate(g.segments) if a <= element < b)
        flip_bit(cache, int(moves[j, 1]), gi, element, bit)
        now = mover.digests_at(moves[:, 1])
        by_torch = verifier.destination_digests(moves[:, 1])
        assert all(torch.equal(a, b) for a, b in zip(now.per_group, by_torch.per_group))
        changed = [(gi2, *ix) for gi2, (a, b) in enumerate(zip(now.per_group, src.per_group))
                   for ix in torch.nonzero(a != b).tolist()]
        assert changed == [(gi, j, plane)], (trial, element, bit)
        flip_bit(cache, int(moves[j, 1]), gi, element, bit)
    assert all(torch.equal(a, b) for a, b in zip(mover.digests_at(moves[:, 1]).per_group, src.per_group))


def test_a_slot_outside_the_cache_on_the_device_path_moves_nothing_and_never_verifies():
    """What a device does with a slot the host did not check (the launch itself, below the host checks): that move
    writes nothing, its digests are -1 (source) and -2 (destination), never equal; the other moves happen."""
    cache, _ = mixed_cache(torch.float32, seed=3)
    before = snapshot(cache)
    mover = tr.TritonRelocator(cache, Verifier(cache, VerifyConfig("strict", seed=SEED)))
    moves = torch.tensor([[1, 2], [NB * S, 3], [4, -1], [-5, 6]])
    outs = mover._digest_outputs(4)
    mover._launch_wave(moves, 4, None, outs, disjoint=False)
    src, dst = mover._as_digests(outs)
    after = snapshot(cache)
    for name in before:
        assert torch.equal(after[name][2], before[name][1]) and torch.equal(after[name][3], before[name][3])
        assert torch.equal(after[name][6], before[name][6])
    real = mover.digests_at(torch.tensor([1, 3, 4, 6]))
    for s, d, r in zip(src.per_group, dst.per_group, real.per_group):
        assert torch.equal(s[0], d[0]) and torch.equal(d[0], r[0])  # the good move: slot 1 to 2
        assert (s[1] == -1).all() and (d[1] == -2).all()  # source outside: never equal
        assert torch.equal(s[2], r[2]) and (d[2] == -2).all()  # destination outside (the source was read)
        assert (s[3] == -1).all() and (d[3] == -2).all()


# ---- refusals: named, before anything is written ------------------------------------------------------------
def test_bad_moves_are_refused_naming_the_culprit_and_nothing_is_written():
    cache, _ = mixed_cache(torch.float16, seed=3)
    before = snapshot(cache)
    mover = tr.TritonRelocator(cache, Verifier(cache, VerifyConfig("strict", seed=SEED)))
    t = torch.tensor
    refused = [
        (t([[0, 1], [2, NB * S]]), {}, BlockOutOfRangeError,
         f"move 1: destination slot {NB * S} (block {NB}, offset 0) outside the KV cache's {NB} blocks of {S}"),
        (t([[-1, 1]]), {}, BlockOutOfRangeError, f"move 0: source slot -1 (block -1, offset {S - 1})"),
        (t([[0, 5], [1, 5]]), {}, DestinationError, "move 1 writes slot 5, which move 0 of its wave"),
        (t([[0, 5], [5, 6]]), {"disjoint": True}, InvalidArgumentError, "move 1 reads slot 5, which move 0"),
        (t([[0.0, 1.0]]), {}, InvalidArgumentError, "int32 or int64 tensor [n, 2]"),
        (t([[0, 1, 2]]), {}, InvalidArgumentError, "got torch.int64 of shape (1, 3)"),
        (t([0, 1]), {}, InvalidArgumentError, "[n, 2]"),
        ([[0, 1]], {}, InvalidArgumentError, "got list"),
        (t([[0, 1], [2, 3]]), {"wave_ends": [1]}, InvalidArgumentError, "wave_ends"),
        (t([[0, 1], [2, 3]]), {"wave_ends": [1, 1, 2]}, InvalidArgumentError, "wave_ends"),
        (t([[0, 1], [2, 3]]), {"wave_ends": [2.0]}, InvalidArgumentError, "wave_ends"),
        (t([[0, 1], [2, 3]]), {"wave_ends": [0, 2]}, InvalidArgumentError, "wave_ends"),
    ]
    for moves, kwargs, error, match in refused:
        with pytest.raises(error, match=re.escape(match)):
            mover.relocate(moves, **kwargs)
    with pytest.raises(InvalidArgumentError, match="verifier's weights"):
        tr.TritonRelocator(cache).relocate(t([[0, 1]]), digests=True)
    with pytest.raises(InvalidArgumentError, match="count 13 outside \\[0, 12\\]"):
        mover.relocate_padded(torch.zeros((12, 2), dtype=torch.int64), t([13]))
    with pytest.raises(InvalidArgumentError, match="count must be"):
        mover.relocate_padded(torch.zeros((12, 2), dtype=torch.int64), 3)
    other, _ = mixed_cache(torch.float16, seed=3)
    with pytest.raises(InvalidArgumentError, match="Verifier of this very cache"):
        tr.TritonRelocator(cache, Verifier(other))
    with pytest.raises(BlockOutOfRangeError, match="move 0: destination slot"):
        tr.check_moves(cache, t([[0, NB * S]]))
    assert bits_equal(snapshot(cache), before) and mover.launches == 0
    tr.relocate(cache, t([[0, 1]]))
    assert not bits_equal(snapshot(cache), before)


def test_the_benchmark_needs_cuda():
    with pytest.raises(InvalidArgumentError, match="needs a CUDA device"):
        tr.benchmark("cpu")


# ---- planted bugs the comparisons catch ----------------------------------------------------------------------
def test_a_slot_decode_off_by_one_is_caught(monkeypatch):
    """Planted in the one slot decode every kernel uses: bits and digests no longer match the references."""
    copies = [([Move(0, 1, 0, 4, 0), Move(1, 2, 3, 5, 2)], "a")]
    check_against_reference(copies, torch.float32)
    monkeypatch.setattr(tr, "_decode_slot", _decode_offset_one_along)
    with pytest.raises(AssertionError, match="bits differ"):
        check_against_reference(copies, torch.float32)
    rng = random.Random("planted-decode")
    for _ in range(5):
        copies = random_copies(rng)
        if tr.copy_moves(copies, S)[0].numel():
            with pytest.raises(AssertionError, match="differ"):
                check_against_reference(copies, torch.float32)


def test_a_missed_wave_boundary_is_caught(monkeypatch):
    """Planted: the wave split loses its boundaries (one wave), so b reads what a wrote before a wrote it."""
    copies = [([Move(0, 1, 0, 4, 0)], "a"), ([Move(0, 4, 0, 5, 0)], "b")]
    check_against_reference(copies, torch.float16)
    real = tr.wave_ends
    monkeypatch.setattr(tr, "wave_ends", lambda moves, block_size, starts=None: real(moves, block_size, starts)[-1:])
    with pytest.raises(AssertionError, match="bits differ"):
        check_against_reference(copies, torch.float16)


def test_the_error_messages_name_moves_as_the_caller_numbered_them():
    cache, _ = mixed_cache()
    mover = tr.TritonRelocator(cache)
    moves = torch.tensor([[0, 1], [2, 3], [4, 3]])
    named = "move 2 writes slot 3, which move 1 of its wave (moves 0..2)"
    with pytest.raises(DestinationError, match=re.escape(named)):
        mover.relocate(moves)
    mover.relocate(moves, [2, 3])  # in two waves the later write wins, as in the torch path


# ---- the copy engine on the kernels (``TorchCopyEngine(triton=True)``) -------------------------------------------
def engine_step(copies, dtype, triton, mode="strict", on_mismatch="raise", seed=SEED):
    """A copy engine on a fresh ``mixed_cache`` submits ``copies`` as one step: (the bits it leaves, each copy's
    status at its first poll, the waves' digests as the engine holds them before that poll, the engine)."""
    cache, _ = mixed_cache(dtype, seed=3)
    config = VerifyConfig(mode, sample_every=2, on_mismatch=on_mismatch, seed=seed)
    eng = TorchCopyEngine(cache, Verifier(cache, config), triton=triton)
    handles = eng.submit_batch(copies)
    held = []
    for h in handles:
        w = eng._get(h).wave
        if w.src_digests is not None and all(w is not x for x in held):
            held.append(w)
    digests = [(w.src_digests.per_group, w.dst_digests.per_group) for w in held]
    statuses = [eng.poll(h) for h in handles]
    return snapshot(cache), statuses, digests, eng


@pytest.mark.parametrize("mode", ["off", "sampled", "strict"])
def test_the_engine_on_the_kernels_leaves_the_torch_engines_bits_statuses_and_digests(mode):
    """50 random steps per verify mode, fp16 and fp32: ``TorchCopyEngine(triton=True)`` leaves the bits the torch
    engine leaves, reports the same statuses, and holds per wave the same digests of the same verified copies (a
    sampled step verifies some copies of a wave, one in two drawn by its seed: the fused digests are cut to their
    rows). Its launches are the
    kernels': two per element width per wave."""
    rng = random.Random(f"triton-engine-{mode}")
    partial = 0
    for case in range(50):
        copies = random_copies(rng)
        dtype = (torch.float16, torch.float32)[case % 2]
        want, want_status, want_digests, ref = engine_step(copies, dtype, False, mode, seed=case)
        got, status, digests, eng = engine_step(copies, dtype, True, mode, seed=case)
        assert bits_equal(got, want), f"bits differ: {copies}"
        assert status == want_status == [CopyStatus.DONE] * len(copies)
        assert len(digests) == len(want_digests)
        for (src, dst), (want_src, want_dst) in zip(digests, want_digests):
            assert all(torch.equal(a, b) for a, b in zip(src, want_src)), f"source digests differ: {copies}"
            assert all(torch.equal(a, b) for a, b in zip(dst, want_dst)), f"destination digests differ: {copies}"
        moves, starts = tr.copy_moves(copies, S)
        assert eng.launches == 2 * len(eng.relocator.units) * len(tr.wave_ends(moves, S, starts))
        assert eng.verifier.counters.relocations == ref.verifier.counters.relocations == len(copies)
        partial += mode == "sampled" and any(0 < len(s[0]) < moves.shape[0] for s, _ in digests)
    assert mode != "sampled" or partial >= 3


def test_a_digest_mismatch_on_the_kernels_fails_its_own_copy_under_quarantine(monkeypatch, tmp_path):
    """A source digest of request b's second move altered as the kernel returns it (a torn read): b's copy is
    FAILED, a's and c's are DONE, and b alone is quarantined with its evidence; under ``raise`` it raises."""
    copies = [([Move(0, 1, 0, 4, 0)], "a"), ([Move(0, 2, 1, 5, 0), Move(1, 2, 2, 5, 1)], "b"),
              ([Move(0, 3, 0, 6, 3)], "c")]
    real = tr.TritonRelocator.relocate

    def torn(self, moves, wave_ends=None, *, digests=False, disjoint=False):
        got = real(self, moves, wave_ends, digests=digests, disjoint=disjoint)
        got[0].per_group[0][2, 0] += 1  # move 2 of the wave: b's second
        return got

    monkeypatch.setattr(tr.TritonRelocator, "relocate", torn)
    monkeypatch.chdir(tmp_path)
    _, statuses, _, eng = engine_step(copies, torch.float32, True, on_mismatch="quarantine")
    assert statuses == [CopyStatus.DONE, CopyStatus.FAILED, CopyStatus.DONE]
    assert list(eng.verifier.quarantined) == ["b"]
    with pytest.raises(RelocationMismatch, match="'b'"):
        engine_step(copies, torch.float32, True)
