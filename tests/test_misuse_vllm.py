"""Misuse of the vLLM plugin's boundaries (issue #15): ``VTokenSettings.from_additional_config`` and
``VllmBlockAllocator`` over vLLM's real ``BlockPool`` (no engine). Each case asserts the exact exception
class, that the message names the culprit, and that a deep snapshot (``misuse_snapshot.deep_state``: every
reachable field of the allocator, vLLM's pool and its blocks; or of the config passed in) is byte for byte
what it was before the call."""

from __future__ import annotations

import pytest

from misuse_snapshot import deep_state, describe_diff
from vtoken.core.block_pool import Purpose
from vtoken.core.errors import (BlockOutOfRangeError, ConfigError, DoubleFreeError, HeadroomReservedError,
                                InvalidArgumentError, PoolExhaustedError)
from vtoken.integration.vllm.settings import SettingsError, VTokenSettings

pytest.importorskip("vllm")
from vllm.v1.core.block_pool import BlockPool as VllmPool  # noqa: E402

from vtoken.integration.vllm.allocator import VllmBlockAllocator  # noqa: E402

ADM, EVAC = Purpose.ADMISSION, Purpose.EVACUATION
N, S, HEADROOM = 10, 4, 2  # vLLM: block 0 is the null block -> 9 usable


# ---- settings ---------------------------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
SETTINGS = [
    # additional_config itself
    (["vtoken"], "additional_config must be a mapping (a dict), got list ['vtoken']"),
    ("vtoken", "additional_config must be a mapping (a dict), got str 'vtoken'"),
    ("", "got str ''"),
    (0, "got int 0"),
    # the block
    ({"vtoken": ["policy", "h2o"]}, "additional_config['vtoken'] must be a mapping of settings, got list"),
    ({"vtoken": None}, "additional_config['vtoken'] must be a mapping of settings, got NoneType"),
    ({"vtoken": "strict"}, "additional_config['vtoken'] must be a mapping of settings, got str 'strict'"),
    # keys
    ({"vtoken": {1: "x"}}, "vtoken setting names must be strings, got [1]"),
    ({"vtoken": {1: "x", "policy": "h2o"}}, "vtoken setting names must be strings, got [1]"),
    ({"vtoken": {("policy",): "h2o"}}, "got [('policy',)]"),
    ({"vtoken": {"polcy": "h2o"}}, "unknown vtoken setting(s) ['polcy']"),
    # True/False where an int is meant
    ({"vtoken": {"max_sources": True}}, "vtoken.max_sources must be an integer >= 1, got True"),
    ({"vtoken": {"sample_every": False}}, "vtoken.sample_every must be an integer >= 1, got False"),
    ({"vtoken": {"reclaim": "compact", "read_path": "gather", "headroom": True}}, "vtoken.headroom must be an integer"),
    ({"vtoken": {"drill_every": True}}, "vtoken.drill_every must be an integer >= 0 (0: off), got True"),
    ({"vtoken": {"seed": False}}, "vtoken.seed must be an integer >= 0, got False"),
    ({"vtoken": {"score_layers": True}}, "vtoken.score_layers must be an integer >= 0"),
    ({"vtoken": {"budget": True}}, "vtoken.budget must be a ratio in (0, 1]"),
    ({"vtoken": {"theta_f": False}}, "vtoken.theta_f must be a number in [0, 1), got False"),
    # out of range, non-finite, wrong type
    ({"vtoken": {"theta_f": NAN}}, "vtoken.theta_f must be a number in [0, 1), got nan"),
    ({"vtoken": {"budget": NAN}}, "got nan"),
    ({"vtoken": {"budget": INF}}, "got inf"),
    ({"vtoken": {"budget": -3}}, "or a token count >= 1 (e.g. 512), got -3"),
    ({"vtoken": {"max_sources": 2.0}}, "vtoken.max_sources must be an integer >= 1, got 2.0"),
    ({"vtoken": {"seed": -1}}, "vtoken.seed must be an integer >= 0, got -1"),
    ({"vtoken": {"drill_every": -1}}, "vtoken.drill_every must be an integer >= 0 (0: off), got -1"),
    ({"vtoken": {"evidence_dir": ""}}, "vtoken.evidence_dir must be a non-empty path, got ''"),
    ({"vtoken": {"policy": ["h2o"]}}, "vtoken.policy must be one of"),
]


@pytest.mark.parametrize("config, message", SETTINGS, ids=[repr(c)[:60] for c, _ in SETTINGS])
def test_a_bad_additional_config_is_refused_naming_the_culprit(config, message):
    before = deep_state(config)
    with pytest.raises(SettingsError) as e:
        VTokenSettings.from_additional_config(config)
    assert type(e.value) is SettingsError and isinstance(e.value, ConfigError)
    assert message in str(e.value), str(e.value)
    assert deep_state(config) == before, describe_diff(before, deep_state(config))


def test_what_is_not_ours_is_not_refused():
    class PlatformConfig:  # vLLM's SupportsHash: a platform's own additional_config object
        def compute_hash(self) -> str:
            return "x"

    assert VTokenSettings.from_additional_config(PlatformConfig()) is None
    assert VTokenSettings.from_additional_config({}) is None
    assert VTokenSettings.from_additional_config({"other": [1, 2]}) is None
    assert VTokenSettings.from_additional_config({"vtoken": {}}) == VTokenSettings()


# ---- the allocator --------------------------------------------------------------------------------------------------
@pytest.fixture
def alloc():
    """vLLM's pool with blocks in every state: shared (2 refs), allocated once, freed (cached), free."""
    a = VllmBlockAllocator(VllmPool(N, enable_caching=True, hash_block_size=S), S, HEADROOM)
    held = a.allocate(3, ADM)
    a.share(held[0])
    a.free([held[2]])
    a.held = held  # noqa: attribute for the cases: [shared, once, freed]
    return a


def _free_block(a) -> int:
    return next(b for b in range(1, N) if a.ref_count(b) == 0)


ALLOCATOR = [
    # counts
    (lambda a: a.allocate(1.5, ADM), InvalidArgumentError, "block count must be an int", "1.5"),
    (lambda a: a.allocate(True, ADM), InvalidArgumentError, "block count must be an int", "True"),
    (lambda a: a.allocate("2", ADM), InvalidArgumentError, "block count must be an int", "'2'"),
    (lambda a: a.allocate(None, EVAC), InvalidArgumentError, "block count must be an int", "None"),
    (lambda a: a.allocate(-1, ADM), PoolExhaustedError, "negative number of blocks", "-1"),
    (lambda a: a.allocate(6, ADM), HeadroomReservedError, "headroom of 2", "6"),
    (lambda a: a.allocate(100, EVAC), PoolExhaustedError, "evacuation needs 100 blocks", "100"),
    (lambda a: a.can_allocate(2.0, ADM), InvalidArgumentError, "block count must be an int", "2.0"),
    (lambda a: a.can_allocate(False, EVAC), InvalidArgumentError, "block count must be an int", "False"),
    # purposes: a member or its exact value ("admission"), nothing else (checks.check_enum)
    (lambda a: a.allocate(2, "ADMISSION"), InvalidArgumentError, "purpose must be one of ['admission', 'evacuation']",
     "'ADMISSION'"),
    (lambda a: a.allocate(7, "evacuate"), InvalidArgumentError, "purpose must be one of", "'evacuate'"),
    (lambda a: a.allocate(1, None), InvalidArgumentError, "purpose must be one of", "None"),
    (lambda a: a.can_allocate(1, "Admission"), InvalidArgumentError, "purpose must be one of", "'Admission'"),
    (lambda a: a.allocate(7, "admission"), HeadroomReservedError, "headroom of 2", "7"),  # the value is the member
    # free
    (lambda a: a.free([float(a.held[1])]), BlockOutOfRangeError, "outside the pool", ".0"),
    (lambda a: a.free([True]), BlockOutOfRangeError, "outside the pool", "True"),
    (lambda a: a.free("12"), BlockOutOfRangeError, "blocks to free must be a sequence", "'12'"),
    (lambda a: a.free(5), BlockOutOfRangeError, "blocks to free must be a sequence", "5"),
    (lambda a: a.free({5: 1}), BlockOutOfRangeError, "blocks to free must be a sequence", "{5: 1}"),
    (lambda a: a.free([[a.held[1]]]), BlockOutOfRangeError, "outside the pool", "block ["),
    (lambda a: a.free([a.held[1], 0]), BlockOutOfRangeError, "null block", "block 0"),
    (lambda a: a.free([a.held[1], 99]), BlockOutOfRangeError, "outside the pool", "99"),
    (lambda a: a.free([a.held[1], a.held[1]]), DoubleFreeError, "freed 2 time(s) but holds 1", "block"),
    (lambda a: a.free([_free_block(a)]), DoubleFreeError, "holds 0 reference", "block"),
    # share and ref_count
    (lambda a: a.share(float(a.held[0])), BlockOutOfRangeError, "outside the pool", ".0"),
    (lambda a: a.share(True), BlockOutOfRangeError, "outside the pool", "True"),
    (lambda a: a.share(str(a.held[0])), BlockOutOfRangeError, "outside the pool", "'"),
    (lambda a: a.share(0), BlockOutOfRangeError, "null block", "block 0"),
    (lambda a: a.share(a.held[2]), DoubleFreeError, "it is free", "cannot share block"),
    (lambda a: a.ref_count(1.5), BlockOutOfRangeError, "outside the pool", "1.5"),
]


@pytest.mark.parametrize("call, exc, message, culprit", ALLOCATOR,
                         ids=[f"{i}-{c[1].__name__}" for i, c in enumerate(ALLOCATOR)])
def test_a_bad_allocator_call_is_refused_and_changes_nothing(alloc, call, exc, message, culprit):
    before = deep_state(alloc)
    vllm_free = alloc.pool.get_num_free_blocks()
    with pytest.raises(exc) as e:
        call(alloc)
    assert type(e.value) is exc, f"{type(e.value).__name__}: {e.value}"
    assert message in str(e.value) and culprit in str(e.value), str(e.value)
    assert alloc.pool.get_num_free_blocks() == vllm_free
    after = deep_state(alloc)
    assert after == before, describe_diff(before, after)
    alloc.check()


@pytest.mark.parametrize("block_size, headroom, message", [
    (0, 0, "block_size must be an int >= 1, got 0"),
    (1.5, 0, "block_size must be an int >= 1, got 1.5"),
    (True, 0, "block_size must be an int >= 1, got True"),
    (S, True, "headroom must be an int in [0, 8]"),
    (S, 1.0, "got 1.0"),
    (S, -1, "got -1"),
    (S, N - 1, f"got {N - 1}"),
])
def test_a_bad_allocator_configuration_is_refused(block_size, headroom, message):
    pool = VllmPool(N, enable_caching=True, hash_block_size=S)
    before = deep_state(pool)
    with pytest.raises(ConfigError) as e:
        VllmBlockAllocator(pool, block_size, headroom)
    assert type(e.value) is ConfigError and message in str(e.value), str(e.value)
    assert deep_state(pool) == before


def test_the_fraction_that_used_to_leak_into_vllms_counter():
    """``allocate(1.5)`` once took one block from vLLM and left its free counter at a fraction."""
    a = VllmBlockAllocator(VllmPool(N, enable_caching=True, hash_block_size=S), S, 0)
    with pytest.raises(InvalidArgumentError):
        a.allocate(1.5, EVAC)
    assert a.pool.get_num_free_blocks() == N - 1 and isinstance(a.pool.get_num_free_blocks(), int)
    a.check()
