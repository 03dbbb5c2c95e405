"""The compiled host mover (``integration/fastpath/relocate.py``) against the device layer's torch moves, its
reference: the same waves leave the same bits in every layout and dtype, a bad slot is refused before anything is
written, and strict verify's digests catch a mover that misplaces tokens."""

from __future__ import annotations

import random
import re
from array import array

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from test_device_layer import DTYPES, NB, S, bits_equal, fp8_dtypes, mixed_cache, random_copies, snapshot  # noqa: E402
from vtoken.core.copy_engine import CopyStatus  # noqa: E402
from vtoken.core.errors import BlockOutOfRangeError, VTokenError  # noqa: E402
from vtoken.core.token_table import Move  # noqa: E402
from vtoken.integration.device.copy_engine import TorchCopyEngine  # noqa: E402
from vtoken.integration.device.verify import RelocationMismatch, Verifier, VerifyConfig  # noqa: E402
from vtoken.integration.device.copy_engine import check_copies, waves  # noqa: E402
from vtoken.integration.fastpath.moves import MoveArray  # noqa: E402
from vtoken.integration.fastpath.relocate import HostMover, host_mover  # noqa: E402


def run(copies, dtype, mover: bool, verify: str = "off"):
    cache, _ = mixed_cache(dtype, seed=3)
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig(verify)), mover=host_mover(cache) if mover else None)
    statuses = [eng.poll(h) for h in eng.submit_batch(copies)]
    return snapshot(cache), statuses, eng


@pytest.mark.parametrize("dtype", DTYPES + fp8_dtypes(), ids=str)
def test_the_mover_leaves_the_bits_torchs_gather_and_scatter_leave(dtype):
    """200 random steps per dtype, every layout of ``mixed_cache`` (two GPU layouts, stacked MQA, vLLM's CPU
    layout): bit for bit what the reference leaves, with as many waves."""
    rng = random.Random(f"relocate-{dtype}")
    for case in range(200):
        copies = random_copies(rng)
        want, want_status, ref = run(copies, dtype, mover=False)
        got, got_status, eng = run(copies, dtype, mover=True)
        assert got_status == want_status == [CopyStatus.DONE] * len(copies)
        assert bits_equal(got, want), f"case {case}: {copies}"
        assert eng.launches == ref.launches // 2  # one call per group per wave, where torch makes two


def test_the_mover_runs_only_on_the_cpu_and_is_used_by_default_there():
    cache, _ = mixed_cache()
    mover = host_mover(cache)
    assert isinstance(mover, HostMover) and len(mover.groups) == len(cache.groups)
    assert TorchCopyEngine(cache, mover=mover).mover is mover


def test_a_move_outside_the_cache_is_refused_before_anything_is_written():
    cache, _ = mixed_cache()
    before = snapshot(cache)
    mover = host_mover(cache)
    inside = [0, 0, 1, 1, 2]
    for moves, named in (([inside, [1, 0, 2, NB, 0]], f"move (1, 0, 2, {NB}, 0) leaves the KV cache's {NB} blocks"),
                         ([[0, -1, 3, 0, 0]], "move (0, -1, 3, 0, 0)"), ([inside, [1, 0, S, 1, 0]], f"(1, 0, {S}, 1, 0)"),
                         ([[0, 0, 0, 0, -1]], "(0, 0, 0, 0, -1)")):
        with pytest.raises(BlockOutOfRangeError, match=re.escape(named)):
            mover(array("q", [f for m in moves for f in m]))
    for bad in (array("q", [0, 1, 2]), np.zeros((2, 4), np.int64), np.zeros((1, 5), np.int32), [inside]):
        with pytest.raises(BlockOutOfRangeError, match="five int64 fields each"):
            mover(bad)
    assert bits_equal(snapshot(cache), before) and mover.calls == 0


def test_a_wave_nobody_verifies_goes_to_the_mover_as_packed_moves_without_slot_tensors():
    """The mover reads the wave's packed moves; torch's slot tensors are built only where the digests read them."""
    copies = [([Move(0, 1, 0, 4, 0), Move(1, 1, 1, 4, 1)], "a"), ([Move(0, 2, 0, 5, 0)], "b")]
    for verify, slots in (("off", None), ("strict", [4 * S, 4 * S + 1, 5 * S])):
        _, statuses, eng = run(copies, torch.float32, mover=True, verify=verify)
        assert statuses == [CopyStatus.DONE] * 2
        [wave] = {id(c.wave): c.wave for c in eng._copies.values()}.values()
        assert list(wave.moves) == [f for moves, _ in copies for m in moves for f in m]
        assert (wave.dst_slots if slots is None else wave.dst_slots.tolist()) == slots


def test_strict_verify_catches_a_mover_that_misplaces_tokens():
    """Planted: a mover that writes each token one destination along. The digests, read by torch from the sources
    before and from the destinations after, differ: the copy fails, naming its request."""
    cache, _ = mixed_cache()
    good = host_mover(cache)
    def one_along(moves):
        moves = np.frombuffer(moves, np.int64).reshape(-1, 5).copy()
        moves[:, 3:] = np.roll(moves[:, 3:], 1, axis=0)
        good(moves)

    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict", on_mismatch="raise")), mover=one_along)
    with pytest.raises(RelocationMismatch, match="request 'a'"):
        eng.wait(eng.submit([Move(0, 1, 0, 4, 0), Move(1, 1, 1, 4, 1)], req_id="a"))


def test_a_workers_batch_nobody_verifies_runs_as_submit_batch_runs_it_without_handles():
    """``run_batch`` (the workers' step) with verification off: the bits, statuses, launches and relocation count of
    ``submit_batch`` then ``wait`` and ``release`` of each copy, over 100 random steps with read-after-write waves,
    and no handle left behind; under strict verify it is that very path (handles made, digests compared)."""
    rng = random.Random("run-batch")
    for case in range(100):
        copies = random_copies(rng)
        if case % 2:  # packed, as the scheduler sends them: the mover's compiled split (``HostMover.waves``)
            copies = [(MoveArray(array("q", [f for m in moves for f in m])), r) for moves, r in copies]
        want, want_status, ref = run(copies, torch.float32, mover=True)
        for h in list(ref._copies):
            ref.release(h)
        cache, _ = mixed_cache(torch.float32, seed=3)
        eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("off")), mover=host_mover(cache))
        assert eng.run_batch(copies) == want_status, f"case {case}: {copies}"
        assert bits_equal(snapshot(cache), want) and eng._copies == {} and eng.launches == ref.launches
        assert eng.verifier.counters.relocations == ref.verifier.counters.relocations == len(copies)
    cache, _ = mixed_cache(torch.float32, seed=3)
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict")), mover=host_mover(cache))
    assert eng.run_batch(copies) == want_status and eng.verifier.counters.verified == len(copies) and not eng._copies


def test_a_wave_that_fails_to_launch_fails_its_copies_only():
    """Three copies, the second reads what the first writes (waves [a] and [b, c]); the second wave's launch raises:
    its two copies are FAILED, the first wave's DONE, with handles (``submit_batch``) or without (``run_batch``)."""
    copies = [([Move(0, 1, 0, 4, 0)], "a"), ([Move(0, 4, 0, 5, 0)], "b"), ([Move(1, 2, 0, 6, 0)], "c")]
    for batch in ("run_batch", "submit_batch"):
        cache, _ = mixed_cache()
        eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("off")), mover=host_mover(cache))
        real, calls = eng._launch, []

        def launch(wave, src, rows):
            calls.append(len(wave.moves) // 5)
            if len(calls) == 2:
                raise RuntimeError("planted: the launch fails")
            real(wave, src, rows)
        eng._launch = launch
        got = eng.run_batch(copies) if batch == "run_batch" else [eng.wait(h) for h in eng.submit_batch(copies)]
        assert got == [CopyStatus.DONE, CopyStatus.FAILED, CopyStatus.FAILED] and calls == [1, 2], batch


def test_the_movers_compiled_split_is_the_python_check_and_split_or_declines():
    """``HostMover.waves`` (one kernel call) against ``waves(check_copies(...))``, its reference, on 300 random
    packed batches with read-after-write and write-after-write waves: the same waves and moves; where a move leaves
    the cache or two moves write one slot it declines (None), so the Python checks name the culprit or split it."""
    cache, _ = mixed_cache()
    mover = host_mover(cache)
    rng = random.Random("split-waves")
    declined = 0
    for case in range(300):
        copies = [(MoveArray(array("q", [f for m in moves for f in m])), r) for moves, r in random_copies(rng)]
        if case % 10 == 9:  # a move outside the cache
            k = rng.randrange(len(copies))
            fields = array("q", copies[k][0].fields) + array("q", [0, 1, 0, NB, 0])
            copies[k] = (MoveArray(fields), copies[k][1])
        got = mover.waves(copies)
        try:
            want = list(waves(check_copies(copies, NB, S)))
        except VTokenError:  # the reference names the move (``check_moves``)
            assert got is None, case
            declined += 1
            continue
        dst = [(m.dst_block, m.dst_offset) for moves, _ in copies for m in moves]
        if len(set(dst)) < len(dst) or not dst:  # the Python pass decides these
            assert got is None, case
            declined += 1
            continue
        assert [(a, b, list(f)) for a, b, f in got] == [(a, b, list(f)) for a, b, f in want], f"case {case}"
    assert 30 <= declined <= 200  # and at least 100 batches compared
    assert mover.waves([([Move(0, 1, 0, 2, 0)], "a")]) is None  # not packed: the Python checks run


def test_a_batch_after_one_of_many_waves_splits_only_on_its_own_writes():
    """``split_waves`` stamps the blocks a wave writes and never resets them: a batch must not read the previous
    batch's stamps as its own. Three chained copies (three waves), then two independent copies, one reading the block
    the last wave wrote: one wave, as the reference splits it. Found by the relocation kernels' mutation run
    (fuzz/mutation_relocate.json): a wave stamp stepping by 2 reached past the batch's stamps into the next one."""
    cache, _ = mixed_cache()
    mover = host_mover(cache)
    packed = lambda moves: [(MoveArray(array("q", [f for m in ms for f in m])), r) for ms, r in moves]  # noqa: E731
    chained = packed([([Move(0, 1, 0, 2, 0)], "a"), ([Move(1, 2, 1, 3, 0)], "b"), ([Move(2, 3, 1, 4, 0)], "c")])
    apart = packed([([Move(3, 5, 0, 6, 0)], "d"), ([Move(4, 4, 1, 7, 0)], "e")])
    for copies, n in ((chained, 3), (apart, 1)):
        got, want = mover.waves(copies), list(waves(check_copies(copies, NB, S)))
        assert len(want) == n and [(a, b, list(f)) for a, b, f in got] == [(a, b, list(f)) for a, b, f in want]
