"""Token statistics where attention is computed: the score policies' statistics as tensors, and their ranking.

The core's ``TokenScores`` (``array('f')`` per statistic and request, fed host-side rows) is the reference;
``DeviceScores`` keeps the statistics a policy reads per request as float32 tensors aligned with the worker's copy
of the request's read list (token ids in logical order), and updates them with the same arithmetic:

  accumulated(t)  <- float32(float64(accumulated(t)) + w_t)
  persistence(t)  <- float32(float64(persistence(t)) * decay + (1 if w_t >= 1/n else 0))
  latest(t)       <- float32(w_t)
  key_norm(t)     <- float32(norm), set once per token from its key in the KV cache (``set_keys``)
  observed(t)     <- float32(vote), set once per prompt from its observation window (``set_values``)

with w the row in float64 and n its length. Each step is two separate float64 operations rounded once to
float32, as the core's ``acc[t] += w`` and ``per[t] * d + ...`` are in Python (no fused multiply-add), so the
values are bit for bit the core's. ``rank`` then picks a ``Ranking`` (``core/policies/base.py``) from them: the
``count`` smallest candidates by the ranking's keys, then by id, which is exactly what the policy's
``select_victims`` returns over the same scores (oracle: ``tests/test_device_scores.py``; inside vLLM, strict
verify compares the two every step, V4).

Aligned with the read list, the scores follow relocations for free: a move changes a token's slot, not its
place in the list. What changes the list changes the scores alongside: evicted tokens' entries are masked out,
joined tokens get zeros (as ``TokenScores.extend`` gives them), a list resent whole is matched by token id.
"""

from __future__ import annotations

import math

import torch
from torch.nn.utils.rnn import pad_sequence

from vtoken.core.checks import check_int
from vtoken.core.errors import ConfigError, InvalidArgumentError, UnknownRequestError
from vtoken.core.policies.base import Ranking
from vtoken.core.scores import TokenScores

# two keys: each score's float32 bits (31 bits: scores are finite and >= 0), the first key most significant
_KEY_BITS = 31
_SCORES = ("accumulated", "persistence", "latest", "key_norm", "observed")


class DeviceScores:
    def __init__(self, window: int = 32, statistics: tuple[str, ...] = ("accumulated", "persistence")) -> None:
        self.decay = TokenScores(window).decay  # the core's decay for the same window, computed the same way
        unknown = [n for n in statistics if n not in _SCORES] if isinstance(statistics, (tuple, list)) else None
        if unknown or not statistics:
            raise ConfigError(f"device scores: statistics must be a non-empty tuple of {_SCORES}, got {statistics!r}"
                              + (f" (unknown: {unknown})" if unknown else ""))
        # NOTE: only the statistics the policy reads: name -> request -> float32 tensor aligned with its read list
        self._s: dict[str, dict[str, torch.Tensor]] = {n: {} for n in _SCORES if n in statistics}

    @property
    def statistics(self) -> tuple[str, ...]:
        return tuple(self._s)

    def drop(self, rid: str) -> None:
        for values in self._s.values():
            values.pop(rid, None)

    def values(self, rid: str, name: str | None = None):
        """One statistic (``name``) of the request, aligned with its read list; without a name, (accumulated,
        persistence)."""
        if name is None:
            return self._s["accumulated"][rid], self._s["persistence"][rid]
        return self._s[name][rid]

    def _first(self) -> dict[str, torch.Tensor]:
        return next(iter(self._s.values()))

    def _known(self, rid: str) -> None:
        if rid not in self._first():
            raise UnknownRequestError(f"request {rid!r} has no device scores (realign registers its read list)")

    # ---- what changes the read list changes the scores ------------------------------------------------
    def realign(self, rid: str, old_ids: torch.Tensor | None, new_ids: torch.Tensor) -> None:
        """The read list was replaced by ``new_ids``: each token keeps its scores, matched by id in the list it
        replaces (``old_ids``, the ids the scores are aligned with; None for none); a token new to the list starts
        at zero. O(L log L) in torch."""
        fresh = {n: torch.zeros(len(new_ids), dtype=torch.float32, device=new_ids.device) for n in self._s}
        if old_ids is not None and len(old_ids) and len(new_ids) and rid in self._first():
            n_old = len(self._first()[rid])
            if n_old != len(old_ids):
                raise InvalidArgumentError(f"request {rid!r}: old_ids name {len(old_ids)} tokens, but its scores are "
                                           f"aligned with a read list of {n_old}")
            order = torch.argsort(old_ids)
            sorted_ids = old_ids[order]
            at = torch.searchsorted(sorted_ids, new_ids).clamp_(max=len(old_ids) - 1)
            found = sorted_ids[at] == new_ids
            src = order[at[found]]
            for n, values in fresh.items():
                values[found] = self._s[n][rid][src]
        for n, values in fresh.items():
            self._s[n][rid] = values

    def keep(self, rid: str, keep: torch.Tensor) -> None:
        """Evictions: the read list kept the entries where ``keep`` (bool, aligned) is set."""
        self._known(rid)
        if keep.dtype != torch.bool or keep.shape != self._first()[rid].shape:
            raise InvalidArgumentError(f"request {rid!r}: keep must be a bool mask of shape "
                                       f"{tuple(self._first()[rid].shape)}, got {keep.dtype} {tuple(keep.shape)}")
        for values in self._s.values():
            values[rid] = values[rid][keep]

    def extend(self, rid: str, n: int) -> None:
        """``n`` tokens joined the end of the read list, with no attention yet."""
        self._known(rid)
        check_int(f"request {rid!r}: joined tokens", n, 0)
        for values in self._s.values():
            values[rid] = torch.cat((values[rid], torch.zeros(n, dtype=torch.float32, device=values[rid].device)))

    # ---- a step's attention and keys, and the victims they rank -----------------------------------------
    def record(self, rid: str, row: torch.Tensor) -> None:
        """One attention row (float64, aligned with the read list), as ``TokenScores.record`` takes it."""
        self.record_all([rid], row.unsqueeze(0), [len(row)])

    def record_all(self, rids: list[str], rows: torch.Tensor, lengths: list[int]) -> None:
        """One step's rows of several requests at once, bit for bit what ``record`` one by one gives: ``rows``
        float64 ``[R, N]``, request i's row its first ``lengths[i]`` entries (aligned with its read list), the rest
        padding. A few operations over the padded batch, then a view per request: the per-request work is two
        slices, not the arithmetic."""
        if rows.dim() != 2 or rows.shape[0] != len(rids) or len(lengths) != len(rids) \
                or max(lengths, default=0) > rows.shape[1]:
            raise InvalidArgumentError(f"attention rows of shape {tuple(rows.shape)} for {len(rids)} requests "
                                       f"of up to {max(lengths, default=0)} tokens")
        first = self._first()
        for rid, n in zip(rids, lengths):
            self._known(rid)
            if len(first[rid]) != n:
                raise InvalidArgumentError(f"request {rid!r}: an attention row of {n} tokens for "
                                           f"{len(first[rid])} scored tokens")
        width = max(lengths, default=0)
        if not width:
            return
        rows = rows[:, :width]
        new = {}
        if "accumulated" in self._s:
            acc = pad_sequence([self._s["accumulated"][r] for r in rids], batch_first=True)
            new["accumulated"] = acc.to(torch.float64).add_(rows).to(torch.float32)
        if "persistence" in self._s:
            per = pad_sequence([self._s["persistence"][r] for r in rids], batch_first=True)
            # each row's mean as TokenScores._apply computes it (1 / n in float64; a padded entry is never kept)
            above = rows >= 1.0 / torch.tensor(lengths, dtype=torch.float64, device=rows.device).unsqueeze(1)
            new["persistence"] = per.to(torch.float64).mul_(self.decay).add_(above).to(torch.float32)
        if "latest" in self._s:
            new["latest"] = rows.to(torch.float32)
        for name, batch in new.items():
            values = self._s[name]
            for i, (rid, n) in enumerate(zip(rids, lengths)):
                values[rid] = batch[i, :n]

    def set_keys(self, rid: str, at: torch.Tensor, norms: torch.Tensor) -> None:
        """Key norms (float64) of the read list's entries ``at``, as ``TokenScores.record_keys`` takes them."""
        self.set_values("key_norm", rid, at, norms)

    def set_values(self, name: str, rid: str, at: torch.Tensor, given: torch.Tensor) -> None:
        """A statistic set per token (``key_norm``, ``observed``; float64 in) at the read list's entries ``at``, as
        ``TokenScores`` records them (rounded once to float32); nothing unless the policy reads it. Refused, as
        ``TokenScores`` refuses it, unless every value is finite and >= 0 and every entry in the read list
        (``InvalidArgumentError`` naming the request, the statistic and the value or entry).

        NOTE: the bounds are read on the host (a sync on an accelerator). A decode step's one value per request is
        checked in Python (about a microsecond), more in one torch reduction each (several microseconds, then O(n)
        at C speed)."""
        if name not in _SCORES:
            raise InvalidArgumentError(f"request {rid!r}: no statistic {name!r} (one of {_SCORES})")
        if given.dim() != 1 or at.shape != given.shape:
            raise InvalidArgumentError(f"request {rid!r}: {name} of shape {tuple(given.shape)} for entries of shape "
                                       f"{tuple(at.shape)}")
        if len(given) <= 16:
            ok = all(0.0 <= v < math.inf for v in given.tolist())  # NaN fails both comparisons
            entries = at.tolist()
            first, last = (min(entries), max(entries)) if entries else (0, -1)
        else:
            lo, hi = torch.aminmax(given)  # a NaN anywhere makes both NaN
            ok = float(lo) >= 0.0 and float(hi) < math.inf
            first, last = (int(x) for x in torch.aminmax(at))
        if not ok:
            i = int(torch.nonzero(~((given >= 0.0) & (given < math.inf)))[0])
            raise InvalidArgumentError(f"request {rid!r}: {name} {float(given[i])!r} at entry {i} is not a finite "
                                       f"non-negative number")
        if name in self._s:
            self._known(rid)
            n = len(self._s[name][rid])
            if not (0 <= first and last < n):
                raise InvalidArgumentError(f"request {rid!r}: {name} at entries outside its read list of {n} tokens")
            values = self._s[name][rid].clone()
            values[at] = given.to(torch.float32)
            self._s[name][rid] = values

    def rank(self, rid: str, ids: torch.Tensor, ranking: Ranking, bound: int, protected: tuple[int, ...] = ()
             ) -> list[int]:
        """The victims ``ranking`` picks among the read list's tokens (``ids``, aligned with the scores): those
        below ``bound`` (``Ranking.bound``) and not ``protected``, the ``ranking.count`` smallest by the keys
        then by id, in that order. O(L) for one victim, O(L log L) for several, in torch; only the victims
        reach the host.

        NOTE: ``ids`` ascend (a read list is in logical order: a full list is, evictions keep the order, joined
        tokens are newer than every other, moves change slots only), so the candidates are a prefix of the list,
        already in id order, and a stable order on the keys breaks ties by id."""
        if ranking.count <= 0:
            return []
        keys = ranking.keys
        names = [k.removeprefix("-") for k in keys]
        if not 1 <= len(keys) <= 2 or any(n not in self._s for n in names) \
                or (len(keys) == 2 and any(k.startswith("-") for k in keys)):
            raise InvalidArgumentError(f"request {rid!r}: cannot rank by {keys!r} (one of {self.statistics}, "
                                       f"largest first after '-', or two of them, smallest first)")
        self._known(rid)
        if len(keys) == 1:  # the score itself: float order is the core's (-0.0 == 0.0 included; -x is exact)
            key = self._s[names[0]][rid]
            if keys[0].startswith("-"):
                key = -key
        else:  # both scores' float32 bits in one int64 (+ 0.0 turns -0.0 into +0.0, whose bits order as it does)
            first, second = (self._s[n][rid] + 0.0 for n in names)
            key = (first.view(torch.int32).to(torch.int64) << _KEY_BITS) | second.view(torch.int32).to(torch.int64)
        k = int(torch.searchsorted(ids, torch.tensor(bound, dtype=ids.dtype, device=ids.device)))
        c_ids, c_key = ids[:k], key[:k]
        if protected:
            keep = ~torch.isin(c_ids, torch.tensor(protected, dtype=ids.dtype, device=ids.device))
            c_ids, c_key = c_ids[keep], c_key[keep]
        if not len(c_ids):
            return []
        if ranking.count == 1:  # argmin returns the first of equal minima: the oldest
            return [int(c_ids[torch.argmin(c_key)])]
        return c_ids[torch.sort(c_key, stable=True).indices[: ranking.count]].tolist()
