"""``TorchCopyEngine``: the core's ``CopyEngine`` over real K/V tensors, on CPU or CUDA.

A copy of n moves is, per storage group (usually one per dtype), one gather of the n source tokens
(every layer, K and V) into a temporary and one scatter into the destinations. The gather completes
before the scatter starts, so the copy is out of place: a move whose destination is another move's
source still reads the old value.

CUDA: the copy runs on a dedicated relocation stream, which first waits for the work already issued
on the compute stream (the forward that wrote the sources), and records an event. ``poll`` queries the
event; ``order_before_compute`` marks the copy ORDERED and ``before_compute`` (the pre-attention hook)
makes the compute stream wait on the event: GPU-side, the host never blocks on the normal path.
``wait`` (the force-sync ablation) synchronizes the event. CPU: the same calls; copies finish inside
``submit`` and are reported DONE at the first ``poll``.

Strict verify (``Verifier``): source digests are taken from the gathered values, destination digests
when the copy is first seen complete (``poll``, ``wait`` or ``before_compute``). A mismatch found
before the copy is released (the plan is not committed yet) makes the copy FAILED under
``quarantine``, so the manager aborts the plan and the sources stay authoritative; found after (an
ORDERED copy the manager already committed), the request is quarantined. Under ``raise`` both raise
``RelocationMismatch``. A copy that fails to launch is FAILED and wrote nothing. A copy never fails
after it is ORDERED except by a digest mismatch: the manager committed it and never polls it again.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Sequence

import torch

from vtoken.core.copy_engine import CopyHandle, CopyRegistry, CopyStatus
from vtoken.core.errors import DestinationError
from vtoken.core.token_table import Move

from .kv_cache import PagedKVCache
from .verify import Digests, Verifier


@dataclass
class _Copy:
    moves: tuple[Move, ...]
    req_id: object
    dst_slots: torch.Tensor
    status: CopyStatus = CopyStatus.PENDING
    event: object = None  # torch.cuda.Event on CUDA
    src_digests: Digests | None = None  # set iff this copy is verified
    released: bool = False
    keep: list = field(default_factory=list)  # tensors the relocation stream still reads


def warm_pinned_memory(largest: int = 1 << 20, per_size: int = 4) -> None:
    """Fill torch's pinned-host cache with ``per_size`` blocks of every power-of-two size up to ``largest``
    bytes. ``submit`` stages its slot lists through pinned memory; a block the cache lacks is allocated
    with cudaHostAlloc, which waits for the whole device, so without this the first copies of each size
    would block the host behind the running forward (seen on an H200: a submit waited out a 0.1 s kernel)."""
    size, held = 1, []
    while size <= largest:
        held += [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(per_size)]
        size *= 2
    del held  # back to the cache, which keeps them for reuse


class TorchCopyEngine(CopyRegistry):
    def __init__(self, cache: PagedKVCache, verifier: Verifier | None = None) -> None:
        super().__init__()
        self.cache = cache
        self.verifier = verifier or Verifier(cache)
        self.cuda = cache.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=cache.device) if self.cuda else None
        if self.cuda:
            warm_pinned_memory()
            self._warm_kernels()
        self.launches = 0  # gather + scatter kernels issued (2 per storage group per copy)
        self.store = None  # a TensorTagStore when the core's checkers run over this engine (tests, fuzzer)

    # ---- CopyEngine ----------------------------------------------------------------------------
    def submit(self, moves: Sequence[Move], req_id: object = None) -> CopyHandle:
        moves = tuple(m if isinstance(m, Move) else Move(*m) for m in moves)
        S, n_slots = self.cache.block_size, self.cache.num_blocks * self.cache.block_size
        m = torch.tensor(moves, dtype=torch.int64).view(-1, 5)
        src, dst = m[:, 1] * S + m[:, 2], m[:, 3] * S + m[:, 4]
        bad = (src < 0) | (src >= n_slots) | (dst < 0) | (dst >= n_slots) | (m[:, 2] < 0) | (m[:, 2] >= S) \
            | (m[:, 4] < 0) | (m[:, 4] >= S)
        if bool(bad.any()):
            raise DestinationError(f"move {moves[int(bad.nonzero()[0])]} of request {req_id!r} names a slot outside "
                                   f"the KV cache ({self.cache.num_blocks} blocks of {S})")
        if dst.unique().numel() != dst.numel():
            raise DestinationError(f"request {req_id!r}: two moves of one copy write the same slot")
        c = _Copy(moves, req_id, dst)
        h = self._add(c)
        verify = self.verifier.select()
        try:
            self._launch(c, src, verify)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            # nothing was scattered (the gather comes first) or the scatter raised before writing
            c.status = CopyStatus.FAILED
            c.keep = [repr(e)]
        return h

    def poll(self, handle: CopyHandle) -> CopyStatus:
        c = self._get(handle)
        if c.status in (CopyStatus.PENDING, CopyStatus.ORDERED) and (c.event is None or c.event.query()):
            self._complete(c)
        return c.status

    def wait(self, handle: CopyHandle) -> CopyStatus:
        c = self._get(handle)
        if c.status in (CopyStatus.PENDING, CopyStatus.ORDERED):
            if c.event is not None:
                c.event.synchronize()
            self._complete(c)
        return c.status

    def before_compute(self) -> None:
        """Pre-attention hook: the compute stream waits for every ORDERED copy; finished ones are verified."""
        for h, c in list(self._copies.items()):
            if c.status is not CopyStatus.ORDERED:
                continue
            if c.event is not None:
                torch.cuda.current_stream(self.cache.device).wait_event(c.event)
                if not c.event.query():
                    continue
            self._complete(c)
            if c.released:
                del self._copies[h]

    # ---- helpers ---------------------------------------------------------------------------------
    def _warm_kernels(self) -> None:
        """Launch every kernel a copy and its verification use once, now, before serving. CUDA loads a
        kernel's module at its first launch (lazy loading, the default) and that load waits for the whole
        device: the first submit would block the host behind the running forward (268 ms on an H200)."""
        slot = torch.zeros(1, dtype=torch.int64).pin_memory().to(self.cache.device)
        with torch.cuda.stream(self.stream):
            values = self.cache.gather(slot)
            self.cache.scatter(slot, values)  # slot 0 onto itself: changes nothing
            digests = self.verifier.source_digests(values)
            [d.cpu() for d in digests.per_group]
            event = torch.cuda.Event()
            event.record(self.stream)
        torch.cuda.current_stream(self.cache.device).wait_event(event)
        event.query()
        self.stream.synchronize()

    def _launch(self, c: _Copy, src: torch.Tensor, verify: bool) -> None:
        if not self.cuda:
            values = self.cache.gather(src)
            if verify:
                c.src_digests = self.verifier.source_digests(values)
            self.cache.scatter(c.dst_slots, values)
            self.launches += 2 * len(values)
            return  # finished; reported (and verified) at the first poll, wait or before_compute
        dev = self.cache.device
        self.stream.wait_stream(torch.cuda.current_stream(dev))  # the forward that wrote the sources
        with torch.cuda.stream(self.stream):
            src_d = src.pin_memory().to(dev, non_blocking=True)
            c.dst_slots = c.dst_slots.pin_memory().to(dev, non_blocking=True)
            values = self.cache.gather(src_d)
            if verify:
                c.src_digests = self.verifier.source_digests(values)
            self.cache.scatter(c.dst_slots, values)
            c.event = torch.cuda.Event()
            c.event.record(self.stream)
        c.keep = [src_d, *values]
        self.launches += 2 * len(values)

    def _complete(self, c: _Copy) -> None:
        """The copy is known complete: verify it if selected, then DONE (or FAILED under quarantine)."""
        was_ordered_and_committed = c.released
        c.keep = []
        if c.src_digests is not None:
            src, c.src_digests = c.src_digests, None
            # digested AND read back on the relocation stream: the read-back must follow the digest kernels
            # (read on the compute stream, it raced them and reported false mismatches, seen on an H200)
            with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
                dst = self.verifier.destination_digests(c.dst_slots)
                evidence = self.verifier.compare(c.req_id, c.moves, src, dst)
            if evidence is not None and not was_ordered_and_committed:
                c.status = CopyStatus.FAILED
                return
        c.status = CopyStatus.DONE
