"""Reachable core states for CrossHair: how ``spec/crosshair_check.py`` builds ``self`` and snapshots.

CrossHair checks a method's PEP 316 contract on a ``self`` it builds by calling
the class's constructor with symbolic arguments. For the core that is always a
*fresh* object (an empty pool, a table without requests), on which ``free``,
``share``, ``evict_token`` and ``apply_moves`` can only reject. And a
``RequestSnapshot`` built field by field is almost never consistent, so the
planners' own assertions would fire on states the runtime cannot reach.

So this module registers (``crosshair.register_type``) a creator for
``BlockPool``, ``TokenTable`` and ``RequestSnapshot`` that starts from a small
fresh object and applies a short symbolic history of the core's own public
operations (rejected ones are recorded and change nothing, by design). Each
choice in the history is a branch CrossHair explores (``_pick``), not a
symbolic int realized to one value, so the path tree enumerates histories.
The objects are the core's own classes with a ``__repr__`` that prints the
history, which is what a counterexample shows.

Bounds (what "reachable" means in a report): pools of 1..4 blocks, any headroom,
up to 4 allocate / share / free calls; tables of 6 blocks of 1..3 slots, where
request 0 syncs up to 3 blocks of tokens, evicts any subset of them, maybe moves
one token and maybe appends up to a block more, and a second request may hold
tokens of its own, starting with request 0's first block (a cached prefix). The method's own arguments stay fully symbolic.
"""

from __future__ import annotations

from collections.abc import Callable

from vtoken.core.block_pool import BlockPool, Purpose
from vtoken.core.errors import VTokenError
from vtoken.core.token_table import Move, RequestSnapshot, TokenTable

POOL_MAX_BLOCKS = 4
POOL_MAX_STEPS = 4
TABLE_BLOCKS = 6
TABLE_MAX_BLOCK_SIZE = 3


def _pick(factory, name: str, hi: int, lo: int = 0) -> int:
    """A concrete int in [lo, hi], chosen by a chain of solver branches so that every value is explored.

    The branch probabilities make the first try of each value about equally likely.
    """
    for v in range(lo, hi):
        if factory.space.smt_fork(desc=f"{name}_is_{v}", probability_true=1.0 / (hi - v + 1)):
            return v
    return hi


def _pool_repr(self) -> str:
    return f"{type(self).__base__.__name__}({self.num_blocks}, {self.block_size}, headroom={self.headroom}) after {self.history}"


def _table_repr(self) -> str:
    return f"{type(self).__base__.__name__}({self.num_blocks}, {self.block_size}) after {self.history}"


_TRACED: dict[type, type] = {}


def _traced(cls: type, repr_fn: Callable[[object], str]) -> type:
    """``cls`` plus a ``__repr__`` that prints the history it was built by (counterexample messages only)."""
    if cls not in _TRACED:
        _TRACED[cls] = type(cls.__name__, (cls,), {"__repr__": repr_fn, "__module__": __name__})
    return _TRACED[cls]


def _attempt(history: list[str], desc: str, op: Callable[..., object], *args: object) -> None:
    history.append(desc)
    try:
        op(*args)
    except VTokenError as e:
        history[-1] += f" -> {type(e).__name__}"


def make_pool(factory, cls: type = BlockPool) -> BlockPool:
    """A pool after up to ``POOL_MAX_STEPS`` allocate / share / free calls. ``cls`` lets tests plant bugs."""
    n = 1 + _pick(factory, "num_blocks", POOL_MAX_BLOCKS - 1)
    h = _pick(factory, "headroom", n - 1)
    pool = _traced(cls, _pool_repr)(n, 2, h)
    pool.history = []
    for i in range(_pick(factory, "steps", POOL_MAX_STEPS)):
        op = _pick(factory, f"op{i}", 2)
        if op == 0:
            k = _pick(factory, f"n{i}", n)
            purpose = Purpose.EVACUATION if _pick(factory, f"evac{i}", 1) else Purpose.ADMISSION
            _attempt(pool.history, f"allocate({k}, {purpose.name})", pool.allocate, k, purpose)
        else:
            b = _pick(factory, f"b{i}", n - 1)
            if op == 1:
                _attempt(pool.history, f"share({b})", pool.share, b)
            else:
                _attempt(pool.history, f"free([{b}])", pool.free, [b])
    return pool


def make_table(factory, cls: type = TokenTable) -> TokenTable:
    """A table built in four phases, each a few explored choices (see the module docstring).

    1. request 0 syncs 1..3S tokens; request 1, if any, syncs its own, possibly starting
       with request 0's full first block (a cached prefix);
    2. each of request 0's tokens is evicted or not;
    3. maybe one move of a live token of request 0 to a position before its cursor;
    4. maybe request 0 appends 1..S more tokens (after the holes).
    """
    S = 1 + _pick(factory, "block_size", TABLE_MAX_BLOCK_SIZE - 1)
    t = _traced(cls, _table_repr)(TABLE_BLOCKS, S)
    t.history = []
    fresh = iter(range(TABLE_BLOCKS))

    def sync(r: object, k: int, shared_prefix: tuple[int, ...] = ()) -> None:
        need = -(-(t.write_pos(r) + k) // S) - len(t.block_ids(r))
        new = list(shared_prefix) + [next(fresh) for _ in range(max(0, need) - len(shared_prefix))]
        total = t.total_len(r) + k
        _attempt(t.history, f"sync_new_tokens({r!r}, {new}, {total})", t.sync_new_tokens, r, new, total)

    t.add_request(0)
    sync(0, _pick(factory, "len0", 3 * S, 1))
    if _pick(factory, "second_request", 1):
        t.add_request(1)
        if t.write_pos(0) >= S and _pick(factory, "shared_prefix", 1):  # SH: both cursors lie past a shared block
            sync(1, S + _pick(factory, "len1", S - 1), (t.block_ids(0)[0],))
        else:
            sync(1, _pick(factory, "len1", S, 1))
    for tok in range(t.total_len(0)):
        if factory.space.smt_fork(desc=f"evict{tok}", probability_true=0.4):
            _attempt(t.history, f"evict_token(0, {tok})", t.evict_token, 0, tok)
    live = t.live_slots(0)
    if live and factory.space.smt_fork(desc="move", probability_true=0.3):
        tok, slot = live[_pick(factory, "mover", len(live) - 1)]
        p = _pick(factory, "to_position", t.write_pos(0) - 1)
        m = Move(tok, slot // S, slot % S, t.block_ids(0)[p // S], p % S)
        _attempt(t.history, f"apply_moves(0, [{tuple(m)}])", t.apply_moves, 0, [m])
    if factory.space.smt_fork(desc="append", probability_true=0.4):
        sync(0, _pick(factory, "appended", S, 1))
    return t


def make_snapshot(factory, table_cls: type = TokenTable) -> RequestSnapshot:
    """Request 0's snapshot of a reachable table; blocks it shares with request 1 are ``shared_blocks``."""
    t = make_table(factory, table_cls)
    shared = set(t.block_ids(1)) if 1 in t else set()
    return t.snapshot(0, shared)


def obligations() -> list:
    """None of its own: this module only builds states for spec/crosshair_check.py's obligation."""
    return []


def register() -> None:
    """Install the creators; call after ``crosshair.main`` is imported (its import resets registrations)."""
    from crosshair import register_type

    register_type(BlockPool, make_pool)
    register_type(TokenTable, make_table)
    register_type(RequestSnapshot, make_snapshot)


__all__ = ["make_pool", "make_snapshot", "make_table", "obligations", "register"]
