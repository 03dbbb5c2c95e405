"""``TensorTagStore``: the core's ``TagStore`` interface over a real ``PagedKVCache``.

The simulator and the fuzzer check I1 by writing a content tag per token and reading the tags back
through the attention slots. Here a tag is written into every byte of the token's K and V in every
plane (byte j of plane p holds byte j mod 8 of the tag, xor a pattern of p and j), so any lost,
misdirected or torn copy, in any layer, dtype or layout, reads back as a different tag (``TORN``
when the planes disagree). Bytes, not values: NaN payloads and fp8 are copied bit for bit.
"""

from __future__ import annotations

import torch

from vtoken.core.checks import check_int
from vtoken.core.errors import BlockOutOfRangeError, InvalidArgumentError

from .kv_cache import PagedKVCache
from .kv_layout import LayoutError

TORN = -1  # planes of one slot hold different tags


class TensorTagStore:
    def __init__(self, cache: PagedKVCache) -> None:
        if not isinstance(cache, PagedKVCache):
            raise LayoutError(f"a tag store needs a PagedKVCache, got {type(cache).__name__}")
        self.cache = cache
        self.block_size = cache.block_size
        self._bytes = []  # per group: (uint8 view of the storage, itemsize)
        for g in cache.groups:
            self._bytes.append((g.flat.view(torch.uint8), g.flat.element_size()))
        self._pattern = []
        for gi, g in enumerate(cache.groups):
            k = g.flat.element_size()
            j = torch.arange(g.elems * k, dtype=torch.int64)
            self._pattern.append(((j * 131 + gi * 29 + 7) & 0xFF).to(cache.device))

    def _check_slot(self, slot: int) -> None:
        if slot.__class__ is not int or not 0 <= slot < self.cache.num_slots:
            check_int("slot", slot, 0, self.cache.num_slots - 1, error=BlockOutOfRangeError,
                      hint=f" ({self.cache.num_blocks} blocks of {self.block_size})")

    def _byte_index(self, gi: int, slot: int) -> torch.Tensor:
        g, (_, k) = self.cache.groups[gi], self._bytes[gi]
        elems = g.index(torch.tensor([slot], device=self.cache.device), self.block_size)[0]
        return (elems.unsqueeze(1) * k + torch.arange(k, device=self.cache.device)).flatten()

    def write(self, slot: int, tag: int) -> None:
        self._check_slot(slot)
        check_int("tag", tag, -(1 << 63), (1 << 63) - 1, error=InvalidArgumentError)
        for gi, (raw, _) in enumerate(self._bytes):
            idx = self._byte_index(gi, slot)
            shifts = (torch.arange(idx.numel(), device=idx.device) % 8) * 8
            tag_bytes = (torch.tensor(tag, dtype=torch.int64, device=idx.device) >> shifts) & 0xFF
            raw[idx] = (tag_bytes ^ self._pattern[gi]).to(torch.uint8)

    def read(self, slot: int) -> int:
        self._check_slot(slot)
        tags = set()
        for gi, (raw, _) in enumerate(self._bytes):
            b = raw[self._byte_index(gi, slot)].to(torch.int64) ^ self._pattern[gi]
            n = b.numel()
            if n < 8:
                return TORN
            words = b[: n - n % 8].view(-1, 8)
            if not bool((words == words[0]).all()):
                return TORN
            tags.add(sum(int(words[0, i]) << (8 * i) for i in range(8)))
        if len(tags) != 1:
            return TORN
        tag = tags.pop()
        return tag - (1 << 64) if tag >= 1 << 63 else tag

    def state(self) -> tuple:
        """Every byte of the cache (what a rejected call must leave unchanged)."""
        return tuple(tuple(raw.tolist()) for raw, _ in self._bytes)
