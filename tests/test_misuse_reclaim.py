"""Misuse of the reclamation manager, its configuration and the copy engines' public calls (issue #15).

Each case is one wrong call on a live system: a request "a" with a compact plan whose copy is pending
(the standard scene of tests/test_reclamation.py: live tokens 0 | 7 | 8 9 | 12 13 in blocks [0, 1, 2, 3],
packing into block 6), a full request "b" in block 4, and "gone" (block 5), already removed from the table but not
yet reported to the manager. For every case the test asserts the exact ``VTokenError`` subclass, that the
message names the culprit (the bad value, field or request), and that a deep byte snapshot of everything
reachable from the system (pool, table, manager with its plans and stats, engine with its copies, tags or
tensors) is identical before and after: a rejected call changes nothing.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Callable

import pytest

from vtoken.core.block_pool import BlockPool, Purpose
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.errors import CopyStateError, UnknownCopyHandleError
from vtoken.core.errors import (
    BlockNotOwnedError,
    BlockOutOfRangeError,
    ConfigError,
    DestinationError,
    DoubleFreeError,
    DuplicateRequestError,
    InvalidArgumentError,
    MoveSourceMismatchError,
    PlanConflictError,
    TokenOutOfRangeError,
    UnknownRequestError,
    VTokenError,
)
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
from vtoken.core.reclamation import (
    PlanState,
    ReclaimConfig,
    ReclamationManager,
    RequestStillRegisteredError,
)
from vtoken.core.token_table import Move, TokenTable

NB, S = 8, 4
EVICT = [1, 2, 3, 4, 5, 6, 10, 11]


@dataclass
class Scene:
    pool: BlockPool
    table: TokenTable
    engine: object
    manager: ReclamationManager
    handle: int  # the pending copy of "a"'s plan
    gone_blocks: list[int]  # what "gone" held ([5]); the pool still has them allocated

    def state(self) -> tuple:
        """What a rejected call must leave untouched: the core's own snapshots, and a pickle of every object
        reachable from the system (independent of those methods, so a bug in them cannot hide a mutation)."""
        m = self.manager
        return (self.pool.snapshot(), self.table.state(),
                tuple((k, r.state, r.handle, r.held, r.abort_reason) for k, r in m.inflight.items()),
                tuple((r.plan.req_id, r.state, r.handle, r.held) for r in m.orphans), repr(m.stats),
                tuple((h, c.moves, c.status, c.released) for h, c in self.engine._copies.items()),  # poll may settle
                pickle.dumps((self.pool, self.table, m, self.engine)))


def tensor_engine():
    torch = pytest.importorskip("torch")
    from vtoken.integration.device.copy_engine import TorchCopyEngine
    from vtoken.integration.device.kv_cache import PagedKVCache
    from vtoken.integration.device.kv_layout import gpu_planes
    from vtoken.integration.device.verify import Verifier, VerifyConfig

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(NB, S, 2, 3, generator=g), torch.randn(NB, S, 2, 3, generator=g)
    cache = PagedKVCache(gpu_planes("l0", (k, v)))
    return TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict")))


def scene(engine: str = "memory") -> Scene:
    pool, table = BlockPool(NB, S, headroom=2), TokenTable(NB, S)
    eng = InMemoryCopyEngine(TagStore(NB, S), auto_complete=False) if engine == "memory" else tensor_engine()
    mgr = ReclamationManager(pool, table, eng, ReclaimConfig(burst_df=0.2))  # burst state must not move either
    for req, n in (("a", 14), ("b", 4), ("gone", 3)):
        table.add_request(req)
        table.sync_new_tokens(req, pool.allocate(-(-n // S), Purpose.ADMISSION), n)
    for t in EVICT:
        table.evict_token("a", t)
    assert mgr.should_reclaim(0)  # the trigger has read F once
    rec = mgr.plan_request("a")
    assert rec.plan.dst_blocks == (6,) and mgr.launch() == []
    gone = table.remove_request("gone")
    if engine == "memory":
        assert eng.poll(rec.handle) is CopyStatus.PENDING
    return Scene(pool, table, eng, mgr, rec.handle, gone)


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[Scene], object]
    error: type
    culprit: str
    engine: str = "memory"


def _config(**kw):
    return lambda s: ReclaimConfig(**kw)


def _submit(*moves):
    return lambda s: s.engine.submit(list(moves), req_id="r9")


CASES = [
    # ReclaimConfig: types as well as ranges, the field named first
    Case("config max_sources float", _config(max_sources=2.5), ConfigError, "max_sources must be an int >= 1, got 2.5"),
    Case("config check_every bool", _config(check_every=True), ConfigError,
         "check_every must be an int >= 1, got True"),
    Case("config theta_f str", _config(theta_f="0.3"), ConfigError, "theta_f must be a number in [0, 1), got '0.3'"),
    Case("config low_watermark float", _config(low_watermark=1.5), ConfigError, "low_watermark must be None or an int"),
    Case("config max_plans_per_round 0", _config(max_plans_per_round=0), ConfigError, "max_plans_per_round"),
    Case("config burst_df inf", _config(burst_df=float("inf")), ConfigError, "burst_df"),
    Case("config planner name", _config(planner="DENSIFY"), ConfigError,
         "planner must be one of ['compact', 'densify', 'relocate'] (a PlanKind or its value), got 'DENSIFY'"),
    Case("config planner release", _config(planner="release"), ConfigError, "release is no planner"),
    Case("config ordering name", _config(ordering="EVENT"), ConfigError,
         "ordering must be one of ['poll', 'event', 'force_sync'] (an Ordering or its value), got 'EVENT'"),
    # ReclamationManager
    Case("should_reclaim negative", lambda s: s.manager.should_reclaim(-1), InvalidArgumentError, "got -1"),
    Case("should_reclaim float", lambda s: s.manager.should_reclaim(2.0), InvalidArgumentError, "got 2.0"),
    Case("should_reclaim bool", lambda s: s.manager.should_reclaim(True), InvalidArgumentError, "got True"),
    Case("plan_round unknown", lambda s: s.manager.plan_round(["b", "ghost"]), UnknownRequestError, "'ghost'"),
    Case("plan_round departed", lambda s: s.manager.plan_round(["gone"]), UnknownRequestError, "'gone'"),
    Case("plan_round twice", lambda s: s.manager.plan_round(["b", "b"]), DuplicateRequestError, "'b' listed twice"),
    Case("plan_round lone str", lambda s: s.manager.plan_round("b"), InvalidArgumentError, "got 'b'"),
    Case("plan_round None", lambda s: s.manager.plan_round(None), InvalidArgumentError, "got None"),
    Case("plan_request unknown", lambda s: s.manager.plan_request("ghost"), UnknownRequestError, "'ghost'"),
    Case("plan_request unhashable", lambda s: s.manager.plan_request(["a"]), UnknownRequestError, "['a']"),
    Case("plan_request in flight", lambda s: s.manager.plan_request("a"), PlanConflictError, "'a' already has a plan"),
    Case("removed while registered", lambda s: s.manager.on_request_removed("a", s.table.block_ids("a")),
         RequestStillRegisteredError, "'a' is still in the token table"),
    Case("removed block out of range", lambda s: s.manager.on_request_removed("gone", [6, 99]), BlockOutOfRangeError,
         "block 99"),
    Case("removed float block", lambda s: s.manager.on_request_removed("gone", [6.0]), BlockOutOfRangeError,
         "block 6.0"),
    Case("removed blocks str", lambda s: s.manager.on_request_removed("gone", "6"), BlockOutOfRangeError, "'6'"),
    Case("removed free block",
         lambda s: s.manager.on_request_removed("gone", s.gone_blocks + [s.pool.free_block_ids()[0]]),
         DoubleFreeError, "block 7"),
    Case("removed twice over", lambda s: s.manager.on_request_removed("gone", s.gone_blocks * 2), DoubleFreeError,
         "block 5 would be freed 2 time(s)"),
    # CopyRegistry and the in-memory engine (its test controls too)
    Case("release unknown", lambda s: s.engine.release(999), UnknownCopyHandleError, "999"),
    Case("release unhashable", lambda s: s.engine.release([1]), UnknownCopyHandleError, "[1]"),
    Case("release pending", lambda s: s.engine.release(s.handle), CopyStateError, "copy 1 is still pending"),
    Case("poll unknown", lambda s: s.engine.poll(0), UnknownCopyHandleError, "handle 0"),
    Case("order unknown", lambda s: s.engine.order_before_compute(77), UnknownCopyHandleError, "77"),
    Case("fail written negative", lambda s: s.engine.fail(s.handle, written=-1), CopyStateError, "written=-1"),
    Case("fail written float", lambda s: s.engine.fail(s.handle, written=1.5), CopyStateError, "written=1.5"),
    Case("fail written past the copy", lambda s: s.engine.fail(s.handle, written=5), CopyStateError, "written=5"),
    Case("submit float block", _submit(Move(0, 1.0, 0, 6, 3)), MoveSourceMismatchError, "src_block=1.0"),
    Case("submit bool offset", _submit(Move(0, 1, 0, 6, True)), DestinationError, "dst_offset=True"),
    Case("submit negative slot", _submit(Move(0, 1, 0, 6, -1)), DestinationError, "dst_offset=-1"),
    Case("submit outside", _submit(Move(0, 1, 0, NB, 0)), DestinationError, f"dst_block={NB}"),
    Case("submit same slot twice", _submit(Move(0, 1, 0, 6, 3), Move(1, 1, 1, 6, 3)), DestinationError, "slot 27"),
    Case("submit malformed", _submit((0, 1, 2)), MoveSourceMismatchError, "(0, 1, 2)"),
    Case("submit token id str", _submit(Move("x", 1, 0, 6, 3)), TokenOutOfRangeError, "'x'"),
    # the torch engine (CPU): the same refusals before any tensor is built
    Case("torch submit float block", _submit(Move(0, 1, 0, 6.0, 3)), DestinationError, "dst_block=6.0", "torch"),
    Case("torch submit bool block", _submit(Move(0, True, 0, 6, 3)), MoveSourceMismatchError, "src_block=True",
         "torch"),
    Case("torch submit negative source", _submit(Move(0, 1, -2, 6, 3)), MoveSourceMismatchError, "src_offset=-2",
         "torch"),
    Case("torch submit malformed", _submit(Move(0, 1, 0, 6, 3), (5,)), MoveSourceMismatchError, "(5,)", "torch"),
    Case("torch submit same slot twice", _submit(Move(0, 1, 0, 6, 3), Move(1, 1, 1, 6, 3)), DestinationError,
         "same slot 27", "torch"),
    Case("torch release unknown", lambda s: s.engine.release(42), UnknownCopyHandleError, "42", "torch"),
    Case("torch release pending", lambda s: s.engine.release(s.handle), CopyStateError, "still pending", "torch"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_misuse_is_refused_by_name_and_changes_nothing(case):
    s = scene(case.engine)
    before = s.state()
    with pytest.raises(VTokenError) as err:
        case.call(s)
    assert type(err.value) is case.error, f"{type(err.value).__name__}: {err.value}"
    assert case.culprit in str(err.value), str(err.value)
    assert s.state() == before, "a rejected call changed the state"


def test_the_scene_is_live_and_the_snapshot_sees_a_change():
    """The corpus has teeth: the scene really has a pending plan, and the snapshot sees one-field changes."""
    s = scene()
    rec = s.manager.in_flight("a")
    assert rec.state is PlanState.COPYING and s.engine.pending() == [s.handle]
    before = s.state()
    s.manager.stats.no_plan["x"] += 0  # a Counter key, no count: still a change of state
    assert s.state() != before
    before = s.state()
    s.manager._f_prev += 1e-12
    assert s.state() != before
    before = s.state()
    s.engine.store.write(0, s.engine.store.read(0))  # an identical write is no change
    assert s.state() == before


def test_the_corpus_is_the_size_issue_15_asked_for():
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)
    assert {c.error for c in CASES} >= {ConfigError, InvalidArgumentError, UnknownRequestError, DuplicateRequestError,
                                        PlanConflictError, RequestStillRegisteredError, BlockOutOfRangeError,
                                        DoubleFreeError, UnknownCopyHandleError, CopyStateError,
                                        MoveSourceMismatchError, DestinationError, TokenOutOfRangeError}


def test_a_departed_request_whose_copy_is_pending_must_hand_over_its_sources():
    """Not misuse of a value but of the protocol: the block list given must hold what the pending copy reads."""
    s = scene()
    blocks = s.table.remove_request("a")  # [0, 1, 2, 3]
    before = s.state()
    with pytest.raises(BlockNotOwnedError, match=r"'a': blocks \[1\] are read by its plan in flight"):
        s.manager.on_request_removed("a", [b for b in blocks if b != 1])
    assert s.state() == before
    s.manager.on_request_removed("a", blocks)  # the right list is accepted: 3 goes back, 0-2 and 6 are held
    assert s.manager.orphans[0].held == (0, 1, 2, 6) and 3 in s.pool.free_block_ids()


def test_the_snapshot_sees_a_changed_tensor_byte():
    torch = pytest.importorskip("torch")
    s = scene("torch")
    before = s.state()
    g = s.engine.cache.groups[0]
    g.flat.view(torch.int32)[5] ^= 1  # one bit of one element of one plane
    assert s.state() != before
