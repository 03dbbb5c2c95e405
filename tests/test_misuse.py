"""The misuse corpus: every rejected call raises its own VTokenError subclass, names the culprit, and
changes nothing (README: "Every rejected call raises a subclass of vtoken.core.VTokenError naming the
request, token or block at fault, and leaves the state exactly as it was").

Each case is a builder returning ``(state, call, Expected, culprit)``: the objects whose whole state
must survive (walked by ``misuse_snapshot.deep_state``, independent of the code under test), the bad
call, the exact exception class (``type(e) is Expected``, not a parent) and a substring of the message
that names what is at fault. Case names read as claims. Reclamation, copy engines, vLLM and the CLI
have their own corpora (tests/test_misuse_reclaim.py, tests/test_misuse_vllm.py).
"""

from __future__ import annotations

import math

import pytest

from misuse_snapshot import deep_state, describe_diff
from vtoken.core.block_pool import BlockPool, Purpose, blocks_needed
from vtoken.core.reference.compact import choose_sources, plan_compaction
from vtoken.core.errors import (
    AdmissionClosedError,
    BlockListTooShortError,
    BlockNotOwnedError,
    BlockOutOfRangeError,
    ConfigError,
    CopyStateError,
    DestinationError,
    DoubleFreeError,
    DuplicateRequestError,
    HeadroomReservedError,
    InvalidArgumentError,
    MoveSourceMismatchError,
    PlanConflictError,
    PolicyError,
    PoolExhaustedError,
    StepOrderError,
    TokenAlreadyEvictedError,
    TokenOutOfRangeError,
    UnknownRequestError,
    VTokenError,
)
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
from vtoken.core.occupancy import SlotOccupancy
from vtoken.core.plan import Plan, PlanKind
from vtoken.core.policies import H2O, TOVA, Knorm, SnapKV, RandomPolicy, RequestView, Scissorhands, StreamingLLM, make_policy
from vtoken.core.reclamation import PlanRecord, PlanState, ReclaimConfig
from vtoken.core.runtime import ReadPath, VTokenRuntime
from vtoken.core.scores import TokenScores
from vtoken.core.token_table import Move, TokenTable

CASES: dict[str, object] = {}


def case(fn):
    """Register a builder; its name (without the leading underscore) is the case id."""
    CASES[fn.__name__.lstrip("_")] = fn
    return fn


# ---- fixtures ------------------------------------------------------------------------------------
class Fixed:
    """A stateless policy: evicts ``victims[(req, step)]`` (or, from step 1 on, what ``answer`` returns);
    it records nothing, so the whole runtime, policy included, can be snapshotted."""

    name = "fixed"

    def __init__(self, victims=None, answer=None):
        self.victims = victims or {}
        self.answer = answer

    def select_victims(self, view):
        if self.answer is not None and view.step >= 1:  # the fixtures' own first step stays valid
            return self.answer(view)
        return list(self.victims.get((view.req_id, view.step), []))


def rt_(policy=None, budget=0.5, reclaim=None, num_blocks=8, block_size=4, headroom=1, auto_complete=True,
        read_path=ReadPath.GATHER):
    pool = BlockPool(num_blocks, block_size, headroom)
    engine = InMemoryCopyEngine(TagStore(num_blocks, block_size), auto_complete=auto_complete)
    return VTokenRuntime(pool, engine, policy, budget, reclaim, read_path)


def running(**kw):
    """'a' holds 6 tokens in blocks [0, 1], 'b' 3 tokens in [2]; blocks 3..7 free, headroom 1; no step open."""
    rt = rt_(**kw)
    rt.admit("a")
    rt.admit("b")
    rt.begin_step({"a": 6, "b": 3})
    rt.end_step()
    return rt


def open_step(**kw):
    """``running`` plus an open step: 'a' reads 7 tokens, 'b' 4."""
    rt = running(**kw)
    rt.begin_step({"a": 1, "b": 1})
    return rt


EVICT = [1, 2, 3, 4, 5, 6, 10, 11]


def inflight(headroom=2, complete=False):
    """6 blocks x 4. 'a' synced 14 tokens in blocks [0..3] and evicted 8; a compact plan moving its live
    tokens out of blocks 0, 1, 2 into block 4 is in flight (pending unless ``complete``)."""
    rt = rt_(num_blocks=6, headroom=headroom, policy=Fixed({("a", 0): EVICT}), budget=0.4, reclaim=ReclaimConfig(),
             auto_complete=False)
    rt.admit("a")
    rt.begin_step({"a": 14})
    assert rt.end_step() == {"a": EVICT}
    rec = rt.manager.in_flight("a")
    assert rec.state is PlanState.COPYING and rec.plan.src_blocks == (0, 1, 2) and rec.plan.dst_blocks == (4,)
    if complete:
        rt.engine.complete(rec.handle)
    return rt


def table_ab():
    """8 blocks x 4: 'a' 6 tokens in [0, 1] (block 0 full), 'b' 3 tokens in [2]."""
    t = TokenTable(8, 4)
    t.add_request("a")
    t.sync_new_tokens("a", [0, 1], 6)
    t.add_request("b")
    t.sync_new_tokens("b", [2], 3)
    return t


def pool_():
    p = BlockPool(8, 4, headroom=2)
    p.allocate(3, Purpose.ADMISSION)  # blocks 0, 1, 2 allocated
    return p


def scores_():
    s = TokenScores(4)
    s.add_request("r")
    s.extend("r", 3)
    s.record("r", [0, 1, 2], [0.5, 0.3, 0.2])
    return s


def view_(**kw):
    args = dict(req_id="r", live=[0, 1, 2, 3], total_len=4, budget=2)
    args.update(kw)
    return lambda: RequestView(**args)


def torch_():
    return pytest.importorskip("torch")


def cache_():
    """Two layers: a (K, V) pair and a stacked [2, ...] tensor (whose block -1 of V is K's last block)."""
    torch = torch_()
    from vtoken.integration.device.kv_cache import PagedKVCache
    from vtoken.integration.device.kv_layout import gpu_planes

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(4, 2, 2, 3, generator=g), torch.randn(4, 2, 2, 3, generator=g)
    stacked = torch.randn(2, 4, 2, 2, 3, generator=g)
    return PagedKVCache(gpu_planes("l0", (k, v)) + gpu_planes("l1", stacked))


# ---- BlockPool -----------------------------------------------------------------------------------------
@case
def _pool_refuses_zero_blocks():
    return (), lambda: BlockPool(0, 4), ConfigError, "got 0"


@case
def _pool_refuses_a_float_block_count():
    return (), lambda: BlockPool(8.0, 4), ConfigError, "8.0"


@case
def _pool_refuses_true_as_block_count():
    return (), lambda: BlockPool(True, 4), ConfigError, "True"


@case
def _pool_refuses_block_size_zero():
    return (), lambda: BlockPool(8, 0), ConfigError, "block_size"


@case
def _pool_refuses_a_string_block_size():
    return (), lambda: BlockPool(8, "4"), ConfigError, "'4'"


@case
def _pool_refuses_headroom_of_the_whole_pool():
    return (), lambda: BlockPool(8, 4, headroom=8), ConfigError, "headroom"


@case
def _pool_refuses_negative_headroom():
    return (), lambda: BlockPool(8, 4, headroom=-1), ConfigError, "-1"


@case
def _pool_allocate_refuses_purpose_by_its_name_listing_the_values():
    p = pool_()  # an enum argument takes its member or its exact value ("admission"), not its name
    return (p,), lambda: p.allocate(1, "ADMISSION"), InvalidArgumentError, "['admission', 'evacuation']"


@case
def _pool_can_allocate_refuses_an_unknown_purpose_string():
    p = pool_()  # 5 free, headroom 2: a purpose that is not Purpose.ADMISSION used to dip into the headroom
    return (p,), lambda: p.can_allocate(4, "admit"), InvalidArgumentError, "'admit'"


@case
def _pool_allocate_refuses_purpose_none():
    p = pool_()
    return (p,), lambda: p.allocate(1, None), InvalidArgumentError, "None"


@case
def _pool_allocate_refuses_a_float_count():
    p = pool_()
    return (p,), lambda: p.allocate(1.5, Purpose.ADMISSION), InvalidArgumentError, "1.5"


@case
def _pool_allocate_refuses_true_as_count():
    p = pool_()
    return (p,), lambda: p.allocate(True, Purpose.EVACUATION), InvalidArgumentError, "True"


@case
def _pool_can_allocate_refuses_a_float_count():
    p = pool_()
    return (p,), lambda: p.can_allocate(1.5, Purpose.ADMISSION), InvalidArgumentError, "1.5"


@case
def _pool_allocate_refuses_a_string_count():
    p = pool_()
    return (p,), lambda: p.allocate("2", Purpose.ADMISSION), InvalidArgumentError, "'2'"


@case
def _pool_allocate_refuses_a_negative_count_naming_purpose():
    p = pool_()
    return (p,), lambda: p.allocate(-1, Purpose.ADMISSION), PoolExhaustedError, "(-1) for admission"


@case
def _pool_admission_never_takes_the_headroom():
    p = pool_()
    return (p,), lambda: p.allocate(4, Purpose.ADMISSION), HeadroomReservedError, "admission of 4 blocks"


@case
def _pool_evacuation_beyond_free_names_purpose():
    p = pool_()
    return (p,), lambda: p.allocate(6, Purpose.EVACUATION), PoolExhaustedError, "evacuation needs 6"


@case
def _pool_free_refuses_an_unhashable_block():
    p = pool_()
    return (p,), lambda: p.free([0, [1]]), BlockOutOfRangeError, "[1]"


@case
def _pool_free_refuses_true_as_block():
    p = pool_()
    return (p,), lambda: p.free([True]), BlockOutOfRangeError, "True"


@case
def _pool_free_refuses_a_lone_int():
    p = pool_()
    return (p,), lambda: p.free(1), BlockOutOfRangeError, "1"


@case
def _pool_free_refuses_a_string():
    p = pool_()
    return (p,), lambda: p.free("01"), BlockOutOfRangeError, "'01'"


@case
def _pool_free_of_a_free_block_is_a_double_free():
    p = pool_()
    return (p,), lambda: p.free([0, 5]), DoubleFreeError, "block 5"


@case
def _pool_free_twice_in_one_batch_frees_nothing():
    p = pool_()
    return (p,), lambda: p.free([1, 1]), DoubleFreeError, "block 1 freed 2 time(s)"


@case
def _pool_free_refuses_a_negative_block():
    p = pool_()
    return (p,), lambda: p.free([-1]), BlockOutOfRangeError, "-1"


@case
def _pool_share_of_a_free_block():
    p = pool_()
    return (p,), lambda: p.share(6), DoubleFreeError, "block 6"


@case
def _pool_share_refuses_true_as_block():
    p = pool_()
    return (p,), lambda: p.share(True), BlockOutOfRangeError, "True"


@case
def _pool_share_refuses_a_block_past_the_end():
    p = pool_()
    return (p,), lambda: p.share(8), BlockOutOfRangeError, "block 8"


@case
def _pool_ref_count_refuses_a_negative_block():
    p = pool_()
    return (p,), lambda: p.ref_count(-1), BlockOutOfRangeError, "-1"


@case
def _pool_ref_count_refuses_a_float_block():
    p = pool_()
    return (p,), lambda: p.ref_count(1.0), BlockOutOfRangeError, "1.0"


@case
def _blocks_needed_refuses_block_size_zero():
    return (), lambda: blocks_needed(5, 0), ConfigError, "block_size"


@case
def _blocks_needed_refuses_negative_tokens():
    return (), lambda: blocks_needed(-1, 4), InvalidArgumentError, "-1"


@case
def _blocks_needed_refuses_a_float_token_count():
    return (), lambda: blocks_needed(2.5, 4), InvalidArgumentError, "2.5"


# ---- SlotOccupancy -------------------------------------------------------------------------------------
def occ_():
    o = SlotOccupancy(4, 4)
    o.claim(3)
    return o


@case
def _occupancy_holders_refuses_a_negative_slot():
    o = occ_()
    return (o,), lambda: o.holders(-1), BlockOutOfRangeError, "-1"


@case
def _occupancy_holders_refuses_a_slot_past_the_end():
    o = occ_()
    return (o,), lambda: o.holders(16), BlockOutOfRangeError, "16"


@case
def _occupancy_block_live_refuses_a_negative_block():
    o = occ_()
    return (o,), lambda: o.block_live(-1), BlockOutOfRangeError, "-1"


@case
def _occupancy_release_of_an_unheld_slot():
    o = occ_()
    return (o,), lambda: o.release(5), DoubleFreeError, "slot 5"


@case
def _occupancy_claim_refuses_a_negative_slot():
    o = occ_()
    return (o,), lambda: o.claim(-1), BlockOutOfRangeError, "-1"


@case
def _occupancy_refuses_block_size_zero():
    return (), lambda: SlotOccupancy(4, 0), ConfigError, "block_size"


# ---- TokenTable ----------------------------------------------------------------------------------------
@case
def _table_refuses_block_size_zero():
    return (), lambda: TokenTable(8, 0), ConfigError, "8, 0"


@case
def _table_refuses_a_float_block_count():
    return (), lambda: TokenTable(8.0, 4), ConfigError, "8.0"


@case
def _table_add_refuses_an_unhashable_request_id():
    t = table_ab()
    return (t,), lambda: t.add_request(["c"]), InvalidArgumentError, "['c']"


@case
def _table_add_refuses_none_as_request_id():
    t = table_ab()
    return (t,), lambda: t.add_request(None), InvalidArgumentError, "None"


@case
def _table_add_refuses_true_as_request_id():
    t = table_ab()
    return (t,), lambda: t.add_request(True), InvalidArgumentError, "True"


@case
def _table_add_refuses_a_duplicate():
    t = table_ab()
    return (t,), lambda: t.add_request("a"), DuplicateRequestError, "'a'"


@case
def _table_sync_unknown_request():
    t = table_ab()
    return (t,), lambda: t.sync_new_tokens("zz", [3], 1), UnknownRequestError, "'zz'"


@case
def _table_sync_unhashable_request():
    t = table_ab()
    return (t,), lambda: t.sync_new_tokens(["a"], [3], 7), UnknownRequestError, "['a']"


@case
def _table_sync_block_owned_by_other_request():
    t = table_ab()  # block 2 is 'b''s append block (3 of 4 slots written)
    return (t,), lambda: t.sync_new_tokens("a", [2], 9), BlockNotOwnedError, "block 2 belongs to request 'b'"


@case
def _table_sync_shared_block_must_be_filled_by_the_sync():
    t = table_ab()
    t.add_request("c")  # block 0 is full in 'a', but 'c' would write into it later
    return (t,), lambda: t.sync_new_tokens("c", [0], 2), BlockNotOwnedError, "block 0 belongs to request 'a'"


@case
def _table_sync_refuses_true_as_block():
    t = table_ab()
    return (t,), lambda: t.sync_new_tokens("a", [True], 9), BlockOutOfRangeError, "True"


@case
def _table_sync_refuses_a_float_length():
    t = table_ab()
    return (t,), lambda: t.sync_new_tokens("a", [], 7.0), TokenOutOfRangeError, "7.0"


@case
def _table_sync_refuses_true_as_length():
    t = TokenTable(8, 4)
    t.add_request("c")
    return (t,), lambda: t.sync_new_tokens("c", [3], True), TokenOutOfRangeError, "True"


@case
def _table_sync_refuses_a_lone_block_id():
    t = table_ab()
    return (t,), lambda: t.sync_new_tokens("a", 3, 9), BlockOutOfRangeError, "3"


@case
def _table_sync_refuses_a_shorter_length():
    t = table_ab()
    return (t,), lambda: t.sync_new_tokens("a", [], 5), TokenOutOfRangeError, "total_len 5"


@case
def _table_sync_refuses_a_block_past_the_pool():
    t = table_ab()
    return (t,), lambda: t.sync_new_tokens("a", [8], 9), BlockOutOfRangeError, "block 8"


@case
def _table_sync_refuses_a_repeated_block():
    t = table_ab()
    return (t,), lambda: t.sync_new_tokens("a", [3, 3], 12), BlockNotOwnedError, "block 3"


@case
def _table_sync_refuses_too_few_blocks():
    t = table_ab()
    return (t,), lambda: t.sync_new_tokens("a", [3], 13), BlockListTooShortError, "request 'a'"


@case
def _table_sync_refuses_an_unhashable_block():
    t = table_ab()
    return (t,), lambda: t.sync_new_tokens("a", [[3]], 9), BlockOutOfRangeError, "[3]"


@case
def _table_evict_refuses_true_as_token():
    t = table_ab()
    return (t,), lambda: t.evict_token("a", True), TokenOutOfRangeError, "True"


@case
def _table_evict_refuses_a_float_token():
    t = table_ab()
    return (t,), lambda: t.evict_token("a", 1.0), TokenOutOfRangeError, "1.0"


@case
def _table_evict_refuses_a_negative_token():
    t = table_ab()
    return (t,), lambda: t.evict_token("a", -1), TokenOutOfRangeError, "-1"


@case
def _table_evict_twice():
    t = table_ab()
    t.evict_token("a", 2)
    return (t,), lambda: t.evict_token("a", 2), TokenAlreadyEvictedError, "token 2"


@case
def _table_evict_unknown_request():
    t = table_ab()
    return (t,), lambda: t.evict_token("zz", 0), UnknownRequestError, "'zz'"


@case
def _table_evict_tokens_refuses_a_token_named_twice():
    t = table_ab()
    return (t,), lambda: t.evict_tokens("a", [0, 3, 0]), TokenAlreadyEvictedError, "token 0 is named twice"


@case
def _table_evict_tokens_evicts_none_when_one_is_dead():
    t = table_ab()
    t.evict_token("a", 2)
    return (t,), lambda: t.evict_tokens("a", [0, 1, 2]), TokenAlreadyEvictedError, "token 2"


@case
def _table_evict_tokens_refuses_a_lone_int():
    t = table_ab()
    return (t,), lambda: t.evict_tokens("a", 3), TokenOutOfRangeError, "must be a sequence"


@case
def _table_true_does_not_name_request_1():
    t = TokenTable(8, 4)
    t.add_request(1)
    t.sync_new_tokens(1, [0], 3)
    return (t,), lambda: t.evict_token(True, 0), UnknownRequestError, "True"


@case
def _table_apply_moves_refuses_a_lone_int():
    t = table_ab()
    return (t,), lambda: t.apply_moves("a", 5), MoveSourceMismatchError, "5"


@case
def _table_apply_moves_refuses_a_four_field_move():
    t = table_ab()
    return (t,), lambda: t.apply_moves("a", [(0, 0, 0, 1)]), MoveSourceMismatchError, "(0, 0, 0, 1)"


@case
def _table_apply_moves_refuses_a_string_move():
    t = table_ab()
    return (t,), lambda: t.apply_moves("a", ["abcde"]), MoveSourceMismatchError, "'abcde'"


@case
def _table_apply_moves_refuses_true_as_destination_block():
    t = table_ab()
    t.evict_token("a", 5)  # slot 5 = (1, 1) is a hole before the cursor
    return (t,), lambda: t.apply_moves("a", [Move(4, 1, 0, True, 1)]), DestinationError, "True"


@case
def _table_apply_moves_refuses_a_negative_destination_offset():
    t = table_ab()
    return (t,), lambda: t.apply_moves("a", [Move(4, 1, 0, 1, -1)]), DestinationError, "-1"


@case
def _table_apply_moves_refuses_a_stale_source():
    t = table_ab()
    t.evict_token("a", 5)
    return (t,), lambda: t.apply_moves("a", [Move(4, 1, 1, 1, 1)]), MoveSourceMismatchError, "token 4"


@case
def _table_apply_moves_refuses_another_requests_block():
    t = table_ab()
    return (t,), lambda: t.apply_moves("a", [Move(4, 1, 0, 2, 3)]), BlockNotOwnedError, "block 2"


@case
def _table_apply_moves_refuses_a_destination_at_the_cursor():
    t = table_ab()
    return (t,), lambda: t.apply_moves("a", [Move(0, 0, 0, 1, 2)]), DestinationError, "slot 6"


@case
def _table_apply_moves_refuses_an_occupied_destination():
    t = table_ab()
    return (t,), lambda: t.apply_moves("a", [Move(0, 0, 0, 1, 0)]), DestinationError, "slot 4"


@case
def _table_apply_moves_refuses_a_token_moved_twice():
    t = table_ab()
    t.evict_token("a", 5)
    t.evict_token("a", 3)
    moves = [Move(4, 1, 0, 1, 1), Move(4, 1, 0, 0, 3)]
    return (t,), lambda: t.apply_moves("a", moves), MoveSourceMismatchError, "token 4 moved twice"


@case
def _table_apply_moves_refuses_a_dead_token():
    t = table_ab()
    t.evict_token("a", 4)
    return (t,), lambda: t.apply_moves("a", [Move(4, 1, 0, 1, 0)]), TokenAlreadyEvictedError, "token 4"


@case
def _table_set_layout_refuses_an_unhashable_block():
    t = table_ab()
    return (t,), lambda: t.set_layout("a", [0, [1]], 6), BlockOutOfRangeError, "[1]"


@case
def _table_set_layout_refuses_another_requests_block():
    t = table_ab()
    return (t,), lambda: t.set_layout("a", [0, 1, 2], 6), BlockNotOwnedError, "block 2 belongs to request 'b'"


@case
def _table_set_layout_refuses_true_as_cursor():
    t = table_ab()
    t.evict_token("a", 1)
    t.evict_token("a", 2)
    t.evict_token("a", 3)
    t.evict_token("a", 4)
    t.evict_token("a", 5)
    return (t,), lambda: t.set_layout("a", [0], True), BlockListTooShortError, "True"


@case
def _table_set_layout_refuses_dropping_a_live_block():
    t = table_ab()
    return (t,), lambda: t.set_layout("a", [0], 4), BlockNotOwnedError, "block 1"


@case
def _table_set_layout_refuses_a_lone_int():
    t = table_ab()
    return (t,), lambda: t.set_layout("a", 0, 4), BlockOutOfRangeError, "0"


@case
def _table_slot_of_refuses_true_as_token():
    t = table_ab()
    return (t,), lambda: t.slot_of("a", True), TokenOutOfRangeError, "True"


@case
def _table_is_live_refuses_a_float_token():
    t = table_ab()
    return (t,), lambda: t.is_live("a", 0.0), TokenOutOfRangeError, "0.0"


@case
def _table_owners_refuses_a_negative_block():
    t = table_ab()
    return (t,), lambda: t.owners(-1), BlockOutOfRangeError, "-1"


# ---- TokenScores ---------------------------------------------------------------------------------------
@case
def _scores_refuse_window_zero():
    return (), lambda: TokenScores(0), ConfigError, "got 0"


@case
def _scores_refuse_a_float_window():
    return (), lambda: TokenScores(2.5), ConfigError, "2.5"


@case
def _scores_refuse_a_string_window():
    return (), lambda: TokenScores("32"), ConfigError, "'32'"


@case
def _scores_add_refuses_a_duplicate_and_keeps_its_scores():
    s = scores_()
    return (s,), lambda: s.add_request("r"), DuplicateRequestError, "'r'"


@case
def _scores_add_refuses_an_unhashable_request_id():
    s = scores_()
    return (s,), lambda: s.add_request({"r": 1}), InvalidArgumentError, "{'r': 1}"


@case
def _scores_record_refuses_a_nan_weight():
    s = scores_()
    return (s,), lambda: s.record("r", [0, 1], [0.5, math.nan]), InvalidArgumentError, "nan"


@case
def _scores_record_refuses_an_infinite_weight():
    s = scores_()
    return (s,), lambda: s.record("r", [0, 1], [math.inf, 0.5]), InvalidArgumentError, "inf"


@case
def _scores_record_refuses_a_negative_weight():
    s = scores_()
    return (s,), lambda: s.record("r", [0, 1], [1.5, -0.5]), InvalidArgumentError, "-0.5"


@case
def _scores_record_refuses_a_string_weight_before_any_update():
    s = scores_()
    return (s,), lambda: s.record("r", [0, 1, 2], [0.5, 0.25, "x"]), InvalidArgumentError, "'x'"


@case
def _scores_record_refuses_true_as_token():
    s = scores_()
    return (s,), lambda: s.record("r", [True], [1.0]), InvalidArgumentError, "True"


@case
def _scores_record_refuses_a_float_token():
    s = scores_()
    return (s,), lambda: s.record("r", [0, 1.0], [0.5, 0.5]), InvalidArgumentError, "1.0"


@case
def _scores_record_refuses_a_repeated_token():
    s = scores_()
    return (s,), lambda: s.record("r", [1, 1], [0.5, 0.5]), InvalidArgumentError, "token 1 appears twice"


@case
def _scores_record_refuses_an_unknown_token():
    s = scores_()
    return (s,), lambda: s.record("r", [0, 3], [0.5, 0.5]), TokenOutOfRangeError, "token 3"


@case
def _scores_record_refuses_a_row_of_the_wrong_length():
    s = scores_()
    return (s,), lambda: s.record("r", [0, 1], [0.2, 0.3, 0.5]), InvalidArgumentError, "2 tokens but 3 weights"


@case
def _scores_record_unknown_request():
    s = scores_()
    return (s,), lambda: s.record("zz", [0], [1.0]), UnknownRequestError, "'zz'"


@case
def _scores_record_refuses_weights_none():
    s = scores_()
    return (s,), lambda: s.record("r", [0], None), InvalidArgumentError, "None"


@case
def _scores_accumulated_refuses_a_negative_token():
    s = scores_()
    return (s,), lambda: s.accumulated("r", -1), TokenOutOfRangeError, "-1"


@case
def _scores_persistence_refuses_a_token_past_the_end():
    s = scores_()
    return (s,), lambda: s.persistence("r", 3), TokenOutOfRangeError, "token 3"


@case
def _scores_extend_refuses_a_float_length():
    s = scores_()
    return (s,), lambda: s.extend("r", 5.5), TokenOutOfRangeError, "5.5"


@case
def _scores_save_refuses_an_unknown_token():
    s = scores_()
    return (s,), lambda: s.save("r", [7]), InvalidArgumentError, "token 7"


@case
def _scores_restore_refuses_a_mismatched_save():
    s = scores_()
    return (s,), lambda: s.restore("r", [0, 1], [(0.0, 0.0)]), InvalidArgumentError, "request 'r'"


# ---- the compact planner (pure functions of a snapshot) -------------------------------------------------------
def wasted():
    """8 blocks x 4: 'a' synced 14 tokens in blocks [0..3] and evicted 8 (live 0 | 7 | 8 9 | 12 13): blocks 0, 1
    and 2 pack into one fresh block. Returns the table (the state) and its snapshot of 'a'."""
    t = TokenTable(8, 4)
    t.add_request("a")
    t.sync_new_tokens("a", [0, 1, 2, 3], 14)
    for tok in EVICT:
        t.evict_token("a", tok)
    return t, t.snapshot("a")


@case
def _plan_compaction_refuses_the_requests_own_block_as_destination():
    t, snap = wasted()
    return (t, snap), lambda: plan_compaction(snap, [0], 8), DestinationError, "block 0"


@case
def _plan_compaction_refuses_a_listed_block_it_does_not_pack_as_destination():
    t, snap = wasted()
    return (t, snap), lambda: plan_compaction(snap, [3], 8), DestinationError, "block 3"


@case
def _plan_compaction_refuses_a_destination_named_twice():
    t, snap = wasted()
    return (t, snap), lambda: plan_compaction(snap, [5, 5], 8), DestinationError, "block 5"


@case
def _plan_compaction_refuses_true_as_destination():
    t, snap = wasted()
    return (t, snap), lambda: plan_compaction(snap, [True], 8), DestinationError, "True"


@case
def _plan_compaction_refuses_max_sources_zero():
    t, snap = wasted()
    return (t, snap), lambda: plan_compaction(snap, [4], 0), InvalidArgumentError, "max_sources"


@case
def _choose_sources_refuses_max_sources_zero():
    t, snap = wasted()  # a bare assert before: an empty AssertionError, and accepted under python -O
    return (t, snap), lambda: choose_sources(snap, 0, 4), InvalidArgumentError, "max_sources must be an int >= 1"


@case
def _choose_sources_refuses_a_negative_destination_budget():
    t, snap = wasted()
    return (t, snap), lambda: choose_sources(snap, 1, -1), InvalidArgumentError, "dst_budget must be an int >= 0"


@case
def _choose_sources_refuses_true_as_max_sources():
    t, snap = wasted()
    return (t, snap), lambda: choose_sources(snap, True, 4), InvalidArgumentError, "max_sources"


# ---- policies and RequestView ----------------------------------------------------------------------------
@case
def _h2o_refuses_a_recent_fraction_above_one():
    return (), lambda: H2O(recent_fraction=1.5), ConfigError, "1.5"


@case
def _h2o_refuses_a_nan_recent_fraction():
    return (), lambda: H2O(recent_fraction=math.nan), ConfigError, "nan"


@case
def _h2o_refuses_a_string_recent_fraction():
    return (), lambda: H2O(recent_fraction="half"), ConfigError, "'half'"


@case
def _h2o_refuses_an_empty_name():
    return (), lambda: H2O(name=""), ConfigError, "H2O name"


@case
def _scissorhands_refuses_a_negative_recent_fraction():
    return (), lambda: Scissorhands(recent_fraction=-0.1), ConfigError, "-0.1"


@case
def _scissorhands_refuses_true_as_recent_fraction():
    return (), lambda: Scissorhands(recent_fraction=True), ConfigError, "True"


@case
def _streaming_llm_refuses_negative_sinks():
    return (), lambda: StreamingLLM(sinks=-1), ConfigError, "-1"


@case
def _streaming_llm_refuses_float_sinks():
    return (), lambda: StreamingLLM(sinks=2.0), ConfigError, "2.0"


@case
def _random_refuses_a_negative_recent_window():
    return (), lambda: RandomPolicy(keep_recent=-1), ConfigError, "-1"


@case
def _random_refuses_true_as_recent_window():
    return (), lambda: RandomPolicy(keep_recent=True), ConfigError, "True"


@case
def _snapkv_refuses_a_float_window_stating_its_true_bound():
    return (), lambda: SnapKV(window=2.5), ConfigError, "SnapKV window must be an int >= 1, got 2.5"


@case
def _snapkv_refuses_a_float_kernel_stating_its_true_bound():
    return (), lambda: SnapKV(kernel=2.5), ConfigError, "SnapKV kernel must be an odd int >= 1, got 2.5"


@case
def _snapkv_refuses_kernel_zero_stating_its_true_bound():
    return (), lambda: SnapKV(kernel=0), ConfigError, "SnapKV kernel must be an odd int >= 1, got 0"


@case
def _make_policy_refuses_an_unhashable_name():
    return (), lambda: make_policy(["h2o"]), ConfigError, "['h2o']"


@case
def _make_policy_refuses_an_unknown_name():
    return (), lambda: make_policy("lru"), ConfigError, "'lru'"


@case
def _view_refuses_budget_zero():
    return (), view_(budget=0), InvalidArgumentError, "got 0"


@case
def _view_refuses_true_as_budget():
    return (), view_(budget=True), InvalidArgumentError, "True"


@case
def _view_refuses_more_live_tokens_than_synced():
    return (), view_(total_len=3), InvalidArgumentError, "total_len"


@case
def _view_refuses_live_as_a_string():
    return (), view_(live="0123"), InvalidArgumentError, "'0123'"


@case
def _view_refuses_protected_as_a_list():
    return (), view_(protected=[1]), InvalidArgumentError, "[1]"


@case
def _view_refuses_a_negative_step():
    return (), view_(step=-1), InvalidArgumentError, "-1"


@case
def _view_refuses_a_non_callable_score():
    return (), view_(accumulated={0: 1.0}), InvalidArgumentError, "{0: 1.0}"


@case
def _view_candidates_refuse_a_negative_window():
    v = view_()()
    return (v,), lambda: v.candidates(keep_recent=-1), InvalidArgumentError, "-1"


# ---- VTokenRuntime: construction --------------------------------------------------------------------------
def bare_parts():
    return BlockPool(8, 4, 1), InMemoryCopyEngine(TagStore(8, 4))


@case
def _runtime_refuses_an_unknown_policy_name():
    pool, eng = bare_parts()
    return (pool, eng), lambda: VTokenRuntime(pool, eng, policy="lru"), ConfigError, "'lru'"


@case
def _runtime_refuses_a_policy_class():
    pool, eng = bare_parts()
    return (pool, eng), lambda: VTokenRuntime(pool, eng, policy=H2O), ConfigError, "H2O()"


@case
def _runtime_refuses_a_policy_without_select_victims():
    pool, eng = bare_parts()
    return (pool, eng), lambda: VTokenRuntime(pool, eng, policy=object()), ConfigError, "object"


@case
def _runtime_refuses_an_unknown_read_path():
    pool, eng = bare_parts()
    return (pool, eng), lambda: VTokenRuntime(pool, eng, read_path="sparse"), ConfigError, "'sparse'"


@case
def _runtime_refuses_an_int_read_path():
    pool, eng = bare_parts()
    return (pool, eng), lambda: VTokenRuntime(pool, eng, read_path=1), ConfigError, "got 1"


@case
def _runtime_refuses_reclaim_as_a_dict():
    pool, eng = bare_parts()
    return (pool, eng), lambda: VTokenRuntime(pool, eng, reclaim={"planner": "compact"}), ConfigError, "'planner'"


@case
def _runtime_refuses_a_nan_budget():
    pool, eng = bare_parts()
    return (pool, eng), lambda: VTokenRuntime(pool, eng, budget=math.nan), ConfigError, "nan"


@case
def _runtime_refuses_true_as_budget():
    pool, eng = bare_parts()
    return (pool, eng), lambda: VTokenRuntime(pool, eng, budget=True), ConfigError, "True"


@case
def _runtime_refuses_a_float_seed():
    pool, eng = bare_parts()
    return (pool, eng), lambda: VTokenRuntime(pool, eng, seed=1.5), ConfigError, "1.5"


@case
def _runtime_refuses_score_window_zero():
    pool, eng = bare_parts()
    return (pool, eng), lambda: VTokenRuntime(pool, eng, score_window=0), ConfigError, "got 0"


@case
def _runtime_refuses_a_pool_that_is_not_an_allocator():
    _, eng = bare_parts()
    return (eng,), lambda: VTokenRuntime(object(), eng), ConfigError, "can_allocate()"


@case
def _runtime_refuses_an_engine_that_is_not_a_copy_engine():
    pool, _ = bare_parts()
    return (pool,), lambda: VTokenRuntime(pool, TagStore(8, 4)), ConfigError, "submit()"


@case
def _runtime_refuses_a_read_path_by_its_name():
    pool, eng = bare_parts()  # the member or its exact value ("gather"), never the member's name
    return (pool, eng), lambda: VTokenRuntime(pool, eng, read_path="GATHER"), ConfigError, "['gather', 'dense']"


@case
def _sim_config_refuses_an_unknown_read_path():
    from vtoken.core.sim.simulator import SimConfig  # accepted, then a ValueError when the simulation started

    return (), lambda: SimConfig(read_path="sparse"), ConfigError, "read_path must be one of ['gather', 'dense']"


@case
def _sim_config_refuses_an_unknown_ordering():
    from vtoken.core.sim.simulator import SimConfig

    return (), lambda: SimConfig(ordering="eventual"), ConfigError, "ordering must be one of ['poll', 'event'"


@case
def _runtime_dense_read_path_needs_densify():
    pool, eng = bare_parts()
    return (pool, eng), lambda: VTokenRuntime(pool, eng, policy=H2O(), read_path="dense"), ConfigError, "densify"


# ---- VTokenRuntime: requests ---------------------------------------------------------------------------------
@case
def _set_budget_refuses_zero():
    rt = running()
    return (rt,), lambda: rt.set_budget(0), ConfigError, "got 0"


@case
def _set_budget_refuses_nan():
    rt = running()
    return (rt,), lambda: rt.set_budget(math.nan), ConfigError, "nan"


@case
def _set_budget_refuses_a_string():
    rt = running()
    return (rt,), lambda: rt.set_budget("0.5"), ConfigError, "'0.5'"


@case
def _can_admit_refuses_a_negative_prompt():
    rt = running()
    return (rt,), lambda: rt.can_admit(-1), InvalidArgumentError, "-1"


@case
def _can_admit_refuses_a_float_prompt():
    rt = running()
    return (rt,), lambda: rt.can_admit(2.5), InvalidArgumentError, "2.5"


@case
def _admit_refuses_an_unhashable_request_id():
    rt = running()
    return (rt,), lambda: rt.admit(["c"]), InvalidArgumentError, "['c']"


@case
def _admit_refuses_none_as_request_id():
    rt = running()
    return (rt,), lambda: rt.admit(None), InvalidArgumentError, "None"


@case
def _admit_refuses_a_duplicate():
    rt = running()
    return (rt,), lambda: rt.admit("a"), DuplicateRequestError, "'a'"


@case
def _admit_refuses_shared_blocks_without_a_source():
    rt = running()
    return (rt,), lambda: rt.admit("c", shared_blocks=1), InvalidArgumentError, "shared_blocks=1"


@case
def _admit_refuses_a_float_shared_block_count():
    rt = running()
    return (rt,), lambda: rt.admit("c", share_prefix_of="a", shared_blocks=1.0), InvalidArgumentError, "1.0"


@case
def _admit_refuses_true_as_shared_block_count():
    rt = running()
    return (rt,), lambda: rt.admit("c", share_prefix_of="a", shared_blocks=True), InvalidArgumentError, "True"


@case
def _admit_refuses_sharing_from_an_unknown_request():
    rt = running()
    return (rt,), lambda: rt.admit("c", share_prefix_of="zz", shared_blocks=1), UnknownRequestError, "'zz'"


@case
def _admit_refuses_a_prefix_a_plan_in_flight_touches():
    rt = running()
    [dst] = rt.pool.allocate(1, Purpose.EVACUATION)  # an (injected) plan of 'a' moving token 0 out of block 0
    plan = Plan(PlanKind.COMPACT, "a", (rt.table.layout_version("a"), 6), (Move(0, 0, 0, dst, 0),), (0,), (dst,))
    rt.manager.inflight["a"] = PlanRecord(plan, state=PlanState.COPYING)
    return (rt,), lambda: rt.admit("c", share_prefix_of="a", shared_blocks=1), PlanConflictError, "block 0"


@case
def _admit_refuses_a_prefix_holding_the_source_cursor():
    rt = running()  # 'a' has 6 tokens: block 1 holds its cursor and will be written again
    return (rt,), lambda: rt.admit("c", share_prefix_of="a", shared_blocks=2), BlockNotOwnedError, "'a'"


@case
def _admit_waits_while_reclamation_borrows_the_headroom():
    rt = inflight()
    return (rt,), lambda: rt.admit("c"), AdmissionClosedError, "'c'"


@case
def _detach_refuses_an_unhashable_request():
    rt = running()
    return (rt,), lambda: rt.detach(["a"]), UnknownRequestError, "['a']"


@case
def _detach_refuses_an_unknown_request():
    rt = running()
    return (rt,), lambda: rt.detach("zz"), UnknownRequestError, "'zz'"


@case
def _detach_refuses_a_request_with_a_plan_in_flight():
    rt = inflight()
    return (rt,), lambda: rt.detach("a"), PlanConflictError, "'a'"


@case
def _eviction_due_refuses_an_unknown_request():
    rt = running()
    return (rt,), lambda: rt.eviction_due("zz"), UnknownRequestError, "'zz'"


@case
def _policy_view_refuses_an_unhashable_request():
    rt = running()
    return (rt,), lambda: rt.policy_view(["a"]), UnknownRequestError, "['a']"


@case
def _preempt_refuses_an_unknown_request():
    rt = running()
    return (rt,), lambda: rt.preempt("zz"), UnknownRequestError, "'zz'"


@case
def _finish_refuses_an_unhashable_request():
    rt = running()
    return (rt,), lambda: rt.finish({"a"}), UnknownRequestError, "{'a'}"


@case
def _blocks_to_grow_refuses_a_negative_count():
    rt = running()
    return (rt,), lambda: rt.blocks_to_grow("a", -1), InvalidArgumentError, "-1"


@case
def _token_budget_refuses_a_float_length():
    rt = running()
    return (rt,), lambda: rt.token_budget(9.5), InvalidArgumentError, "9.5"


# ---- VTokenRuntime: begin_step / end_step ----------------------------------------------------------------------
@case
def _begin_step_twice_without_end_step():
    rt = open_step()
    return (rt,), lambda: rt.begin_step({"a": 1}), StepOrderError, "step 1 is open"


@case
def _begin_step_refuses_a_list():
    rt = running()
    return (rt,), lambda: rt.begin_step(["a"]), InvalidArgumentError, "['a']"


@case
def _begin_step_refuses_true_as_count():
    rt = running()
    return (rt,), lambda: rt.begin_step({"a": True}), InvalidArgumentError, "True"


@case
def _begin_step_refuses_a_float_count():
    rt = running()
    return (rt,), lambda: rt.begin_step({"a": 1.5}), InvalidArgumentError, "1.5"


@case
def _begin_step_refuses_a_negative_count():
    rt = running()
    return (rt,), lambda: rt.begin_step({"b": -1}), InvalidArgumentError, "request 'b': cannot append -1"


@case
def _begin_step_refuses_an_unknown_request():
    rt = running()
    return (rt,), lambda: rt.begin_step({"a": 1, "zz": 1}), UnknownRequestError, "'zz'"


@case
def _begin_step_refuses_true_for_request_1():
    rt = rt_()
    rt.admit(1)
    return (rt,), lambda: rt.begin_step({True: 1}), UnknownRequestError, "True"


@case
def _begin_step_validates_before_settling_a_done_copy():
    rt = inflight(complete=True)  # settling would commit the plan
    return (rt,), lambda: rt.begin_step({"a": -1}), InvalidArgumentError, "-1"


@case
def _begin_step_checks_unknown_requests_before_settling():
    rt = inflight(complete=True)
    return (rt,), lambda: rt.begin_step({"zz": 1}), UnknownRequestError, "'zz'"


@case
def _begin_step_that_does_not_fit_even_after_settling_settles_nothing():
    rt = inflight(complete=True)  # the commit would free 3 blocks; 100 tokens need 25
    return (rt,), lambda: rt.begin_step({"a": 100}), PoolExhaustedError, "request(s) ['a']"


@case
def _begin_step_exhaustion_names_the_requests_that_asked():
    rt = running()
    return (rt,), lambda: rt.begin_step({"a": 30, "b": 1}), PoolExhaustedError, "['a']"


@case
def _end_step_without_begin_step():
    rt = running()
    return (rt,), lambda: rt.end_step(), StepOrderError, "without begin_step"


@case
def _end_step_refuses_a_row_for_a_request_never_admitted():
    rt = open_step()
    return (rt,), lambda: rt.end_step({"zz": [1.0]}), UnknownRequestError, "'zz'"


@case
def _end_step_refuses_a_row_for_a_request_admitted_during_the_step():
    rt = open_step()
    rt.admit("c")
    return (rt,), lambda: rt.end_step({"c": []}), InvalidArgumentError, "'c'"


@case
def _end_step_refuses_a_nan_weight():
    rt = open_step()
    return (rt,), lambda: rt.end_step({"b": [0.25, 0.25, math.nan, 0.5]}), InvalidArgumentError, "nan"


@case
def _end_step_refuses_a_negative_weight():
    rt = open_step()
    return (rt,), lambda: rt.end_step({"b": [0.25, 0.25, -0.5, 1.0]}), InvalidArgumentError, "-0.5"


@case
def _end_step_refuses_an_infinite_weight():
    rt = open_step()
    return (rt,), lambda: rt.end_step({"b": [0.25, 0.25, math.inf, 0.5]}), InvalidArgumentError, "inf"


@case
def _end_step_refuses_a_string_weight():
    rt = open_step()
    return (rt,), lambda: rt.end_step({"b": [0.25, 0.25, "x", 0.5]}), InvalidArgumentError, "'x'"


@case
def _end_step_refuses_a_row_of_the_wrong_length():
    rt = open_step()
    return (rt,), lambda: rt.end_step({"a": [0.5, 0.5]}), InvalidArgumentError, "request 'a': attention row of 2"


@case
def _end_step_refuses_key_norms_for_a_request_not_in_the_step():
    rt = open_step(policy=Knorm())
    return (rt,), lambda: rt.end_step(None, {"zz": [1.0]}), UnknownRequestError, "'zz'"


@case
def _end_step_refuses_key_norms_of_the_wrong_length():
    rt = open_step(policy=Knorm())  # 'a' wrote one token this step
    return (rt,), lambda: rt.end_step(None, {"a": [1.0, 2.0]}), InvalidArgumentError, "2 weights for 1 tokens"


@case
def _end_step_refuses_a_negative_key_norm():
    rt = open_step(policy=Knorm())
    return (rt,), lambda: rt.end_step(None, {"a": [-1.5]}), InvalidArgumentError, "-1.5"


@case
def _end_step_refuses_true_as_a_key_norm_naming_request_and_index():
    rt = open_step(policy=Knorm())  # bools are not numbers: True used to be recorded as a norm of 1.0
    return (rt,), lambda: rt.end_step(None, {"a": [True]}), InvalidArgumentError, \
        "request 'a': key norms: weight True at index 0"


@case
def _end_step_refuses_false_as_an_attention_weight_naming_request_and_index():
    rt = open_step(policy=H2O(), budget=1.0)
    return (rt,), lambda: rt.end_step({"a": [1 / 7] * 6 + [False]}), InvalidArgumentError, \
        "request 'a': attention row: weight False at index 6"


@case
def _end_step_refuses_true_as_a_vote_naming_request_and_index():
    rt = open_step(policy=SnapKV())
    return (rt,), lambda: rt.end_step(None, None, {"a": [0.5, True] + [0.0] * 5}), InvalidArgumentError, \
        "request 'a': observation: weight True at index 1"


@case
def _end_step_refuses_key_norms_as_a_list():
    rt = open_step(policy=Knorm())
    return (rt,), lambda: rt.end_step(None, [1.0]), InvalidArgumentError, "key_norms must be a mapping"


@case
def _end_step_records_no_row_when_the_key_norms_are_bad():
    rt = open_step(policy=TOVA(), budget=1.0)
    return (rt,), lambda: rt.end_step({"a": [1 / 7] * 7}, {"b": [math.inf]}), InvalidArgumentError, "request 'b'"


@case
def _end_step_refuses_an_observation_of_the_wrong_length():
    rt = open_step(policy=SnapKV())
    return (rt,), lambda: rt.end_step(None, None, {"a": [0.5]}), InvalidArgumentError, "observation of 1 weights"


@case
def _end_step_refuses_an_observation_for_a_request_not_in_the_step():
    rt = open_step(policy=SnapKV())
    return (rt,), lambda: rt.end_step(None, None, {"zz": [1.0]}), UnknownRequestError, "'zz': observation"


@case
def _evict_and_reclaim_refuses_an_observation_without_token_ids():
    rt = running(policy=SnapKV())
    return (rt,), lambda: rt.evict_and_reclaim(["a"], None, None, {"a": [0.5]}), InvalidArgumentError, \
        "(token ids, votes)"


@case
def _end_step_refuses_attention_as_a_list():
    rt = open_step()
    return (rt,), lambda: rt.end_step([0.5, 0.5]), InvalidArgumentError, "[0.5, 0.5]"


@case
def _end_step_records_no_row_when_a_later_row_is_bad():
    rt = open_step(policy=H2O(), budget=1.0)
    rows = {"a": [1 / 7] * 7, "b": [0.25, 0.25, "x", 0.5]}
    return (rt,), lambda: rt.end_step(rows), InvalidArgumentError, "request 'b'"


@case
def _end_step_refuses_true_as_a_victim():
    rt = open_step(policy=Fixed(answer=lambda v: [True]))
    return (rt,), lambda: rt.end_step(), PolicyError, "True"


@case
def _end_step_reports_a_policy_that_raises():
    rt = open_step(policy=Fixed(answer=lambda v: {}["boom"]))
    return (rt,), lambda: rt.end_step(), PolicyError, "KeyError"


@case
def _end_step_reports_a_policy_returning_none():
    rt = open_step(policy=Fixed(answer=lambda v: None))
    return (rt,), lambda: rt.end_step(), PolicyError, "'fixed'"


@case
def _end_step_refuses_an_unhashable_victim():
    rt = open_step(policy=Fixed(answer=lambda v: [[1]]))
    return (rt,), lambda: rt.end_step(), PolicyError, "[1]"


@case
def _end_step_refuses_a_victim_that_is_already_dead():
    rt = open_step(policy=Fixed(answer=lambda v: [v.total_len]))
    return (rt,), lambda: rt.end_step(), PolicyError, "request 'a'"


# ---- VTokenRuntime: sync / evict_and_reclaim (engines that allocate themselves) ----------------------------------
@case
def _sync_block_owned_by_other_request():
    rt = running()
    return (rt,), lambda: rt.sync("a", [2], 9), BlockNotOwnedError, "block 2"


@case
def _sync_free_block():
    rt = running()
    return (rt,), lambda: rt.sync("a", [7], 9), BlockNotOwnedError, "block 7 is free"


@case
def _sync_shared_block_the_pool_does_not_count_twice():
    rt = running()
    rt.admit("c")  # block 0 is full in 'a', but nobody took a second reference to it
    return (rt,), lambda: rt.sync("c", [0], 4), BlockNotOwnedError, "block 0 belongs to request 'a'"


@case
def _sync_block_reserved_by_a_plan_in_flight():
    rt = inflight(headroom=0)
    rt.admit("c")
    return (rt,), lambda: rt.sync("c", [4], 2), BlockNotOwnedError, "block 4 is reserved"


@case
def _sync_shared_block_a_plan_in_flight_touches():
    rt = inflight(headroom=0)
    rt.admit("c")
    rt.pool.share(0)  # as a prefix-cache hit would, while 'a' compacts block 0 away
    return (rt,), lambda: rt.sync("c", [0], 4), PlanConflictError, "block 0"


@case
def _sync_refuses_a_float_length():
    rt = running()
    return (rt,), lambda: rt.sync("a", [], 7.0), TokenOutOfRangeError, "7.0"


@case
def _sync_refuses_true_as_block():
    rt = running()
    return (rt,), lambda: rt.sync("a", [True], 9), BlockOutOfRangeError, "True"


@case
def _sync_unknown_request():
    rt = running()
    return (rt,), lambda: rt.sync("zz", [], 1), UnknownRequestError, "'zz'"


@case
def _evict_and_reclaim_refuses_one_string_as_request_ids():
    rt = running(policy=H2O())
    return (rt,), lambda: rt.evict_and_reclaim("ab"), InvalidArgumentError, "'ab'"


@case
def _evict_and_reclaim_refuses_a_request_named_twice():
    rt = running(policy=H2O())
    return (rt,), lambda: rt.evict_and_reclaim(["a", "a"]), InvalidArgumentError, "'a', 'a'"


@case
def _evict_and_reclaim_refuses_a_row_without_token_ids():
    rt = running(policy=H2O())
    return (rt,), lambda: rt.evict_and_reclaim(["a"], {"a": [0.5, 0.5]}), InvalidArgumentError, "request 'a'"


@case
def _evict_and_reclaim_refuses_true_as_token():
    rt = running(policy=H2O())
    return (rt,), lambda: rt.evict_and_reclaim(["a"], {"a": ([True], [1.0])}), InvalidArgumentError, "True"


@case
def _evict_and_reclaim_refuses_a_nan_weight():
    rt = running(policy=H2O())
    return (rt,), lambda: rt.evict_and_reclaim(["a"], {"a": ([0, 1], [math.nan, 1.0])}), InvalidArgumentError, "nan"


@case
def _evict_and_reclaim_refuses_true_as_a_weight_naming_request_and_index():
    rt = running(policy=H2O())
    return (rt,), lambda: rt.evict_and_reclaim(["a"], {"a": ([0, 1], [0.5, True])}), InvalidArgumentError, \
        "request 'a': attention row: weight True at index 1"


@case
def _evict_and_reclaim_refuses_true_as_a_key_norm_naming_request_and_index():
    rt = running(policy=Knorm())
    return (rt,), lambda: rt.evict_and_reclaim(["a"], None, {"a": ([0], [True])}), InvalidArgumentError, \
        "request 'a': key norms: weight True at index 0"


@case
def _evict_and_reclaim_refuses_false_as_a_vote_naming_request_and_index():
    rt = running(policy=SnapKV())
    return (rt,), lambda: rt.evict_and_reclaim(["a"], None, None, {"a": ([0, 1], [0.5, False])}), \
        InvalidArgumentError, "request 'a': observation: weight False at index 1"


@case
def _scores_record_refuses_true_as_a_weight():
    s = scores_()
    return (s,), lambda: s.record("r", [0, 1], [True, 0.5]), InvalidArgumentError, "weight True at index 0"


@case
def _evict_and_reclaim_refuses_a_token_past_the_request():
    rt = running(policy=H2O())
    return (rt,), lambda: rt.evict_and_reclaim(["a"], {"a": ([0, 6], [0.5, 0.5])}), TokenOutOfRangeError, "token 6"


@case
def _evict_and_reclaim_refuses_key_norms_without_token_ids():
    rt = running(policy=Knorm())
    return (rt,), lambda: rt.evict_and_reclaim(["a"], None, {"a": [0.5]}), InvalidArgumentError, "(token ids, norms)"


@case
def _evict_and_reclaim_refuses_key_norms_of_an_unknown_request():
    rt = running(policy=Knorm())
    return (rt,), lambda: rt.evict_and_reclaim(["a"], None, {"zz": ([0], [0.5])}), UnknownRequestError, "'zz'"


@case
def _evict_and_reclaim_refuses_a_key_norm_past_the_request():
    rt = running(policy=Knorm())
    return (rt,), lambda: rt.evict_and_reclaim(["a"], None, {"a": ([6], [0.5])}), TokenOutOfRangeError, "token 6"


@case
def _evict_and_reclaim_unknown_request():
    rt = running(policy=H2O())
    return (rt,), lambda: rt.evict_and_reclaim(["a", "zz"]), UnknownRequestError, "'zz'"


@case
def _evict_and_reclaim_refuses_attention_as_a_list():
    rt = running(policy=H2O())
    return (rt,), lambda: rt.evict_and_reclaim(["a"], [([0], [1.0])]), InvalidArgumentError, "attention"


@case
def _evict_and_reclaim_records_no_row_when_a_later_row_is_bad():
    rt = running(policy=H2O())
    rows = {"a": ([0, 1], [0.5, 0.5]), "b": ([0, 1], [0.5, "x"])}
    return (rt,), lambda: rt.evict_and_reclaim(["a", "b"], rows), InvalidArgumentError, "request 'b'"


# ---- the device layer (torch) ------------------------------------------------------------------------------
@case
def _kv_pair_refuses_k_and_v_on_different_devices():
    torch = torch_()
    from vtoken.integration.device.kv_layout import LayoutError, gpu_planes

    k, v = torch.zeros(4, 2, 2, 3), torch.zeros(4, 2, 2, 3, device="meta")
    return (), lambda: gpu_planes("l0", (k, v)), LayoutError, "meta"


@case
def _kv_cache_refuses_planes_on_different_devices():
    torch = torch_()
    from vtoken.integration.device.kv_cache import PagedKVCache
    from vtoken.integration.device.kv_layout import LayoutError, gpu_planes

    planes = gpu_planes("l0", torch.zeros(2, 4, 2, 2, 3)) + gpu_planes("l1", torch.zeros(2, 4, 2, 2, 3, device="meta"))
    return (), lambda: PagedKVCache(planes), LayoutError, "'l1'"


@case
def _kv_pair_refuses_block_size_zero():
    torch = torch_()
    from vtoken.integration.device.kv_layout import LayoutError, gpu_planes

    return (), lambda: gpu_planes("l0", (torch.zeros(4, 0, 2, 3),) * 2), LayoutError, "'l0'"


@case
def _kv_pair_refuses_zero_blocks():
    torch = torch_()
    from vtoken.integration.device.kv_layout import LayoutError, gpu_planes

    return (), lambda: gpu_planes("l0", torch.zeros(2, 0, 2, 2, 3)), LayoutError, "0 blocks"


@case
def _kv_pair_refuses_three_tensors():
    torch = torch_()
    from vtoken.integration.device.kv_layout import LayoutError, gpu_planes

    return (), lambda: gpu_planes("l0", (torch.zeros(4, 2, 2, 3),) * 3), LayoutError, "'l0'"


@case
def _kv_pair_refuses_lists_for_tensors():
    torch_()
    from vtoken.integration.device.kv_layout import LayoutError, gpu_planes

    return (), lambda: gpu_planes("l0", ([0.0], [0.0])), LayoutError, "'l0'"


@case
def _kv_cpu_plane_refuses_a_float_block_order():
    torch = torch_()
    from vtoken.integration.device.kv_layout import LayoutError, cpu_plane

    cache = torch.zeros(4, 2, 2, 6)
    return (cache,), lambda: cpu_plane("c0", cache, torch.zeros(2, 12)), LayoutError, "'c0'"


@case
def _kv_cache_refuses_no_planes():
    torch_()
    from vtoken.integration.device.kv_cache import PagedKVCache
    from vtoken.integration.device.kv_layout import LayoutError

    return (), lambda: PagedKVCache([]), LayoutError, "at least one plane"


@case
def _kv_cache_refuses_a_tensor_for_a_plane():
    torch = torch_()
    from vtoken.integration.device.kv_cache import PagedKVCache
    from vtoken.integration.device.kv_layout import LayoutError

    return (), lambda: PagedKVCache([torch.zeros(4, 2, 2, 3)]), LayoutError, "Tensor"


@case
def _kv_gather_refuses_a_negative_slot():
    torch = torch_()
    c = cache_()
    return (c,), lambda: c.gather(torch.tensor([0, -1])), BlockOutOfRangeError, "slot -1"


@case
def _kv_gather_refuses_a_slot_past_the_end():
    torch = torch_()
    c = cache_()
    return (c,), lambda: c.gather(torch.tensor([8])), BlockOutOfRangeError, "slot 8"


@case
def _kv_gather_refuses_float_slots():
    torch = torch_()
    c = cache_()
    return (c,), lambda: c.gather(torch.tensor([1.0])), InvalidArgumentError, "float32"


@case
def _kv_gather_refuses_a_list_of_slots():
    torch_()
    c = cache_()
    return (c,), lambda: c.gather([0, 1]), InvalidArgumentError, "list"


@case
def _kv_gather_refuses_2d_slots():
    torch = torch_()
    c = cache_()
    return (c,), lambda: c.gather(torch.zeros(2, 2, dtype=torch.int64)), InvalidArgumentError, "(2, 2)"


@case
def _kv_scatter_refuses_a_negative_slot():
    torch = torch_()
    c = cache_()
    values = c.gather(torch.tensor([0]))
    return (c,), lambda: c.scatter(torch.tensor([-1]), values), BlockOutOfRangeError, "slot -1"


@case
def _kv_scatter_refuses_values_of_the_wrong_dtype():
    torch = torch_()
    c = cache_()
    values = [v.float() for v in c.gather(torch.tensor([0]))]
    return (c,), lambda: c.scatter(torch.tensor([1]), values), InvalidArgumentError, "torch.float32"


@case
def _kv_scatter_refuses_too_few_values():
    torch = torch_()
    c = cache_()
    return (c,), lambda: c.scatter(torch.tensor([1]), []), InvalidArgumentError, "scatter"


@case
def _kv_read_refuses_a_negative_slot():
    torch = torch_()
    c = cache_()
    return (c,), lambda: c.read("l1.V", torch.tensor([-1])), BlockOutOfRangeError, "slot -1"


@case
def _kv_write_refuses_a_negative_slot():
    torch = torch_()
    c = cache_()
    return (c,), lambda: c.write("l1.V", torch.tensor([-1]), torch.ones(1, 6)), BlockOutOfRangeError, "slot -1"


@case
def _kv_write_refuses_an_unknown_plane():
    torch = torch_()
    from vtoken.integration.device.kv_layout import LayoutError

    c = cache_()
    return (c,), lambda: c.write("l9.K", torch.tensor([0]), torch.ones(1, 6)), LayoutError, "'l9.K'"


@case
def _kv_write_refuses_values_of_the_wrong_size():
    torch = torch_()
    c = cache_()
    return (c,), lambda: c.write("l0.K", torch.tensor([0, 1]), torch.ones(1, 6)), InvalidArgumentError, "'l0.K'"


@case
def _kv_read_refuses_bool_slots():
    torch = torch_()
    c = cache_()
    return (c,), lambda: c.read("l0.K", torch.tensor([True])), InvalidArgumentError, "torch.bool"


@case
def _tag_store_write_refuses_a_negative_slot():
    torch_()
    from vtoken.integration.device.tensor_tags import TensorTagStore

    s = TensorTagStore(cache_())
    return (s,), lambda: s.write(-1, 5), BlockOutOfRangeError, "-1"


@case
def _tag_store_write_refuses_a_tag_beyond_64_bits():
    torch_()
    from vtoken.integration.device.tensor_tags import TensorTagStore

    s = TensorTagStore(cache_())
    return (s,), lambda: s.write(0, 2**64), InvalidArgumentError, str(2**64)


@case
def _tag_store_read_refuses_true_as_slot():
    torch_()
    from vtoken.integration.device.tensor_tags import TensorTagStore

    s = TensorTagStore(cache_())
    return (s,), lambda: s.read(True), BlockOutOfRangeError, "True"


@case
def _mem_tag_store_write_refuses_a_slot_past_the_end():
    s = TagStore(4, 4)  # 16 slots: slot 16 used to raise IndexError
    return (s,), lambda: s.write(16, 7), BlockOutOfRangeError, "slot must be an int in [0, 15]"


@case
def _mem_tag_store_write_refuses_a_negative_slot():
    s = TagStore(4, 4)  # -1 used to write slot 15
    return (s,), lambda: s.write(-1, 7), BlockOutOfRangeError, "got -1"


@case
def _mem_tag_store_write_refuses_true_as_slot():
    s = TagStore(4, 4)
    return (s,), lambda: s.write(True, 7), BlockOutOfRangeError, "got True"


@case
def _mem_tag_store_read_refuses_a_float_slot():
    s = TagStore(4, 4)
    return (s,), lambda: s.read(1.0), BlockOutOfRangeError, "got 1.0"


@case
def _mem_tag_store_read_refuses_a_negative_slot():
    s = TagStore(4, 4)
    return (s,), lambda: s.read(-16), BlockOutOfRangeError, "got -16"


@case
def _mem_tag_store_write_refuses_a_tag_beyond_64_bits():
    s = TagStore(4, 4)
    return (s,), lambda: s.write(0, 2**63), InvalidArgumentError, str(2**63)


@case
def _mem_tag_store_refuses_a_negative_block_count():
    return (), lambda: TagStore(-1, 4), ConfigError, "num_blocks"


# ---- strict verify's configuration, the device scores (torch) ---------------------------------------------------
@case
def _verify_config_refuses_sample_every_as_a_string():
    torch_()
    from vtoken.integration.device.verify import VerifyConfig

    return (), lambda: VerifyConfig(sample_every="4"), ConfigError, "sample_every must be an int >= 1, got '4'"


@case
def _verify_config_refuses_true_as_sample_every():
    torch_()
    from vtoken.integration.device.verify import VerifyConfig

    return (), lambda: VerifyConfig(sample_every=True), ConfigError, "sample_every must be an int >= 1, got True"


@case
def _verify_config_refuses_a_float_sample_every():
    torch_()
    from vtoken.integration.device.verify import VerifyConfig

    return (), lambda: VerifyConfig(sample_every=1.5), ConfigError, "sample_every must be an int >= 1, got 1.5"


@case
def _verify_config_refuses_a_mode_by_its_name_listing_the_values():
    torch_()
    from vtoken.integration.device.verify import VerifyConfig

    return (), lambda: VerifyConfig(mode="STRICT"), ConfigError, "['off', 'sampled', 'strict'] (a VerifyMode"


def dev_scores(statistics=("accumulated", "persistence", "key_norm")):
    """Device scores over 'r''s read list of 4 tokens, with one row recorded and key norms set."""
    torch = torch_()
    from vtoken.integration.device.scores import DeviceScores

    d = DeviceScores(statistics=statistics)
    ids = torch.arange(4)
    d.realign("r", None, ids)
    d.record("r", torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64))
    d.set_keys("r", ids, torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
    return d, ids


@case
def _device_scores_refuse_an_unknown_statistic():
    torch_()
    from vtoken.integration.device.scores import DeviceScores

    return (), lambda: DeviceScores(statistics=("accumulated", "entropy")), ConfigError, "'entropy'"


@case
def _device_scores_refuse_no_statistic():
    torch_()
    from vtoken.integration.device.scores import DeviceScores

    return (), lambda: DeviceScores(statistics=()), ConfigError, "statistics"


@case
def _device_scores_set_keys_refuses_a_nan_norm():
    torch = torch_()
    d, ids = dev_scores()
    norms = torch.tensor([1.0, math.nan], dtype=torch.float64)
    return (d,), lambda: d.set_keys("r", ids[:2], norms), InvalidArgumentError, "request 'r': key_norm"


@case
def _device_scores_set_keys_refuses_a_negative_norm():
    torch = torch_()
    d, ids = dev_scores()
    norms = torch.tensor([1.0, -2.0], dtype=torch.float64)
    return (d,), lambda: d.set_keys("r", ids[:2], norms), InvalidArgumentError, "-2.0"


@case
def _device_scores_set_keys_refuses_an_infinite_norm():
    torch = torch_()
    d, ids = dev_scores()
    norms = torch.tensor([math.inf], dtype=torch.float64)
    return (d,), lambda: d.set_keys("r", ids[:1], norms), InvalidArgumentError, "inf"


@case
def _device_scores_set_keys_refuses_an_unknown_request():
    torch = torch_()
    d, ids = dev_scores()
    norms = torch.tensor([1.0], dtype=torch.float64)
    return (d,), lambda: d.set_keys("zz", ids[:1], norms), UnknownRequestError, "'zz'"


@case
def _device_scores_record_all_refuses_a_row_longer_than_the_scores():
    torch = torch_()
    d, _ = dev_scores()
    rows = torch.full((1, 5), 0.2, dtype=torch.float64)
    return (d,), lambda: d.record_all(["r"], rows, [5]), InvalidArgumentError, "request 'r'"


@case
def _device_scores_record_all_refuses_rows_for_fewer_requests():
    torch = torch_()
    d, _ = dev_scores()
    rows = torch.full((1, 4), 0.25, dtype=torch.float64)
    return (d,), lambda: d.record_all(["r", "r"], rows, [4, 4]), InvalidArgumentError, "rows of shape (1, 4)"


@case
def _device_scores_realign_refuses_old_ids_that_are_not_the_scored_list():
    torch = torch_()
    d, _ = dev_scores()
    return (d,), lambda: d.realign("r", torch.arange(3), torch.arange(5)), InvalidArgumentError, "request 'r'"


@case
def _device_scores_rank_refuses_a_statistic_not_recorded():
    torch_()
    from vtoken.core.policies.base import Ranking

    d, ids = dev_scores()
    return (d,), lambda: d.rank("r", ids, Ranking(1, 1, ("latest",)), 3), InvalidArgumentError, "'latest'"


# ---- tensor parallelism's copy reports (integration/vllm/worker_copies.py, no vLLM needed) ------------------------
def shard_reports():
    """Two ranks; copy 1 reported done by one of them so far."""
    from vtoken.integration.vllm.worker_copies import ShardReports

    s = ShardReports(2)
    assert s.settle([1], []) == ([], [])
    return s


@case
def _shard_reports_refuse_a_float_rank_count():
    from vtoken.integration.vllm.worker_copies import ShardReports

    return (), lambda: ShardReports(2.5), ConfigError, "ranks must be an int >= 1, got 2.5"


@case
def _shard_reports_refuse_true_as_rank_count():
    from vtoken.integration.vllm.worker_copies import ShardReports

    return (), lambda: ShardReports(True), ConfigError, "ranks must be an int >= 1, got True"


@case
def _shard_reports_refuse_a_string_rank_count():
    from vtoken.integration.vllm.worker_copies import ShardReports

    return (), lambda: ShardReports("2"), ConfigError, "ranks must be an int >= 1, got '2'"


@case
def _shard_reports_refuse_none_as_rank_count():
    from vtoken.integration.vllm.worker_copies import ShardReports

    return (), lambda: ShardReports(None), ConfigError, "ranks must be an int >= 1, got None"


@case
def _shard_reports_settle_counts_nothing_when_one_copy_is_over_reported():
    s = shard_reports()  # copy 2's report comes first and used to stay counted after the refusal
    return (s,), lambda: s.settle([2, 1, 1], []), CopyStateError, "copy 1 reported done by 3 ranks"


@case
def _shard_reports_settle_refuses_an_unhashable_handle():
    s = shard_reports()
    return (s,), lambda: s.settle([1, [2]], []), InvalidArgumentError, "[2]"


@case
def _shard_reports_settle_refuses_true_as_a_failed_handle():
    s = shard_reports()
    return (s,), lambda: s.settle([1], [True]), InvalidArgumentError, "True"


@case
def _shard_reports_settle_refuses_a_lone_handle():
    s = shard_reports()
    return (s,), lambda: s.settle(1, []), InvalidArgumentError, "done"


@case
def _tag_store_refuses_a_core_tag_store():
    torch_()
    from vtoken.integration.device.kv_layout import LayoutError
    from vtoken.integration.device.tensor_tags import TensorTagStore

    return (), lambda: TensorTagStore(TagStore(4, 4)), LayoutError, "TagStore"


@case
def _cpu_block_order_refuses_block_size_zero():
    torch_()
    from vtoken.integration.device.kv_layout import LayoutError, default_cpu_block_order

    return (), lambda: default_cpu_block_order(2, 0, 3), LayoutError, "block_size"


@case
def _probe_refuses_a_writer_that_is_not_callable():
    torch_()
    from vtoken.integration.device.kv_layout import LayoutError, probe_block_order

    return (), lambda: probe_block_order("cpu_attn_reshape_and_cache", 2, 4, 3), LayoutError, "cpu_attn"


# ---- the corpus -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_rejected_call_names_the_culprit_and_changes_nothing(name):
    state, call, expected, culprit = CASES[name]()
    before = deep_state(*state)
    with pytest.raises(VTokenError) as info:
        call()
    assert type(info.value) is expected, f"{type(info.value).__name__} ({info.value}), expected {expected.__name__}"
    assert culprit in str(info.value), f"message {str(info.value)!r} does not name {culprit!r}"
    after = deep_state(*state)
    assert after == before, describe_diff(before, after)


def test_the_corpus_is_large_and_spans_the_api():
    assert len(CASES) >= 130
    prefixes = {n.split("_")[0] for n in CASES}
    assert {"pool", "occupancy", "table", "scores", "runtime", "admit", "begin", "end", "sync", "evict", "kv",
            "tag", "view", "h2o", "streaming", "scissorhands", "random"} <= prefixes


# ---- what the checks must still accept ---------------------------------------------------------------------
def test_a_full_block_shared_through_the_pool_syncs_into_a_second_table():
    rt = running()
    rt.admit("c")
    rt.pool.share(0)  # a prefix-cache hit on 'a''s full first block
    assert rt.sync("c", [0], 4) == [0, 1, 2, 3]
    assert rt.table.owners(0) == ["a", "c"] and rt.pool.ref_count(0) == 2
    rt.finish("a")
    assert rt.table.owners(0) == ["c"] and rt.pool.ref_count(0) == 1


def test_policy_and_read_path_accept_their_names():
    pool, eng = bare_parts()
    rt = VTokenRuntime(pool, eng, policy="h2o", read_path="gather")
    assert isinstance(rt.policy, H2O) and rt.read_path is ReadPath.GATHER


def test_every_enum_argument_takes_its_member_or_its_exact_value():
    """The one rule (``checks.check_enum``, README "Using the core"): a member, or the string that is its value."""
    from vtoken.core.reclamation import Ordering
    from vtoken.core.sim.simulator import SimConfig

    pool = pool_()  # 5 free, headroom 2
    assert pool.can_allocate(5, "evacuation") and not pool.can_allocate(4, "admission")
    assert pool.allocate(3, "admission") == [3, 4, 5]
    cfg = ReclaimConfig(planner="densify", ordering="event")
    assert cfg == ReclaimConfig(PlanKind.DENSIFY, ordering=Ordering.EVENT) and cfg.planner is PlanKind.DENSIFY
    pool, eng = bare_parts()
    rt = VTokenRuntime(pool, eng, policy="h2o", reclaim=cfg, read_path="dense")
    assert rt.read_path is ReadPath.DENSE and rt.manager.config.ordering is Ordering.EVENT
    pool, eng = bare_parts()
    assert VTokenRuntime(pool, eng, ordering="force_sync").manager.config.ordering is Ordering.FORCE_SYNC
    assert SimConfig(read_path=ReadPath.DENSE, ordering="event").read_path is ReadPath.DENSE


def test_every_enum_argument_of_the_device_layer_takes_its_member_or_its_exact_value():
    torch_()
    from vtoken.integration.device.verify import OnMismatch, VerifyConfig, VerifyMode

    cfg = VerifyConfig("sampled", sample_every=4, on_mismatch="quarantine")
    assert cfg.mode is VerifyMode.SAMPLED and cfg.on_mismatch is OnMismatch.QUARANTINE
    assert cfg == VerifyConfig(VerifyMode.SAMPLED, 4, OnMismatch.QUARANTINE)


def test_a_bad_argument_is_refused_under_python_dash_o_too():
    """Checks are raised, never asserted: ``python -O`` strips asserts (choose_sources used to accept 0 there)."""
    import subprocess
    import sys

    code = ("from vtoken.core.reference.compact import choose_sources\n"
            "from vtoken.core.errors import InvalidArgumentError\n"
            "from vtoken.core.token_table import TokenTable\n"
            "t = TokenTable(4, 4); t.add_request('a'); t.sync_new_tokens('a', [0, 1], 8)\n"
            "try:\n    choose_sources(t.snapshot('a'), 0, 4)\n"
            "except InvalidArgumentError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("refused: max_sources"), out.stdout + out.stderr


def test_end_step_drops_the_row_of_a_request_that_finished_during_the_step():
    rt = open_step(policy=H2O(), budget=1.0)
    rt.finish("b")
    assert rt.end_step({"a": [1 / 7] * 7, "b": [0.25] * 4}) == {}
    assert rt.scores.accumulated("a", 0) == pytest.approx(1 / 7)


def test_on_an_accelerator_an_out_of_range_slot_faults_instead_of_wrapping():
    """The guard the accelerator path uses (no host sync), exercised on the CPU: the guarded slot lies past
    every group's storage, so indexing with it raises instead of reading K's last block through V."""
    torch = torch_()
    c = cache_()
    guarded = c._guard(torch.tensor([3, -1, 8]))
    assert guarded[0] == 3 and bool((guarded[1:] == c._fault_slot).all())
    for g in c.groups:
        rows = g.rows(guarded[1:], c.block_size)
        assert bool((rows >= g.row_view().shape[0]).all())
        with pytest.raises(IndexError):
            g.row_view().index_select(0, rows.flatten())


def test_deep_state_sees_nested_changes():
    t = table_ab()
    before = deep_state(t)
    t._requests["a"].slots[0] = 3  # a write no public method would make
    assert deep_state(t) != before
    torch = torch_()
    c = cache_()
    before = deep_state(c)
    c.groups[-1].flat[-1] += 1
    assert deep_state(c) != before
