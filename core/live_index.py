"""One request's live logical token ids in ascending order, kept as an order-statistics index.

The token table's slot array says, per logical id, whether the token is live (``slot != NO_SLOT``); what
the hot path needs from it is *ranks*: the k-th live token (StreamingLLM's first evictable token, a
uniform draw of Random), and the live tokens from rank k on. Scanning the slot array for them costs
O(L) per request per step. This index answers them in O(log L + CHUNK):

  counts[c]   live tokens among ids [c * CHUNK, (c + 1) * CHUNK), 2 bytes per chunk;
  tree        a Fenwick tree over ``counts`` (1-based; tree[i] sums counts (i - lowbit(i), i]),
              4 bytes per chunk: prefix sums, and the chunk holding rank k, in O(log L).

About 0.1 bytes per token. Updated by the token table in O(log L) per appended chunk and per eviction
(``append``, ``remove``); nothing else changes liveness (moves change slots, not liveness).

NOTE: the oracle is ``reference.views.check_live_index``: it recounts both arrays from the slot array from
scratch (``check_all``'s V1, run by the fuzzer after every rule and the simulator after every step).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain, islice
from typing import Iterator

CHUNK = 64  # logical ids per chunk: a chunk is scanned in full at most once per lookup
NO_SLOT = -1


class LiveIndex:
    __slots__ = ("counts", "tree")

    def __init__(self) -> None:
        self.counts = array("H")
        self.tree = array("i", [0])

    # ---- updates (the token table's; it validated the tokens) ---------------------------------
    def append(self, first: int, n: int) -> None:
        """Tokens ``first .. first + n - 1`` were appended, all live (``first`` is the synced length before)."""
        assert n >= 0 and first >= 0 and -(-first // CHUNK) == len(self.counts), "appends must extend the index"
        end = first + n
        if first % CHUNK and n:  # the partly filled last chunk takes the first ones
            k = min(n, CHUNK - first % CHUNK)
            self.counts[first // CHUNK] += k
            self._add(first // CHUNK, k)
        c = len(self.counts)
        while c * CHUNK < end:
            self._push(min(CHUNK, end - c * CHUNK))
            c += 1
        assert len(self.counts) == -(-end // CHUNK)

    def remove(self, token_id: int) -> None:
        """Token ``token_id`` (live until now) was evicted."""
        c = token_id // CHUNK
        assert self.counts[c] > 0, f"evicting token {token_id} from chunk {c}, which counts no live token"
        self.counts[c] -= 1
        self._add(c, -1)

    def _add(self, c: int, delta: int) -> None:
        tree, i = self.tree, c + 1
        n = len(tree)
        while i < n:
            tree[i] += delta
            i += i & -i

    def _push(self, count: int) -> None:
        """Append a chunk holding ``count`` live tokens: its node sums counts (i - lowbit(i), i]."""
        i = len(self.tree)
        self.counts.append(count)
        self.tree.append(count + self._prefix(i - 1) - self._prefix(i - (i & -i)))

    # ---- queries ------------------------------------------------------------------------------
    def _prefix(self, chunks: int) -> int:
        """Live tokens in the first ``chunks`` chunks."""
        tree, s = self.tree, 0
        while chunks:
            s += tree[chunks]
            chunks &= chunks - 1
        return s

    def _chunk_of_rank(self, k: int) -> tuple[int, int]:
        """(chunk c, live tokens of chunk c before rank k) for the live token of rank ``k`` (0-based)."""
        tree, pos, step = self.tree, 0, 1 << (len(self.tree) - 1).bit_length()
        while step:
            nxt = pos + step
            if nxt < len(tree) and tree[nxt] <= k:
                pos, k = nxt, k - tree[nxt]
            step >>= 1
        return pos, k

    def ids_from(self, k: int, slots: array) -> Iterator[int]:
        """The live ids of rank k, k + 1, ..., ascending: O(log L) to start, O(CHUNK) per chunk read, and
        O(log L) to jump over a run of chunks with no live token (StreamingLLM's evicted middle). The ids of
        a chunk come as one range or list, chained in C: no generator step per id."""
        return chain.from_iterable(self._chunks_from(k, slots))

    def _chunks_from(self, k: int, slots: array) -> Iterator[Iterator[int]]:
        """``ids_from``, one iterator per chunk read."""
        total = self._prefix(len(self.counts))
        if k >= total:
            return
        c, skip = self._chunk_of_rank(k)
        counts, n = self.counts, len(slots)
        while k < total:
            live = counts[c]
            if not live:
                c, skip = self._chunk_of_rank(k)  # the chunk holding rank k, past the dead run
                continue
            lo, hi = c * CHUNK, min(n, (c + 1) * CHUNK)
            k += live - skip  # every live id of the chunk from the skip-th on is yielded below
            if live == hi - lo:  # every token of the chunk is live: no scan
                yield range(lo + skip, hi)
            else:
                ids = [t for t in range(lo, hi) if slots[t] != NO_SLOT]
                yield ids[skip:] if skip else ids
            skip = 0
            c += 1

    def select(self, k: int, slots: array) -> int:
        """The live id of rank ``k`` (< the live count): O(log L + CHUNK)."""
        c, skip = self._chunk_of_rank(k)
        lo, hi = c * CHUNK, min(len(slots), (c + 1) * CHUNK)
        if self.counts[c] == hi - lo:
            return lo + skip
        for t in range(lo, hi):
            if slots[t] != NO_SLOT:
                if not skip:
                    return t
                skip -= 1
        raise AssertionError(f"live rank {k}: chunk {c} counts {self.counts[c]} live tokens, the slots fewer")


class LiveTokens(Sequence):
    """Ranks [start, stop) of one request's live ids as a read-only sequence, with nothing copied.

    ``len`` is O(1), ``[i]`` O(log L), a slice is another view, iteration O(what is read + CHUNK). Equal
    to any sequence holding the same ids in the same order. Valid until the table next changes."""

    __slots__ = ("_index", "_slots", "_start", "_stop")

    def __init__(self, index: LiveIndex, slots: array, start: int, stop: int) -> None:
        self._index, self._slots, self._start, self._stop = index, slots, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, i):
        if i.__class__ is slice:
            a, b, step = i.indices(len(self))
            if step != 1:
                return list(self)[i]
            return LiveTokens(self._index, self._slots, self._start + a, self._start + max(a, b))
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"live rank {i} outside [0, {len(self)})")
        return self._index.select(self._start + i, self._slots)

    def __iter__(self) -> Iterator[int]:
        return islice(self._index.ids_from(self._start, self._slots), len(self))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == len(self) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"LiveTokens({list(islice(self, 8))}{'...' if len(self) > 8 else ''}, {len(self)} ids)"
