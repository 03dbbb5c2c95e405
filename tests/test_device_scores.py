"""The device-side scores (``integration/device/scores.py``) against the core's reference, on the same rows.

A seeded episode drives one request's read list the way vLLM's worker sees it: tokens join, some are evicted,
the list is now and then resent whole in another order (the dense path's position order), and every step an
attention row arrives. The core's ``TokenScores`` records the same rows by token id. After every step both
must hold bit-identical scores, and wherever the list is in logical order (as vLLM's always are)
``DeviceScores.rank`` must return what H2O's, Scissorhands', TOVA's and Knorm's ``select_victims`` return, in
the same order, for random budgets, windows and protected tokens. Key norms (Knorm) arrive as tokens join, and
now and then again for tokens already there (a list resent whole reads them again).
"""

import random
import struct

import pytest
import torch

from vtoken.core.policies.base import RequestView
from vtoken.core.policies.h2o import H2O
from vtoken.core.policies.knorm import Knorm
from vtoken.core.policies.scissorhands import Scissorhands
from vtoken.core.policies.snapkv import SnapKV
from vtoken.core.policies.tova import TOVA
from vtoken.core.errors import InvalidArgumentError
from vtoken.core.scores import TokenScores
from vtoken.integration.device.scores import DeviceScores

POLICIES = [H2O(), H2O(recent_fraction=0.0), H2O(recent_fraction=0.9), Scissorhands(),
            Scissorhands(recent_fraction=0.0), TOVA(), TOVA(keep_recent=0), TOVA(keep_recent=5), Knorm(),
            Knorm(keep_recent=0), Knorm(keep_recent=4), SnapKV(), SnapKV(window=2)]
EVERY = ("accumulated", "persistence", "latest", "key_norm", "observed")


def f32_bits(xs) -> list[int]:
    return [struct.unpack("<I", struct.pack("<f", x))[0] for x in xs]


def row_for(rng: random.Random, n: int) -> list[float]:
    """Softmax-like weights; a third of the rows coarse (many exact ties), some exact zeros."""
    if rng.random() < 0.33:
        w = [rng.choice((0.0, 1.0, 1.0, 2.0)) for _ in range(n)]
    else:
        w = [rng.random() ** 3 for _ in range(n)]
    s = sum(w) or 1.0
    return [x / s for x in w]


def episode(seed: int, steps: int = 60, accumulate=None):
    """Yields (device, reference, ids, live, total) after each step; ``accumulate`` replaces the device's record
    (a planted arithmetic) when given."""
    rng = random.Random(seed)
    dev, ref = DeviceScores(statistics=EVERY), TokenScores(statistics=("latest", "key_norm", "observed"))
    ref.add_request("r")
    if accumulate is not None:
        dev.record = accumulate.__get__(dev)
    total = rng.randint(1, 40)
    ids = torch.arange(total, dtype=torch.int64)
    dev.realign("r", None, ids)
    ref.extend("r", total)
    for _ in range(steps):
        if rng.random() < 0.5 and len(ids) > 2:  # evictions
            gone = set(rng.sample(ids.tolist(), rng.randint(1, max(1, len(ids) // 4))))
            keep = torch.tensor([t not in gone for t in ids.tolist()])
            ids = ids[keep]
            dev.keep("r", keep)
        joined = rng.randint(0, 3)  # decode appends one; a prefill chunk several
        if joined:
            ids = torch.cat((ids, torch.arange(total, total + joined, dtype=torch.int64)))
            dev.extend("r", joined)
            total += joined
            ref.extend("r", total)
        if rng.random() < 0.15:  # resent whole, in another order, or in logical order again
            old = ids
            ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(rng.randrange(2**31)))]
            if rng.random() < 0.5:
                ids = ids.sort().values
            dev.realign("r", old, ids)
        if joined or rng.random() < 0.2:  # the joined tokens' key norms, sometimes a few older ones' again
            at = list(range(len(ids) - joined, len(ids))) + rng.sample(range(len(ids)), min(len(ids), rng.randint(0, 2)))
            at = sorted(set(at))
            norms = [rng.choice((0.5, 1.0, 2.0)) if rng.random() < 0.3 else rng.random() * 4 for _ in at]
            dev.set_keys("r", torch.tensor(at, dtype=torch.int64), torch.tensor(norms, dtype=torch.float64))
            ref.record_keys("r", [ids.tolist()[i] for i in at], norms)
        if rng.random() < 0.1:  # a prompt completes (or is recomputed): its observation, over the whole list
            votes = row_for(rng, len(ids))
            dev.set_values("observed", "r", torch.arange(len(ids)), torch.tensor(votes, dtype=torch.float64))
            ref.record_observed("r", ids.tolist(), votes)
        w = row_for(rng, len(ids))
        dev.record("r", torch.tensor(w, dtype=torch.float64))
        ref.record("r", ids.tolist(), w)
        yield dev, ref, ids, sorted(ids.tolist()), total, rng


def compare_episode(seed: int) -> tuple[int, int]:
    """Scores compared every step, victims wherever the list is in logical order; returns (steps whose choice
    was not empty, of them those of one victim)."""
    ranked = single = 0
    for dev, ref, ids, live, total, rng in episode(seed):
        ordered = ids.tolist() == live  # after a reordering, until the list is resent in logical order
        acc, per = dev.values("r")
        assert f32_bits(acc.tolist()) == f32_bits(ref.accumulated("r", t) for t in ids.tolist())
        assert f32_bits(per.tolist()) == f32_bits(ref.persistence("r", t) for t in ids.tolist())
        for name in ("latest", "key_norm", "observed"):
            assert f32_bits(dev.values("r", name).tolist()) == f32_bits(ref.reader("r", name)(t) for t in ids.tolist())
        a, p = ref.readers("r")
        protected = frozenset(rng.sample(live, rng.randint(0, 2)) if live and rng.random() < 0.3 else ())
        view = RequestView("r", live, total, budget=rng.randint(1, max(1, len(live))), accumulated=a,
                           persistence=p, latest=ref.reader("r", "latest"), key_norm=ref.reader("r", "key_norm"),
                           observed=ref.reader("r", "observed"),
                           protected=protected)
        if not view.excess:
            continue
        for policy in POLICIES:
            rk = policy.ranking(view)
            want = policy.select_victims(view)
            if ordered:  # rank's precondition, which vLLM's read lists meet: ids ascend
                assert dev.rank("r", ids, rk, rk.bound(view), tuple(sorted(protected))) == want, (seed, policy)
                ranked += bool(want)
                single += len(want) == 1
    return ranked, single


@pytest.mark.parametrize("seed", range(12))
def test_device_scores_equal_the_cores_bit_for_bit_and_rank_the_same_victims(seed):
    ranked, _ = compare_episode(seed)
    assert ranked > 20  # the comparison ran on real choices


def test_the_episodes_compare_single_victims_too():
    """One victim takes ``rank``'s argmin path, several its stable sort: the episodes exercise both."""
    singles = [compare_episode(seed)[1] for seed in range(12)]
    assert sum(singles) > 20, singles


def test_a_float32_accumulation_is_not_the_cores_arithmetic():
    """Teeth: adding the row in float32 (rounding each weight first) drifts from the reference."""
    def float32_record(self, rid, row):
        acc, per = self._s["accumulated"], self._s["persistence"]
        acc[rid] = acc[rid] + row.to(torch.float32)
        per[rid] = per[rid] * self.decay + (row >= 1.0 / len(row)).to(torch.float32)
        self._s["latest"][rid] = row.to(torch.float32)

    drifted = 0
    for seed in range(4):
        for dev, ref, ids, *_ in episode(seed, accumulate=float32_record):
            acc = dev.values("r")[0].tolist()
            drifted += f32_bits(acc) != f32_bits(ref.accumulated("r", t) for t in ids.tolist())
    assert drifted > 0


def test_ranking_breaks_ties_by_the_older_token_and_keeps_the_recent_window():
    dev = DeviceScores()
    shuffled = torch.tensor([5, 1, 3, 0, 4, 2], dtype=torch.int64)
    dev.realign("r", None, shuffled)
    dev.record("r", torch.tensor([0.5, 0.0, 0.25, 0.0, 0.25, 0.0], dtype=torch.float64))
    ids = torch.arange(6)
    dev.realign("r", shuffled, ids)  # resent in logical order: each token keeps its scores
    assert dev.values("r")[0].tolist() == [0.0, 0.0, 0.0, 0.25, 0.25, 0.5]
    view = RequestView("r", list(range(6)), 6, budget=2)
    rk = H2O(recent_fraction=0.5).ranking(view)  # excess 4, keep the newest 1 (id 5)
    assert (rk.count, rk.keep_recent, rk.bound(view)) == (4, 1, 5)
    assert dev.rank("r", ids, rk, rk.bound(view)) == [0, 1, 2, 3]  # zeros by id, then 3 (0.25) before 4
    assert dev.rank("r", ids, rk, rk.bound(view), protected=(1,)) == [0, 2, 3, 4]
    one = rk._replace(count=1)
    assert dev.rank("r", ids, one, rk.bound(view)) == [0]  # the oldest of equal minima


@pytest.mark.parametrize("seed", range(8))
def test_a_batch_of_rows_records_bit_for_bit_what_each_row_records_alone(seed):
    """``record_all`` (the worker's one batch per step) against ``record`` request by request (itself checked
    against ``TokenScores`` above): requests of different lengths, empty ones included, that shrink and grow
    between steps, with random garbage in the padding, which must reach no score."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    alone, batch = DeviceScores(), DeviceScores()
    rids = [f"r{i}" for i in range(rng.randint(1, 6))]
    lengths = {r: rng.randint(0, 30) for r in rids}
    for d in (alone, batch):
        for r in rids:
            d.realign(r, None, torch.arange(lengths[r]))
    for _ in range(20):
        for r in rids:
            if lengths[r] and rng.random() < 0.3:
                keep = torch.tensor([rng.random() < 0.7 for _ in range(lengths[r])])
                alone.keep(r, keep)
                batch.keep(r, keep)
                lengths[r] = int(keep.sum())
            if rng.random() < 0.5:
                j = rng.randint(1, 3)
                alone.extend(r, j)
                batch.extend(r, j)
                lengths[r] += j
        rows = torch.rand(len(rids), max(lengths.values()) + rng.randint(0, 3), dtype=torch.float64, generator=gen)
        for i, r in enumerate(rids):
            rows[i, :lengths[r]] = torch.tensor(row_for(rng, lengths[r]), dtype=torch.float64)
            alone.record(r, rows[i, :lengths[r]].clone())
        batch.record_all(rids, rows, [lengths[r] for r in rids])
        for r in rids:
            for a, b in zip(alone.values(r), batch.values(r)):
                assert f32_bits(a.tolist()) == f32_bits(b.tolist()), r


def test_a_batch_whose_rows_do_not_fit_the_scores_is_refused_and_changes_nothing():
    d = DeviceScores()
    d.realign("a", None, torch.arange(3))
    d.realign("b", None, torch.arange(2))
    before = [t.clone() for r in ("a", "b") for t in d.values(r)]
    with pytest.raises(InvalidArgumentError, match="^request 'b': an attention row of 3 tokens for 2 scored tokens"):
        d.record_all(["a", "b"], torch.full((2, 3), 0.5, dtype=torch.float64), [3, 3])
    with pytest.raises(InvalidArgumentError, match=r"^attention rows of shape \(1, 3\) for 2 requests"):
        d.record_all(["a", "b"], torch.full((1, 3), 0.5, dtype=torch.float64), [3, 2])
    assert all(torch.equal(x, y) for x, y in zip(before, [t for r in ("a", "b") for t in d.values(r)]))


def test_a_descending_key_ranks_largest_first_and_two_keys_cannot_mix_directions():
    from vtoken.core.policies.base import Ranking
    dev = DeviceScores(statistics=("key_norm",))
    ids = torch.arange(6)
    dev.realign("r", None, ids)
    dev.set_keys("r", ids, torch.tensor([1.0, 3.0, 0.5, 3.0, 2.0, 9.0], dtype=torch.float64))
    assert dev.rank("r", ids, Ranking(3, 1, ("-key_norm",)), 5) == [1, 3, 4]  # 5 is recent; 1 before 3 (older)
    assert dev.rank("r", ids, Ranking(1, 1, ("-key_norm",)), 5) == [1]
    with pytest.raises(InvalidArgumentError, match="cannot rank by"):  # bad input, not a broken invariant
        dev.rank("r", ids, Ranking(1, 1, ("latest",)), 5)  # not recorded for this policy
    with pytest.raises(InvalidArgumentError, match="cannot rank by"):
        DeviceScores(statistics=EVERY).rank("r", ids, Ranking(1, 1, ("-key_norm", "accumulated")), 5)


@pytest.mark.parametrize("kernel", [1, 3, 5, 7])
def test_the_workers_pooling_is_snapkvs_reference_pooling(kernel):
    """``WorkerTokens._take_votes`` pools with torch's ``avg_pool1d``; ``snapkv.pool_votes`` is the definition.
    Lists shorter than the kernel included (a prompt of a few tokens)."""
    from vtoken.core.policies.snapkv import pool_votes
    rng = random.Random(kernel)
    for n in (1, 2, kernel, 3 * kernel + 1, 40):
        votes = [rng.random() for _ in range(n)]
        got = torch.nn.functional.avg_pool1d(torch.tensor(votes, dtype=torch.float64).view(1, 1, n), kernel,
                                             stride=1, padding=kernel // 2).flatten().tolist()
        assert got == pytest.approx(pool_votes(votes, kernel), rel=1e-12, abs=1e-15)
