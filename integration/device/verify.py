"""Strict verify: after a relocation, every moved token's K and V, in every layer, equal what its source
held before the copy. Digests are computed where the tensors live; only digests reach the host.

Digest of one token's elements x_1..x_m in one plane ("layer.K"), each element's bits read as an
unsigned integer (< 2^32; 8-byte dtypes as two 32-bit words):

    d = (sum_i w_i * x_i) mod P,   P = 4294967311 (the least prime above 2^32),
    w_i drawn uniformly from [1, 2^31) by a seeded generator, per engine.

Exact for single-element changes: x -> x' changes d by w_i (x' - x) mod P, and P is a prime larger than
|x' - x| and w_i, so that is never 0. For any fixed change of several elements made without knowing the
weights, a collision needs one weight to hit one residue: probability <= 1 / (2^31 - 1) per compared
digest. The sum is computed in int64 without overflow for planes of up to 2^16 words (``digest``).
"""

from __future__ import annotations

import bisect
import enum
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vtoken.core.checks import check_enum, check_int
from vtoken.core.errors import ConfigError, VTokenError
from vtoken.core.token_table import Move

from .kv_cache import Group, PagedKVCache

PRIME = 4294967311
_WORD = {1: (torch.int8, 0xFF), 2: (torch.int16, 0xFFFF), 4: (torch.int32, 0xFFFFFFFF), 8: (torch.int32, 0xFFFFFFFF)}


class VerifyMode(enum.Enum):
    OFF = "off"
    SAMPLED = "sampled"  # 1 in ``sample_every`` relocations, chosen by a seeded generator
    STRICT = "strict"  # every relocation


class OnMismatch(enum.Enum):
    RAISE = "raise"  # stop: raise RelocationMismatch
    QUARANTINE = "quarantine"  # fail that request, keep serving the others, write the evidence to a file


@dataclass(frozen=True)
class VerifyConfig:
    mode: VerifyMode = VerifyMode.OFF
    sample_every: int = 16
    on_mismatch: OnMismatch = OnMismatch.RAISE
    evidence_dir: str = "vtoken-evidence"
    seed: int = 0

    def __post_init__(self) -> None:
        # a member or its value ("strict"), stored as the member (frozen: through object.__setattr__)
        for name, cls in (("mode", VerifyMode), ("on_mismatch", OnMismatch)):
            object.__setattr__(self, name, check_enum(f"strict_verify {name}", getattr(self, name), cls))
        check_int("strict_verify sample_every", self.sample_every, 1, error=ConfigError)  # a bool is no count


class RelocationMismatch(VTokenError):
    """A relocated token's K/V at its destination differs from what its source held."""

    def __init__(self, message: str, evidence: dict) -> None:
        super().__init__(message)
        self.evidence = evidence


@dataclass
class VerifyCounters:
    relocations: int = 0  # relocations (copies) seen
    verified: int = 0  # relocations whose digests were compared
    mismatches: int = 0  # relocations with at least one differing digest
    bytes_hashed: int = 0
    seconds: float = 0.0


@dataclass
class Digests:
    """Source digests of one copy, per group ``[n_moves, n_planes]`` (on the device)."""

    per_group: list[torch.Tensor] = field(default_factory=list)


class Verifier:
    def __init__(self, cache: PagedKVCache, config: VerifyConfig | None = None, rank: int | None = None) -> None:
        self.cache = cache
        self.config = config or VerifyConfig()
        self.counters = VerifyCounters()
        self.quarantined: dict[object, Path] = {}  # request -> its evidence file
        self.rank = rank  # a sharded cache's rank (tensor parallelism): named in every mismatch, None when unsharded
        self._rng = random.Random(self.config.seed)
        gen = torch.Generator().manual_seed(self.config.seed)
        self._weights, self._segment_ids, self._equal_planes = [], [], []
        for g in cache.groups:
            words = g.elems * (2 if g.flat.element_size() == 8 else 1)
            self._weights.append(torch.randint(1, 2 ** 31, (words,), generator=gen).to(cache.device))
            per_word = words // g.elems
            seg = torch.empty(words, dtype=torch.int64)
            for i, (a, b) in enumerate(g.segments):
                seg[a * per_word:b * per_word] = i
            self._segment_ids.append(seg.to(cache.device))
            sizes = {b - a for a, b in g.segments}
            self._equal_planes.append(len(sizes) == 1)
            if max(sizes) * per_word > 2 ** 16:
                raise ConfigError(f"strict verify: plane of {max(sizes) * per_word} words exceeds 2^16")

    @property
    def digest_weights(self) -> list[torch.Tensor]:
        """The digest's w_i per group, one per word of a token (read-only: a fused digest elsewhere, e.g.
        ``triton_relocate``, must use these very draws to give these very numbers)."""
        return list(self._weights)

    def select(self) -> bool:
        """Whether the next relocation is verified (counts it)."""
        self.counters.relocations += 1
        mode = self.config.mode
        if mode is VerifyMode.SAMPLED:
            return self._rng.randrange(self.config.sample_every) == 0
        return mode is VerifyMode.STRICT

    # ---- digests -------------------------------------------------------------------------------
    def digest(self, gi: int, values: torch.Tensor) -> torch.Tensor:
        """``[n, n_planes]`` digests of group ``gi``'s token values ``[n, E]`` (on their device).

        sum_i w_i x_i is summed as sum_i w_i lo_i + 2^16 sum_i w_i hi_i (x = 2^16 hi + lo): each term is
        below 2^47, so a plane of up to 2^16 words sums without overflow and without a per-element mod.
        """
        started = time.perf_counter()
        if values.device.type == "cpu" and values.shape[0] > 1:  # chunks whose int64 temporaries stay in cache
            step = max(1, (1 << 16) // max(1, values.shape[1]))
            out = torch.cat([self._digest(gi, values[i:i + step]) for i in range(0, values.shape[0], step)])
        else:
            out = self._digest(gi, values)
        self.counters.bytes_hashed += values.numel() * values.element_size()
        self.counters.seconds += time.perf_counter() - started  # launch time on CUDA, compute time on CPU
        return out

    def _digest(self, gi: int, values: torch.Tensor) -> torch.Tensor:
        int_dtype, mask = _WORD[values.element_size()]
        x = values.contiguous().view(int_dtype).to(torch.int64) & mask
        w = self._weights[gi]
        lo, hi = self._plane_sums((x & 0xFFFF) * w, gi), self._plane_sums((x >> 16) * w, gi)
        return (lo % PRIME + ((hi % PRIME) << 16)) % PRIME

    def _plane_sums(self, terms: torch.Tensor, gi: int) -> torch.Tensor:
        g = self.cache.groups[gi]
        if self._equal_planes[gi]:  # NOTE: the plane width, not -1: a view of no tokens cannot infer it
            return terms.view(terms.shape[0], len(g.segments), terms.shape[1] // len(g.segments)).sum(-1)
        out = torch.zeros(terms.shape[0], len(g.segments), dtype=torch.int64, device=terms.device)
        return out.index_add_(1, self._segment_ids[gi], terms)

    def source_digests(self, values: list[torch.Tensor]) -> Digests:
        return Digests([self.digest(i, v) for i, v in enumerate(values)])

    def destination_digests(self, dst_slots: torch.Tensor) -> Digests:
        return self.source_digests(self.cache.gather(dst_slots))

    # ---- the check -------------------------------------------------------------------------------
    def compare_batch(self, copies: list[tuple[object, tuple[Move, ...], int]], src: Digests,
                      dst: Digests) -> list[dict | None]:
        """Several copies' digests at once, ``copies``: (request, moves, the first move's row), rows ascending and
        contiguous. One device -> host read per group for all of them (8 bytes per token and plane); per copy,
        None or its evidence, recorded and acted on (``on_mismatch``) copy by copy."""
        started = time.perf_counter()
        S = self.cache.block_size
        starts = [row for _, _, row in copies]
        found: list[list[dict]] = [[] for _ in copies]
        for gi, (a, b) in enumerate(zip(src.per_group, dst.per_group)):
            a_h, b_h = a.cpu(), b.cpu()
            for j, p in torch.nonzero(a_h != b_h).tolist():
                k = bisect.bisect_right(starts, j) - 1
                m = copies[k][1][j - starts[k]]
                found[k].append({"token": m.token_id, "plane": self.cache.groups[gi].names[p],
                                 "src_slot": m.src_block * S + m.src_offset,
                                 "dst_slot": m.dst_block * S + m.dst_offset,
                                 "src_digest": int(a_h[j, p]), "dst_digest": int(b_h[j, p])})
        self.counters.verified += len(copies)
        self.counters.seconds += time.perf_counter() - started
        return [self._mismatch(req_id, moves, bad) if bad else None for (req_id, moves, _), bad in zip(copies, found)]

    def _mismatch(self, req_id: object, moves: tuple[Move, ...], bad: list[dict]) -> dict:
        self.counters.mismatches += 1
        evidence = {"request": repr(req_id), "rank": self.rank, "mismatches": bad,
                    "plan": [list(m) for m in moves], "block_size": self.cache.block_size,
                    "seed": self.config.seed, "prime": PRIME}
        first = bad[0]
        on = "" if self.rank is None else f" on rank {self.rank}"
        msg = (f"relocation of request {req_id!r}{on}: {len(bad)} digest mismatch(es); first: token {first['token']}, "
               f"{first['plane']}, slot {first['src_slot']} -> {first['dst_slot']}; tokens "
               f"{sorted({b['token'] for b in bad})}")
        if self.config.on_mismatch is OnMismatch.RAISE:
            raise RelocationMismatch(msg, evidence)
        path = Path(self.config.evidence_dir)
        path.mkdir(parents=True, exist_ok=True)
        f = path / (f"mismatch-{self.counters.mismatches:04d}.json" if self.rank is None
                    else f"mismatch-rank{self.rank}-{self.counters.mismatches:04d}.json")
        f.write_text(json.dumps(evidence, indent=1))
        self.quarantined[req_id] = f
        return evidence
