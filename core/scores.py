"""Per-token attention statistics that score-based policies read.

The runtime feeds one attention row per decode step (the newest query's
weights over the tokens it read); policies only ever read the results.
  accumulated(t): sum of t's attention over all steps (H2O's heavy-hitter score);
  persistence(t): a decayed count of steps in which t received at least the
                  mean attention (Scissorhands' persistence of importance; the
                  decay 1 - 1/window makes it a soft history window).
Stored as two ``array('f')`` per request: 8 bytes per token.

A row is checked whole before any score changes: distinct int token ids of the
request, as many finite, non-negative weights.
"""

from __future__ import annotations

from array import array
from typing import Sequence

from .checks import as_list, check_int, check_request_id, check_token_ids, check_weights, is_int
from .errors import (ConfigError, DuplicateRequestError, InvalidArgumentError, TokenOutOfRangeError,
                     UnknownRequestError)

_INT = {int}


class TokenScores:
    def __init__(self, window: int = 32) -> None:
        if not is_int(window) or window < 1:
            raise ConfigError(f"score window must be >= 1, got {window!r}")
        self.decay = 1.0 - 1.0 / window
        self._acc: dict[object, array] = {}
        self._persist: dict[object, array] = {}

    def add_request(self, req_id: object) -> None:
        check_request_id(req_id)
        if req_id in self._acc:
            raise DuplicateRequestError(f"request {req_id!r} already has scores")
        self._acc[req_id] = array("f")
        self._persist[req_id] = array("f")

    def remove_request(self, req_id: object) -> None:
        """Forget a request's scores (removing an unknown request is harmless)."""
        try:
            self._acc.pop(req_id, None)
            self._persist.pop(req_id, None)
        except TypeError:  # unhashable: never registered
            pass

    def __contains__(self, req_id: object) -> bool:
        try:
            return req_id.__class__ is not bool and req_id in self._acc
        except TypeError:
            return False

    def extend(self, req_id: object, total_len: int) -> None:
        """Zero scores for tokens up to ``total_len``; never shrinks (a shorter length changes nothing)."""
        acc, per = self._get(req_id)
        check_int(f"request {req_id!r}: total_len", total_len, 0, error=TokenOutOfRangeError)
        grow = total_len - len(acc)
        if grow > 0:
            acc.frombytes(bytes(4 * grow))
            per.frombytes(bytes(4 * grow))

    def check_row(self, req_id: object, token_ids: Sequence[int], weights: Sequence[float]
                  ) -> tuple[list[int], array]:
        """The row as ``record`` takes it, validated whole; raises without changing anything.

        Raises UnknownRequestError, TokenOutOfRangeError (an id outside the scored tokens) or
        InvalidArgumentError (ids not distinct ints, weights not as many finite non-negative numbers).
        """
        acc, _ = self._get(req_id)
        what = f"request {req_id!r}: attention row"
        ids = as_list(what, token_ids)
        # plain ints inside [0, len(acc)), checked in C; anything else is found (and named) by the loop below
        plain = not ids or set(map(type, ids)) == _INT and min(ids) >= 0 and max(ids) < len(acc)
        for t in () if plain else ids:  # one pass, before any score changes
            if t.__class__ is not int and not is_int(t) or not 0 <= t < len(acc):
                if is_int(t):
                    raise TokenOutOfRangeError(f"request {req_id!r}: score for unknown token {t} "
                                               f"(scored tokens [0, {len(acc)}))")
                raise InvalidArgumentError(f"{what}: token id {t!r} is not an int")
        if len(set(ids)) != len(ids):
            seen: set[int] = set()
            dup = next(t for t in ids if t in seen or seen.add(t))  # type: ignore[func-returns-value]
            raise InvalidArgumentError(f"{what}: token {dup} appears twice")
        row = check_weights(what, weights)
        if len(ids) != len(row):
            raise InvalidArgumentError(f"request {req_id!r}: {len(ids)} tokens but {len(row)} weights")
        return ids, row

    def record(self, req_id: object, token_ids: Sequence[int], weights: Sequence[float]) -> None:
        ids, row = self.check_row(req_id, token_ids, weights)
        self._apply(req_id, ids, row)

    def _apply(self, req_id: object, ids: list[int], row: Sequence[float]) -> None:
        """Record a row ``check_row`` returned."""
        if not ids:
            return
        acc, per = self._acc[req_id], self._persist[req_id]
        mean = 1.0 / len(ids)
        d = self.decay
        for t, w in zip(ids, row):
            acc[t] += w
            per[t] = per[t] * d + (1.0 if w >= mean else 0.0)

    def save(self, req_id: object, token_ids: Sequence[int]) -> list[tuple[float, float]]:
        """The (accumulated, persistence) of ``token_ids``, for ``restore`` if what follows a ``record`` fails."""
        acc, per = self._get(req_id)
        ids = check_token_ids(f"request {req_id!r}: saved tokens", token_ids, len(acc))
        return [(acc[t], per[t]) for t in ids]

    def restore(self, req_id: object, token_ids: Sequence[int], saved: list[tuple[float, float]]) -> None:
        acc, per = self._get(req_id)
        ids = check_token_ids(f"request {req_id!r}: restored tokens", token_ids, len(acc))
        if not isinstance(saved, list) or len(saved) != len(ids):
            raise InvalidArgumentError(f"request {req_id!r}: restore needs what save returned for the same "
                                       f"{len(ids)} tokens, got {saved!r:.80}")
        for t, (a, p) in zip(ids, saved):
            acc[t], per[t] = a, p

    def _save(self, req_id: object, ids: list[int]) -> tuple[int, array, array]:
        """``save`` for ids ``check_row`` validated: both arrays over the ids' span, copied whole (a memcpy:
        cheaper than reading each saved score into a Python float)."""
        acc, per = self._acc[req_id], self._persist[req_id]
        if not ids:
            return 0, array("f"), array("f")
        lo, hi = min(ids), max(ids) + 1
        return lo, acc[lo:hi], per[lo:hi]

    def _restore(self, req_id: object, ids: list[int], saved: tuple[int, array, array]) -> None:
        acc, per = self._acc[req_id], self._persist[req_id]
        lo, a, p = saved
        acc[lo:lo + len(a)] = a
        per[lo:lo + len(p)] = p

    def accumulated(self, req_id: object, token_id: int) -> float:
        acc = self._get(req_id)[0]
        self._check_token(req_id, token_id, len(acc))
        return acc[token_id]

    def persistence(self, req_id: object, token_id: int) -> float:
        per = self._get(req_id)[1]
        self._check_token(req_id, token_id, len(per))
        return per[token_id]

    def readers(self, req_id: object):
        """(accumulated, persistence) as two one-argument functions of a token id, for a policy's view.

        Unchecked on purpose: a policy sorts every candidate by them. They index the request's arrays
        directly, so an id outside ``[0, total_len)`` raises IndexError (the runtime reports a policy
        that does so as a ``PolicyError``).
        """
        acc, per = self._get(req_id)
        return acc.__getitem__, per.__getitem__

    @staticmethod
    def _check_token(req_id: object, token_id: int, n: int) -> None:
        if token_id.__class__ is not int and not is_int(token_id) or not 0 <= token_id < n:
            raise TokenOutOfRangeError(f"request {req_id!r}: no score for token {token_id!r} "
                                       f"(scored tokens [0, {n}))")

    def _get(self, req_id: object) -> tuple[array, array]:
        try:
            if req_id.__class__ is bool:
                raise KeyError(req_id)
            return self._acc[req_id], self._persist[req_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"no scores for request {req_id!r}") from None
