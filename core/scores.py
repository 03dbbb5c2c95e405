"""Per-token attention statistics that score-based policies read.

The runtime feeds one attention row per decode step (the newest query's
weights over the tokens it read); policies only ever read the results.
  accumulated(t): sum of t's attention over all steps (H2O's heavy-hitter score);
  persistence(t): a decayed count of steps in which t received at least the
                  mean attention (Scissorhands' persistence of importance; the
                  decay 1 - 1/window makes it a soft history window).
Stored as two ``array('f')`` per request: 8 bytes per token.

Two more statistics are kept only for a policy that reads them (its
``statistics``; 4 bytes per token each):
  latest(t):      t's weight in the newest row that included it (TOVA);
  key_norm(t):    the L2 norm of t's key (mean over heads and scored layers),
                  recorded once, where the key is written (Knorm): a key
                  statistic, never an attention score.
  observed(t):    the attention t got from the prompt's last queries (its
                  observation window), averaged over them and the heads, then
                  pooled over neighbouring tokens: recorded once, at the step
                  the prompt completes (SnapKV).

A row (or a batch of key norms) is checked whole before any score changes:
distinct int token ids of the request, as many finite, non-negative values.
"""

from __future__ import annotations

from array import array
from typing import Sequence

from .checks import as_list, check_int, check_request_id, check_token_ids, check_weights, is_int
from .errors import (ConfigError, DuplicateRequestError, InvalidArgumentError, TokenOutOfRangeError,
                     UnknownRequestError)

_INT = {int}
ROW_STATISTICS = ("accumulated", "persistence", "latest")  # what each step's attention rows feed
WINDOW_STATISTICS = ("observed",)  # what a prompt's observation window feeds, once, at its end
KEY_STATISTICS = ("key_norm",)  # what the keys feed, once per token
STATISTICS = ROW_STATISTICS + WINDOW_STATISTICS + KEY_STATISTICS
OPTIONAL = ("latest", "key_norm", "observed")  # kept only when a policy reads them


def check_statistics(what: str, names: object, error: type = ConfigError) -> tuple[str, ...]:
    """``names`` as a tuple of distinct statistic names (``STATISTICS``), else ``error`` naming the bad one."""
    out = as_list(what, names, error)
    for n in out:
        if n not in STATISTICS:
            raise error(f"{what}: unknown statistic {n!r} (known: {list(STATISTICS)})")
    if len(set(out)) != len(out):
        raise error(f"{what}: a statistic is named twice: {out}")
    return tuple(out)


def _unrecorded(name: str):
    def read(token_id: int) -> float:
        raise InvalidArgumentError(f"statistic {name!r} is not recorded: only a policy that lists it in its "
                                   f"statistics gets it")
    return read


_UNRECORDED = {n: _unrecorded(n) for n in OPTIONAL}  # built once: a view asks for them at every decision
_NONE_RECORDED = tuple(_UNRECORDED[n] for n in OPTIONAL)


def _set(values: array, ids: list[int], row: Sequence[float]) -> None:
    """A statistic that each new value replaces (latest, key_norm, observed): float32, rounded once."""
    for t, v in zip(ids, row):
        values[t] = v


class TokenScores:
    def __init__(self, window: int = 32, statistics: Sequence[str] = ()) -> None:
        if not is_int(window) or window < 1:
            raise ConfigError(f"score window must be >= 1, got {window!r}")
        self.decay = 1.0 - 1.0 / window
        self._acc: dict[object, array] = {}
        self._persist: dict[object, array] = {}
        # NOTE: the optional statistics exist only when asked for: a policy that does not read them pays no
        # memory and no time for them (H2O's per-step cost is as it was)
        wanted = check_statistics("statistics", statistics)
        self._extra: dict[str, dict[object, array]] = {n: {} for n in OPTIONAL if n in wanted}
        self._latest = self._extra.get("latest")
        self._key = self._extra.get("key_norm")
        self._observed = self._extra.get("observed")

    @property
    def recorded(self) -> tuple[str, ...]:
        """The statistics kept: accumulated and persistence always, the optional ones asked for."""
        return ("accumulated", "persistence", *self._extra)

    def add_request(self, req_id: object) -> None:
        check_request_id(req_id)
        if req_id in self._acc:
            raise DuplicateRequestError(f"request {req_id!r} already has scores")
        self._acc[req_id] = array("f")
        self._persist[req_id] = array("f")
        for arrays in self._extra.values():
            arrays[req_id] = array("f")

    def remove_request(self, req_id: object) -> None:
        """Forget a request's scores (removing an unknown request is harmless)."""
        try:
            self._acc.pop(req_id, None)
            self._persist.pop(req_id, None)
            for arrays in self._extra.values():
                arrays.pop(req_id, None)
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
            for arrays in self._extra.values():
                arrays[req_id].frombytes(bytes(4 * grow))

    def check_row(self, req_id: object, token_ids: Sequence[int], weights: Sequence[float]
                  ) -> tuple[list[int], array]:
        """The row as ``record`` takes it, validated whole; raises without changing anything.

        Raises UnknownRequestError, TokenOutOfRangeError (an id outside the scored tokens) or
        InvalidArgumentError (ids not distinct ints, weights not as many finite non-negative numbers).
        """
        return self._check_values(req_id, token_ids, weights, "attention row")

    def check_keys(self, req_id: object, token_ids: Sequence[int], norms: Sequence[float]
                   ) -> tuple[list[int], array]:
        """Key norms as ``record_keys`` takes them, validated whole like a row (``check_row``)."""
        return self._check_values(req_id, token_ids, norms, "key norms")

    def check_observed(self, req_id: object, token_ids: Sequence[int], values: Sequence[float]
                       ) -> tuple[list[int], array]:
        """An observation window's votes as ``record_observed`` takes them, validated whole like a row."""
        return self._check_values(req_id, token_ids, values, "observation")

    def _check_values(self, req_id: object, token_ids: Sequence[int], weights: Sequence[float], kind: str
                      ) -> tuple[list[int], array]:
        acc, _ = self._get(req_id)
        what = f"request {req_id!r}: {kind}"
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
            unit = {"attention row": "weights", "key norms": "norms"}.get(kind, "values")
            raise InvalidArgumentError(f"request {req_id!r}: {len(ids)} tokens but {len(row)} {unit}")
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
        if self._latest is not None:
            _set(self._latest[req_id], ids, row)

    def record_keys(self, req_id: object, token_ids: Sequence[int], norms: Sequence[float]) -> None:
        """Key norms of the request's tokens, as the keys are written (a later norm of a token replaces it)."""
        ids, row = self.check_keys(req_id, token_ids, norms)
        self._apply_keys(req_id, ids, row)

    def _apply_keys(self, req_id: object, ids: list[int], row: Sequence[float]) -> None:
        """Record key norms ``check_keys`` returned (nothing unless a policy reads them)."""
        if self._key is not None:
            _set(self._key[req_id], ids, row)

    def record_observed(self, req_id: object, token_ids: Sequence[int], values: Sequence[float]) -> None:
        """A prompt's observation-window votes over the tokens it read (a later observation replaces them)."""
        ids, row = self.check_observed(req_id, token_ids, values)
        self._apply_observed(req_id, ids, row)

    def _apply_observed(self, req_id: object, ids: list[int], row: Sequence[float]) -> None:
        """Record votes ``check_observed`` returned (nothing unless a policy reads them)."""
        if self._observed is not None:
            _set(self._observed[req_id], ids, row)

    def copy_keys(self, req_id: object, source: object, n: int) -> None:
        """The key norms of ``source``'s first ``n`` tokens become ``req_id``'s (a shared prefix: the same keys)."""
        if self._key is not None:
            self._key[req_id][:n] = self._key[source][:n]

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

    def _save(self, req_id: object, ids: list[int]) -> tuple[int, list[array]]:
        """``save`` for ids ``check_row`` or ``check_keys`` validated: every array over the ids' span, copied whole
        (a memcpy: cheaper than reading each saved score into a Python float)."""
        arrays = self._arrays(req_id)
        if not ids:
            return 0, []
        lo, hi = min(ids), max(ids) + 1
        return lo, [a[lo:hi] for a in arrays]

    def _restore(self, req_id: object, ids: list[int], saved: tuple[int, list[array]]) -> None:
        lo, copies = saved
        for a, c in zip(self._arrays(req_id), copies):
            a[lo:lo + len(c)] = c

    def _arrays(self, req_id: object) -> list[array]:
        return [self._acc[req_id], self._persist[req_id], *(arrays[req_id] for arrays in self._extra.values())]

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

    def latest(self, req_id: object, token_id: int) -> float:
        return self._optional("latest", req_id, token_id)

    def key_norm(self, req_id: object, token_id: int) -> float:
        return self._optional("key_norm", req_id, token_id)

    def observed(self, req_id: object, token_id: int) -> float:
        return self._optional("observed", req_id, token_id)

    def _optional(self, name: str, req_id: object, token_id: int) -> float:
        values = self._get(req_id)[0]
        self._check_token(req_id, token_id, len(values))
        if name not in self._extra:
            _UNRECORDED[name](token_id)
        return self._extra[name][req_id][token_id]

    def optional_readers(self, req_id: object) -> tuple:
        """The readers of the optional statistics, in ``OPTIONAL``'s order (latest, key_norm, observed), for a view
        of a request ``readers`` already found: the recorded ones index its arrays, the others raise (``reader``).
        O(1), and nothing built per call for a policy that records none (the view is built at every decision)."""
        if not self._extra:
            return _NONE_RECORDED
        return tuple(self._extra[n][req_id].__getitem__ if n in self._extra else _UNRECORDED[n] for n in OPTIONAL)

    def reader(self, req_id: object, name: str):
        """One statistic of the request as a one-argument function of a token id, unchecked like ``readers``;
        a statistic not recorded reads as an error naming it (``InvalidArgumentError``)."""
        acc, per = self._get(req_id)
        if name == "accumulated":
            return acc.__getitem__
        if name == "persistence":
            return per.__getitem__
        if name in self._extra:
            return self._extra[name][req_id].__getitem__
        if name in _UNRECORDED:
            return _UNRECORDED[name]
        check_statistics("statistic", [name], InvalidArgumentError)  # raises, naming the unknown statistic
        raise AssertionError(name)

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
