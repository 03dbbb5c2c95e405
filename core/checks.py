"""The argument checks every public call of the core runs before it changes anything.

One small set of helpers, so that every boundary refuses the same things the same way and names the
culprit in its message:

  * an int is an ``int`` and never a ``bool`` (``True`` is an int subclass, but never a count, an id
    or a budget here);
  * a number is finite (no NaN, no infinity) and not a ``bool``;
  * a request id is hashable and neither ``None`` (the "no request" sentinel) nor a ``bool``;
  * an enum-typed argument is a member, or the exact string value of one (``"gather"`` for ``ReadPath.GATHER``),
    everywhere (``check_enum``);
  * a sequence argument is an iterable that is not a ``str``/``bytes`` (a lone string id iterated as
    characters is never what the caller meant) and not a mapping.

Every check is O(size of its input) and raises the ``VTokenError`` subclass the caller names (default
``InvalidArgumentError``). Standard library only, like the rest of ``vtoken.core``.
"""

from __future__ import annotations

import enum
import math
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from .errors import ConfigError, InvalidArgumentError, VTokenError

E = TypeVar("E", bound=enum.Enum)


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return value.__class__ is int or isinstance(value, int) and not isinstance(value, bool)  # plain int first


def check_int(what: str, value: object, lo: int | None = None, hi: int | None = None,
              error: type[VTokenError] = InvalidArgumentError, hint: str = "") -> int:
    """``value`` if it is an int (not a bool) with ``lo <= value <= hi`` (either bound optional).

    ``what`` names the argument in the message (e.g. "request 'a': total_len"); the message always
    ends with the offending value's repr.
    """
    if not is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):  # type: ignore[operator]
        rng = (f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}") if lo is not None \
            else f"an int <= {hi}" if hi is not None else "an int"
        raise error(f"{what} must be {rng}{hint}, got {value!r}")
    return value  # type: ignore[return-value]


def check_number(what: str, value: object, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False, hi_open: bool = False,
                 error: type[VTokenError] = ConfigError) -> float:
    """``value`` if it is a finite real number (int or float, not a bool) within the bounds."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo  # type: ignore[operator]
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi  # type: ignore[operator]
    if not ok:
        lb = "" if lo is None else f"{'(' if lo_open else '['}{lo}, "
        ub = "" if hi is None else f"{hi}{')' if hi_open else ']'}"
        rng = f" in {lb or '(-inf, '}{ub or 'inf)'}" if lo is not None or hi is not None else ""
        raise error(f"{what} must be a finite number{rng}, got {value!r}")
    return value  # type: ignore[return-value]


def check_request_id(req_id: object, error: type[VTokenError] = InvalidArgumentError) -> object:
    """``req_id`` if it can name a request: hashable, not ``None``, not a ``bool``."""
    if req_id is None or isinstance(req_id, bool):
        raise error(f"request id must be a hashable value other than None and True/False, got {req_id!r}")
    try:
        hash(req_id)
    except TypeError:
        raise error(f"request id must be hashable, got {req_id!r} ({type(req_id).__name__})") from None
    return req_id


def is_known_key(mapping: Mapping, key: object) -> bool:
    """``key in mapping``, False (not TypeError) for an unhashable key and for a bool key."""
    if isinstance(key, bool):
        return False
    try:
        return key in mapping
    except TypeError:
        return False


def check_enum(what: str, value: object, cls: type[E], error: type[VTokenError] = ConfigError,
               allowed: tuple[E, ...] | None = None, hint: str = "") -> E:
    """The one rule for every enum-typed argument of vtoken: the member itself, or the exact string value of one
    (``ReadPath.GATHER`` or ``"gather"``), turned into the member; anything else (the member's name ``"GATHER"``,
    another spelling, an int, None) raises ``error`` naming ``what`` and listing the values accepted.

    ``allowed`` narrows the members accepted (default: all of ``cls``); ``hint`` ends the refusal. A member costs
    one isinstance check, so per-call arguments on hot paths use it as well as configurations.
    """
    members = tuple(cls) if allowed is None else allowed
    member = value if isinstance(value, cls) else next((m for m in members if m.value == value), None) \
        if isinstance(value, str) else None
    if member not in members:
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise error(f"{what} must be one of {[m.value for m in members]} ({article} {cls.__name__} or its value), "
                    f"got {value!r}{hint}")
    return member  # type: ignore[return-value]


_PLAIN_SEQUENCES = frozenset((list, tuple, range))


def as_list(what: str, value: object, error: type[VTokenError] = InvalidArgumentError, *about: object) -> list:
    """``list(value)`` for an iterable that is neither a string, bytes, nor a mapping.

    ``what`` names the argument in the refusal; with ``about`` it is a format string of them (``"request {!r}:
    moves"``), formatted only when refusing: a hot path's call builds no message."""
    if value.__class__ in _PLAIN_SEQUENCES:  # the hot paths' case: no ABC checks (each costs ~0.3 us)
        return list(value)
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise error(f"{what.format(*about) if about else what} must be a sequence, got {value!r}")
    try:
        return list(value)
    except TypeError:  # an __iter__ that is not one
        raise error(f"{what.format(*about) if about else what} must be a sequence, got {value!r}") from None


def check_mapping(what: str, value: object, error: type[VTokenError] = InvalidArgumentError) -> Mapping:
    """``value`` if it is a mapping (``None`` is the caller's business)."""
    if not isinstance(value, Mapping):
        raise error(f"{what} must be a mapping, got {value!r}")
    return value


def check_token_ids(what: str, ids: object, total_len: int,
                    error: type[VTokenError] = InvalidArgumentError) -> list[int]:
    """Distinct int token ids in ``[0, total_len)`` as a list (one pass, then C-speed min/max/set)."""
    out = as_list(what, ids, error)
    for t in out:
        if t.__class__ is not int and not is_int(t):
            raise error(f"{what}: token id {t!r} is not an int")
    if out:
        lo, hi = min(out), max(out)
        if lo < 0 or hi >= total_len:
            bad = lo if lo < 0 else hi
            raise error(f"{what}: token {bad} outside the synced tokens [0, {total_len})")
        if len(set(out)) != len(out):
            seen: set[int] = set()
            dup = next(t for t in out if t in seen or seen.add(t))  # type: ignore[func-returns-value]
            raise error(f"{what}: token {dup} appears twice")
    return out


# the rows taken as they are; False and True as an array('d') holds them; the largest int a float holds
_ROWS, _FLOAT_MAX = frozenset((list, tuple, array)), sys.float_info.max
_FALSE, _TRUE = bytes(8), array("d", [1.0]).tobytes()


def _first_bool(weights: Sequence, raw: bytes) -> int | None:
    """The index of the first bool in ``weights``, whose ``array('d')`` bytes are ``raw``.

    NOTE: array('d') takes True and False as 1.0 and 0.0, but a bool is no weight. Only a weight whose 8 bytes read
    1.0 or 0.0 can be one, so C-speed searches of the bytes find the candidates and Python looks at those alone:
    a row with no exact 0.0 or 1.0 costs two scans, and one with k of them k lookups, never a loop over the row."""
    first, looked = None, 0
    for pattern in (_FALSE, _TRUE):
        at = raw.find(pattern)
        while at != -1 and (first is None or at // 8 < first):
            looked += 1
            if looked > 64:  # many exact zeros or ones: one plain pass is cheaper than a search per candidate
                return next((i for i, w in enumerate(weights) if w.__class__ is bool), None)
            if at % 8 == 0 and weights[at // 8].__class__ is bool:
                first = at // 8
                break
            at = raw.find(pattern, (at // 8 + 1) * 8)  # the next weight's start: a match straddling two is no weight
    return first


def check_weights(what: str, weights: object, n: int | None = None,
                  error: type[VTokenError] = InvalidArgumentError) -> array:
    """An attention row as ``array('d')``: ``n`` (if given) finite, non-negative real weights, none a bool.

    A refusal names the weight and its index."""
    if weights.__class__ not in _ROWS:  # a list, tuple or array (the hot path) skips the ABC checks (~0.5 us)
        if isinstance(weights, (str, bytes, bytearray, Mapping)) or not isinstance(weights, Iterable) \
                or str(getattr(weights, "dtype", "")) in ("bool", "torch.bool"):  # (a numpy or torch mask)
            raise error(f"{what}: weights must be a sequence of numbers, got {weights!r:.80}")
        weights = list(weights)  # an iterator is read twice at most: into the array, and for a refusal
    try:
        row = array("d", weights)
    except (TypeError, ValueError, OverflowError):
        row = None
    if row is None:  # one of them is not a number, or an int beyond a float
        for i, w in enumerate(weights):
            if w.__class__ is bool or not isinstance(w, (int, float)) or isinstance(w, int) and abs(w) > _FLOAT_MAX:
                raise error(f"{what}: weight {w!r} at index {i} is not a number")
    elif weights.__class__ is not array and (i := _first_bool(weights, row.tobytes())) is not None:
        raise error(f"{what}: weight {weights[i]!r} at index {i} is not a number")
    if n is not None and len(row) != n:
        raise error(f"{what}: {len(row)} weights for {n} tokens")
    if row and not (math.isfinite(sum(row)) and min(row) >= 0.0):  # C loops; NaN and inf poison the sum
        i = next((i for i, w in enumerate(row) if not math.isfinite(w) or w < 0.0), None)
        if i is not None:  # (None: finite weights whose sum overflowed, which are fine)
            raise error(f"{what}: weight {row[i]!r} at index {i} is not a finite non-negative number")
    return row


def check_callable(what: str, value: object, error: type[VTokenError] = ConfigError) -> Any:
    if not callable(value):
        raise error(f"{what} must be callable, got {value!r}")
    return value


__all__ = ["is_int", "check_int", "check_number", "check_request_id", "is_known_key", "check_enum",
           "as_list", "check_mapping", "check_token_ids", "check_weights", "check_callable"]
