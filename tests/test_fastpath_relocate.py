"""The compiled host mover (``integration/fastpath/relocate.py``) against the device layer's torch moves, its
reference: the same waves leave the same bits in every layout and dtype, a bad slot is refused before anything is
written, and strict verify's digests catch a mover that misplaces tokens."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("numba")

from test_device_layer import DTYPES, NB, S, bits_equal, fp8_dtypes, mixed_cache, snapshot  # noqa: E402
from vtoken.core.copy_engine import CopyStatus  # noqa: E402
from vtoken.core.errors import BlockOutOfRangeError  # noqa: E402
from vtoken.core.token_table import Move  # noqa: E402
from vtoken.integration.device.copy_engine import TorchCopyEngine  # noqa: E402
from vtoken.integration.device.verify import RelocationMismatch, Verifier, VerifyConfig  # noqa: E402
from vtoken.integration.fastpath.relocate import HostMover, host_mover  # noqa: E402


def random_copies(rng: random.Random) -> list:
    """A step's copies: up to 4 requests, each up to 6 moves to distinct destinations (a destination may be a
    source of the same copy: a cycle); copies may read or write what earlier ones write (new waves)."""
    copies = []
    for r in range(rng.randint(1, 4)):
        dsts = rng.sample(range(NB * S), rng.randint(0, 6))
        moves = [Move(i, *divmod(rng.randrange(NB * S), S), *divmod(d, S)) for i, d in enumerate(dsts)]
        copies.append((moves, f"r{r}"))
    return copies


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


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written():
    cache, _ = mixed_cache()
    before = snapshot(cache)
    mover = host_mover(cache)
    for src, dst in (([0, 1], [2, NB * S]), ([-1], [3]), ([0, 1], [2])):
        with pytest.raises(BlockOutOfRangeError):
            mover(torch.tensor(src), torch.tensor(dst))
    assert bits_equal(snapshot(cache), before) and mover.calls == 0


def test_strict_verify_catches_a_mover_that_misplaces_tokens():
    """Planted: a mover that writes each token one destination along. The digests, read by torch from the sources
    before and from the destinations after, differ: the copy fails, naming its request."""
    cache, _ = mixed_cache()
    good = host_mover(cache)
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict", on_mismatch="raise")),
                          mover=lambda src, dst: good(src, dst.roll(1)))
    with pytest.raises(RelocationMismatch, match="request 'a'"):
        eng.wait(eng.submit([Move(0, 1, 0, 4, 0), Move(1, 1, 1, 4, 1)], req_id="a"))
