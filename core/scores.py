"""Per-token attention statistics that score-based policies read.

The runtime feeds one attention row per decode step (the newest query's
weights over the tokens it read); policies only ever read the results.
  accumulated(t): sum of t's attention over all steps (H2O's heavy-hitter score);
  persistence(t): a decayed count of steps in which t received at least the
                  mean attention (Scissorhands' persistence of importance; the
                  decay 1 - 1/window makes it a soft history window).
Stored as two ``array('f')`` per request: 8 bytes per token.
"""

from __future__ import annotations

from array import array
from typing import Sequence

from .errors import ConfigError, TokenOutOfRangeError, UnknownRequestError


class TokenScores:
    def __init__(self, window: int = 32) -> None:
        if window < 1:
            raise ConfigError(f"score window must be >= 1, got {window}")
        self.decay = 1.0 - 1.0 / window
        self._acc: dict[object, array] = {}
        self._persist: dict[object, array] = {}

    def add_request(self, req_id: object) -> None:
        self._acc[req_id] = array("f")
        self._persist[req_id] = array("f")

    def remove_request(self, req_id: object) -> None:
        self._acc.pop(req_id, None)
        self._persist.pop(req_id, None)

    def extend(self, req_id: object, total_len: int) -> None:
        acc, per = self._get(req_id)
        grow = total_len - len(acc)
        if grow > 0:
            acc.frombytes(bytes(4 * grow))
            per.frombytes(bytes(4 * grow))

    def record(self, req_id: object, token_ids: Sequence[int], weights: Sequence[float]) -> None:
        acc, per = self._get(req_id)
        if len(token_ids) != len(weights):
            raise ConfigError(f"request {req_id!r}: {len(token_ids)} tokens but {len(weights)} weights")
        if not token_ids:
            return
        for t in token_ids:  # validate the whole row before changing anything
            if not 0 <= t < len(acc):
                raise TokenOutOfRangeError(f"request {req_id!r}: score for unknown token {t}")
        mean = 1.0 / len(token_ids)
        d = self.decay
        for t, w in zip(token_ids, weights):
            acc[t] += w
            per[t] = per[t] * d + (1.0 if w >= mean else 0.0)

    def save(self, req_id: object, token_ids: Sequence[int]) -> list[tuple[float, float]]:
        """The (accumulated, persistence) of ``token_ids``, for ``restore`` if what follows a ``record`` fails."""
        acc, per = self._get(req_id)
        return [(acc[t], per[t]) for t in token_ids]

    def restore(self, req_id: object, token_ids: Sequence[int], saved: list[tuple[float, float]]) -> None:
        acc, per = self._get(req_id)
        assert len(saved) == len(token_ids), "restore needs what save returned for the same tokens"
        for t, (a, p) in zip(token_ids, saved):
            acc[t], per[t] = a, p

    def accumulated(self, req_id: object, token_id: int) -> float:
        return self._get(req_id)[0][token_id]

    def persistence(self, req_id: object, token_id: int) -> float:
        return self._get(req_id)[1][token_id]

    def _get(self, req_id: object) -> tuple[array, array]:
        try:
            return self._acc[req_id], self._persist[req_id]
        except KeyError:
            raise UnknownRequestError(f"no scores for request {req_id!r}") from None
