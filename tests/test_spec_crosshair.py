"""The CrossHair contract check: clean on the core, and able to find planted contract violations.

Runs ``crosshair check`` twice as a subprocess (about a minute on the core, a few seconds on
the planted module); see spec/crosshair_check.py for the command line and its time bounds.
"""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("crosshair")

from vtoken.spec import crosshair_check
from vtoken.spec.crosshair_check import (
    DEFAULT_TARGETS,
    NOT_FOUND,
    ConditionResult,
    CrosshairReport,
    obligations,
    run_crosshair,
)
from vtoken.spec.obligations import BOUNDED, COUNTEREXAMPLE, UNKNOWN

# Postcondition lines in core's docstrings (a drop means a contract stopped parsing or was lost).
MIN_CORE_CONDITIONS = 24  # 26 since evict_tokens (issue #20 part 6)


def test_core_contracts_have_no_counterexample_within_the_bound():
    rep = run_crosshair()
    assert not rep.crashed, rep.summary() + "\n" + rep.stderr[-3000:]
    assert rep.clean, "\n".join(str(c) for c in rep.counterexamples)
    # --report_all prints one line per analysed postcondition: every contract was reached
    assert len(rep.checked) >= MIN_CORE_CONDITIONS, rep.stdout
    files = {c.path.rsplit("/", 1)[-1] for c in rep.checked}
    assert files == {"block_pool.py", "token_table.py", "compact.py", "densify.py", "relocate.py", "plan.py"}
    assert rep.seconds < crosshair_check.TOTAL_TIMEOUT


PLANTED = '''
"""Copies of core code with planted bugs, each under the original's contract."""
from collections import Counter
from typing import Iterable

from crosshair import register_type

from typing import Sequence

from vtoken.core.reference import contracts
from vtoken.core.block_pool import BlockOutOfRangeError, BlockPool, DoubleFreeError
from vtoken.core.reference.compact import choose_sources
from vtoken.core.plan import NoPlan, Plan, PlanKind
from vtoken.core.token_table import Move, RequestSnapshot
from vtoken.spec.crosshair_states import make_pool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size), planted: floor division.

    pre: num_tokens >= 0
    pre: block_size >= 1
    post: num_tokens <= __return__ * block_size < num_tokens + block_size
    """
    return num_tokens // block_size


class PlantedPool(BlockPool):
    def free(self, block_ids: Iterable[int]) -> None:
        """BlockPool.free, planted: a block whose count reaches 0 never joins the free queue.

        raises: DoubleFreeError, BlockOutOfRangeError
        post:
            self.free_block_ids()[:__old__.self.num_free] == __old__.self.free_block_ids() and all(self.ref_count(b) == 0 for b in self.free_block_ids())
            sorted(self.free_block_ids()) == [b for b in range(self.num_blocks) if self.ref_count(b) == 0]
        """
        ids = list(block_ids)
        drops = Counter(ids)
        for b, k in drops.items():
            self._check_range(b)
            if self._ref[b] < k:
                raise DoubleFreeError(f"block {b} freed {k} time(s) but holds {self._ref[b]} reference(s)")
        for b in ids:
            self._ref[b] -= 1


# reachable pools of the planted class, as spec/crosshair_states.py builds them for BlockPool
register_type(PlantedPool, lambda factory: make_pool(factory, PlantedPool))


def plan_compaction(snap: RequestSnapshot, dst_blocks: Sequence[int], max_sources: int) -> Plan | NoPlan:
    """compact.plan_compaction, planted: the destinations are filled from their second slot.

    pre: max_sources >= 1
    pre: all(b not in snap.blocks and b not in dst_blocks[:i] for i, b in enumerate(dst_blocks))  # distinct, fresh
    post: not __return__ or contracts.compact_fills_in_logical_order(snap, __return__)
    """
    choice = choose_sources(snap, max_sources, len(dst_blocks))
    if not choice:
        return choice
    S = snap.block_size
    tokens = [(t, s) for t, s in snap.live_slots() if s // S in choice.src_blocks]
    dsts = tuple(dst_blocks[: choice.num_dst])
    moves = tuple(Move(t, s // S, s % S, dsts[(i + 1) // S % len(dsts)], (i + 1) % S) for i, (t, s) in enumerate(tokens))
    return Plan(PlanKind.COMPACT, snap.req_id, snap.version, moves, choice.src_blocks, dsts)
'''


def test_planted_contract_violations_are_found(tmp_path):
    (tmp_path / "vtoken_planted.py").write_text(textwrap.dedent(PLANTED))
    # plan_compaction's counterexample needs a snapshot with a plan to make: about 5 s of CPU on a quiet runner,
    # several times that on a loaded one (the budget is generous: finding it early ends the search)
    rep = run_crosshair(["vtoken_planted.blocks_needed", "vtoken_planted.plan_compaction"], per_condition_timeout=40.0,
                        per_path_timeout=6.0, total_timeout=150.0, extra_paths=[str(tmp_path)])
    # NOTE: free's search goes on to the end of its budget after the counterexample (found within 1 s per condition
    # on a quiet runner), for each of its two conditions: a budget of its own, 10x that, not plan_compaction's 40 s
    rep_free = run_crosshair(["vtoken_planted.PlantedPool.free"], per_condition_timeout=10.0, per_path_timeout=6.0,
                             total_timeout=60.0, extra_paths=[str(tmp_path)])
    for r in (rep, rep_free):
        assert not r.crashed, r.summary() + "\n" + r.stderr[-3000:]
    found = {c.message.split(" when calling ")[-1].split("(")[0] for c in rep.counterexamples + rep_free.counterexamples}
    assert found == {"blocks_needed", "free", "plan_compaction"}, rep.stdout + rep_free.stdout  # a named predicate too
    ceil = next(c for c in rep.counterexamples if "blocks_needed" in c.message)
    assert ceil.message.startswith("false when calling blocks_needed(")
    free = next(c for c in rep_free.counterexamples if "free(" in c.message)
    assert "PlantedPool(" in free.message and " after [" in free.message  # the history that built the pool


# ---- the obligation's three outcomes, without running CrossHair again --------------------------------
def _report(returncode, stdout="", stderr=""):
    rep = CrosshairReport(list(DEFAULT_TARGETS), ["crosshair"], 1.5, 0.75, 100.0, returncode, 1.0,
                          stdout=stdout, stderr=stderr)
    crosshair_check._parse(rep)
    return rep


def test_obligation_outcomes(monkeypatch):
    (ob,) = obligations()
    assert (ob.id, ob.invariant, ob.transition) == ("contracts/core", "contracts", "core public API")

    monkeypatch.setattr(crosshair_check, "run_crosshair", lambda: _report(0, "/x/plan.py:80: info: Not confirmed.\n"))
    out = ob.check()
    assert out.status == BOUNDED and out.label == "bounded (1.5 s CPU per condition)" and out.detail.startswith(NOT_FOUND)

    bad = "/x/block_pool.py:213: error: false when calling blocks_needed(1, 2) (which returns 0)\n"
    monkeypatch.setattr(crosshair_check, "run_crosshair", lambda: _report(1, bad))
    out = ob.check()
    assert out.status == COUNTEREXAMPLE and out.detail == bad.strip()

    monkeypatch.setattr(crosshair_check, "run_crosshair", lambda: _report(1, "", "Traceback ...\nKeyError: 'x'"))
    assert ob.check().status == UNKNOWN  # exit 1 without a counterexample line: the tool crashed
    monkeypatch.setattr(crosshair_check, "run_crosshair", lambda: _report(None))
    assert ob.check().status == UNKNOWN  # killed at the total timeout


def test_output_parsing():
    rep = _report(1, "noise\n/a/b.py:12: error: false when calling f(1)\n/a/c.py:3: info: Confirmed over all paths.\n")
    assert rep.counterexamples == [ConditionResult("/a/b.py", 12, "error", "false when calling f(1)")]
    assert [c.line for c in rep.confirmed] == [3] and not rep.crashed and not rep.clean
