"""``TorchCopyEngine``: the core's ``CopyEngine`` over real K/V tensors, on CPU or CUDA.

A copy of n moves is, per storage group (usually one per dtype), one gather of the n source tokens
(every layer, K and V) into a temporary and one scatter into the destinations. The gather completes
before the scatter starts, so the copy is out of place: a move whose destination is another move's
source still reads the old value. ``submit_batch`` launches several copies (a step's, every request's)
the same way, as one wave: one gather, one scatter and one digest pass for all of them, split into a
further wave only where a copy reads a block an earlier copy of the batch writes.

CUDA: the copy runs on a dedicated relocation stream, which first waits for the work already issued
on the compute stream (the forward that wrote the sources), and records an event. ``poll`` queries the
event; ``order_before_compute`` marks the copy ORDERED and ``before_compute`` (the pre-attention hook)
makes the compute stream wait on the event: GPU-side, the host never blocks on the normal path.
``wait`` (the force-sync ablation) synchronizes the event. CPU: the same calls; copies finish inside
``submit`` and are reported DONE at the first ``poll``.

The same waves run in other hands where the engine is given them, torch's gather and scatter staying their
reference: on the CPU the compiled mover (``mover``), on a GPU the Triton kernels (``triton``: one launch per
element width and phase, the digests fused in).

Strict verify (``Verifier``): both digests are part of the copy's own work. Source digests are taken
from the gathered values; destination digests right after the scatter, on the relocation stream, before
the copy's event is recorded (on CPU: right after the scatter, inside ``submit``). They are compared
when the copy is first seen complete (``poll``, ``wait`` or ``before_compute``), by which time the event
covers the digest kernels. The destination digest must not wait for that moment: a later copy (ordered
after this one) or the next forward may legitimately rewrite the slot before the host looks, and a
digest taken then would report a false mismatch. So the check covers what the copy itself wrote (a
wrong index, a lost or torn write), not what later work does to the slot.

A mismatch found before the copy is released (the plan is not committed yet) makes the copy FAILED
under ``quarantine``, so the manager aborts the plan and the sources stay authoritative; found after (an
ORDERED copy the manager already committed), the request is quarantined. Under ``raise`` both raise
``RelocationMismatch``. A copy that fails to launch is FAILED and wrote nothing. A copy never fails
after it is ORDERED except by a digest mismatch: the manager committed it and never polls it again.
"""

from __future__ import annotations

from array import array
from contextlib import nullcontext
from itertools import chain
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from vtoken.core.copy_engine import CopyHandle, CopyRegistry, CopyStatus, check_moves
from vtoken.core.errors import InvariantViolation
from vtoken.core.token_table import Move

from .kv_cache import PagedKVCache
from .verify import Digests, Verifier, VerifyMode


def packed(moves: Sequence[Move]) -> array:
    """``moves`` as one ``array('q')`` of five fields per move: the packed moves' own array when they carry one
    (``fields``: the fast path's ``MoveArray``), no copy; else packed here."""
    fields = getattr(moves, "fields", None)
    if fields.__class__ is array and fields.typecode == "q":
        return fields
    return array("q", chain.from_iterable(moves))


def check_copies(copies: Sequence[tuple[object, object]], num_blocks: int, block_size: int) -> list[Sequence[Move]]:
    """``check_moves`` of each (moves, request) of a batch, in one pass of C-speed checks over all their fields (a
    step's copies are many copies of a few moves each). A batch that fails it (or in which two copies write one
    slot, which the wave's splitting allows) is checked copy by copy, so the culprit is named as ``check_moves``
    names it. Returns each copy's moves: packed moves as they are (their fields are int64 by construction),
    anything else as a tuple of ``Move``."""
    try:
        batches = [moves if hasattr(moves, "fields") or moves.__class__ is tuple and all(
                   m.__class__ is Move for m in moves) else tuple(m if type(m) is Move else Move(*m) for m in moves)
                   for moves, _ in copies]  # type: ignore[union-attr]
        flat = array("q")
        for moves in batches:
            flat.extend(packed(moves))
    except (TypeError, OverflowError):  # not moves, or a field that is no int64 (a float, a str): named below
        flat = None
    if flat is not None and not flat:
        return batches
    # NOTE: packing refuses a float or a str, not a bool (an int to array): the type pass catches it (exact ints only:
    # no bool, no int subclass); packed moves' fields are int64 by construction
    if flat is not None and set(map(type, chain.from_iterable(chain.from_iterable(
            m for m in batches if not hasattr(m, "fields"))))) <= {int}:
        tok, sb, so, db, do = (flat[i::5] for i in range(5))
        if (min(tok) >= 0 and min(sb) >= 0 and max(sb) < num_blocks and min(so) >= 0 and max(so) < block_size
                and min(db) >= 0 and max(db) < num_blocks and min(do) >= 0 and max(do) < block_size
                and len(set(zip(db, do))) == len(tok)):
            return batches
    return [check_moves(moves, num_blocks, block_size, req_id) for moves, req_id in copies]


def waves(batches: Sequence[Sequence[Move]]) -> Iterator[tuple[int, int, array]]:
    """A batch's copies (each one's moves, in order) as waves: (first copy, end, their packed moves), a new wave
    wherever a copy reads or writes a block an earlier copy of the wave writes (``submit_batch``'s NOTE)."""
    first, fields, written = 0, array("q"), set()
    for i, moves in enumerate(batches):
        f = packed(moves)
        if i > first and not (written.isdisjoint(f[1::5]) and written.isdisjoint(f[3::5])):
            yield first, i, fields
            first, fields, written = i, array("q"), set()
        fields.extend(f)
        written.update(f[3::5])
    if len(batches) > first:
        yield first, len(batches), fields


@dataclass
class _Copy:
    moves: tuple[Move, ...]
    req_id: object
    verify: bool = False  # chosen for verification (``Verifier.select``)
    status: CopyStatus = CopyStatus.PENDING
    event: object = None  # torch.cuda.Event on CUDA: its wave's
    wave: _Wave | None = None
    row: int | None = None  # verified: its first move's row in the wave's digests
    evidence: dict | None = None  # verified and compared: what differed (None: every digest matched)
    released: bool = False


@dataclass
class _Wave:
    """Copies launched together: one gather and one scatter per storage group for all their moves, copy after
    copy, and (the verified ones) one source and one destination digest pass, compared in one go."""
    copies: list[_Copy]
    moves: array  # every move's five fields, in the copies' order (``packed``)
    # every move's destination slot, in the copies' order; None where the compiled mover moved a wave nobody verifies
    dst_slots: torch.Tensor | None
    src_digests: Digests | None = None  # of the verified copies' moves, taken as part of the wave's work
    dst_digests: Digests | None = None
    compared: bool = False
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
    def __init__(self, cache: PagedKVCache, verifier: Verifier | None = None, mover=None, triton: bool = False
                 ) -> None:
        """Torch's gather and scatter move a wave's tokens unless one of these does, and stay the reference:

          * ``mover(moves)``: a compiled move of a wave's packed moves on the CPU (``fastpath.relocate.host_mover``);
            torch still reads the sources a verified copy's digests are taken from;
          * ``triton``: the Triton kernels (``triton_relocate.TritonRelocator``), every wave and its digests (the
            verifier's, fused into the copy) in one launch per element width. On a GPU; on the CPU only in
            Triton's interpreter (the tests'). It takes the place of ``mover``."""
        super().__init__()
        self.cache = cache
        self.verifier = verifier or Verifier(cache)
        self.relocator = None
        if triton:
            from .triton_relocate import TritonRelocator  # Triton is loaded only where it is asked for
            self.relocator = TritonRelocator(cache, self.verifier)
        self.mover = mover if cache.device.type == "cpu" and self.relocator is None else None
        self.cuda = cache.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=cache.device) if self.cuda else None
        if self.cuda:
            warm_pinned_memory()
            self._warm_kernels()
        self.launches = 0  # gather + scatter kernels issued (2 per storage group per copy)
        self.store = None  # a TensorTagStore when the core's checkers run over this engine (tests, fuzzer)

    # ---- CopyEngine ----------------------------------------------------------------------------
    def submit(self, moves: Sequence[Move], req_id: object = None) -> CopyHandle:
        return self.submit_batch([(moves, req_id)])[0]

    def submit_batch(self, copies: Sequence[tuple[Sequence[Move], object]]) -> list[CopyHandle]:
        """Submit several copies ((moves, request) each, in order) as few launches as their order allows: one
        wave of gathers and scatters for all of them unless a copy reads or writes a block an earlier copy of
        the wave writes (the same request's drill after its densify, say), which starts the next wave. A copy
        is FAILED on its own only by its digests; a wave that fails to launch fails every copy in it.

        NOTE: a wave gathers all its sources before it scatters, so it equals running its copies one by one
        exactly when no copy reads what an earlier one of the wave writes, and no two copies of it write one
        slot (a scatter with a repeated index keeps either value): both checked per block here, whatever the
        planners guarantee. ``check_moves`` refuses both within a copy."""
        # validated on the host, in Python, before any tensor is built or anything launched: torch.tensor
        # would round a float field to some other slot and read a bool as slot 0 or 1
        checked = check_copies(copies, self.cache.num_blocks, self.cache.block_size)
        handles = []
        for first, end, fields in waves(checked):
            wave = []
            for moves, (_, req_id) in zip(checked[first:end], copies[first:end]):
                c = _Copy(moves, req_id)
                handles.append(self._add(c))
                c.verify = self.verifier.select()
                wave.append(c)
            self._launch_wave(wave, fields)
        return handles

    def run_batch(self, copies: Sequence[tuple[Sequence[Move], object]]) -> list[CopyStatus]:
        """``submit_batch`` of ``copies``, then ``wait`` and ``release`` of each in order: a vLLM worker's step, whose
        copies all run before the step's inputs are prepared. Returns each copy's status.

        NOTE: on the CPU with the compiled mover and verification off, no copy needs a handle (nothing polls it
        later, no digest is compared): the same waves go to the same ``_launch`` as packed moves alone, and a wave
        that fails to launch fails its copies, as ``submit_batch`` has them."""
        if self.cuda or self.mover is None or self.verifier.config.mode is not VerifyMode.OFF:
            handles, statuses = self.submit_batch(copies), []
            for h in handles:
                statuses.append(self.wait(h))
                self.release(h)
            return statuses
        # the mover's compiled check and split where it can decide (``HostMover.waves``: packed moves), else ours
        split = getattr(self.mover, "waves", None)
        found = split(copies) if split is not None else None
        if found is None:
            found = waves(check_copies(copies, self.cache.num_blocks, self.cache.block_size))
        self.verifier.counters.relocations += len(copies)  # what ``select`` counts, selecting none
        statuses = []
        for first, end, fields in found:
            try:
                self._launch(_Wave([], fields, None), None, None)
                statuses += [CopyStatus.DONE] * (end - first)
            except RuntimeError:
                statuses += [CopyStatus.FAILED] * (end - first)
        return statuses

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
            if self.relocator is not None:  # Triton compiles a kernel at its first launch: seconds, not now
                self.relocator.relocate(torch.zeros(1, 2, dtype=torch.int64, device=self.cache.device), digests=True)
            values = self.cache.gather(slot)
            self.cache.scatter(slot, values)  # slot 0 onto itself: changes nothing
            digests = self.verifier.source_digests(values)
            [d.cpu() for d in digests.per_group]
            event = torch.cuda.Event()
            event.record(self.stream)
        torch.cuda.current_stream(self.cache.device).wait_event(event)
        event.query()
        self.stream.synchronize()

    def _launch_wave(self, copies: list[_Copy], fields: array) -> None:
        """``copies`` as one wave; ``fields``: their packed moves, in order (``waves``)."""
        S = self.cache.block_size
        if self.mover is not None and not any(c.verify for c in copies):
            src = dst = None  # NOTE: the mover reads the packed moves; torch reads slots only to verify
        else:
            m = torch.frombuffer(fields, dtype=torch.int64).view(-1, 5) if fields else \
                torch.empty((0, 5), dtype=torch.int64)
            src, dst = m[:, 1] * S + m[:, 2], m[:, 3] * S + m[:, 4]
        w = _Wave(copies, fields, dst)
        rows, n = [], 0  # the verified copies' moves, by their row in the wave
        for c in copies:
            c.wave = w
            if c.verify:
                c.row = len(rows)
                rows.extend(range(n, n + len(c.moves)))
            n += len(c.moves)
        try:
            self._launch(w, src, None if len(rows) == n else rows)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            # FAILED: the manager aborts the plans and never reads the destinations (the scatter, or the digest
            # after it, may have raised midway). On CUDA what was enqueued before the error may still run:
            # wait for it, so the destinations are not handed out while it can write them (I6)
            if self.cuda:
                try:
                    self.stream.synchronize()
                except RuntimeError:
                    pass  # a sticky device error: nothing on the stream runs any more
            for c in copies:
                c.status = CopyStatus.FAILED
            w.keep = [repr(e)]

    def _launch(self, w: _Wave, src: torch.Tensor, rows: list[int] | None) -> None:
        """One gather and one scatter per storage group; with verified copies, their digests (``rows``: the
        verified moves' rows, None for all)."""
        verify = any(c.verify for c in w.copies)
        if self.relocator is not None:
            self._relocate(w, src, verify, rows)
            return
        if not self.cuda:
            values = self.cache.gather(src) if verify or self.mover is None else None
            if self.mover is None:
                self.cache.scatter(w.dst_slots, values)
                self.launches += 2 * len(values)
            else:
                self.mover(w.moves)
                self.launches += len(self.cache.groups)
            if verify:
                self._digest(w, values, rows)
            return  # finished; reported (and compared) at the first poll, wait or before_compute
        dev = self.cache.device
        self.stream.wait_stream(torch.cuda.current_stream(dev))  # the forward that wrote the sources
        with torch.cuda.stream(self.stream):
            src_d = src.pin_memory().to(dev, non_blocking=True)
            w.dst_slots = w.dst_slots.pin_memory().to(dev, non_blocking=True)
            values = self.cache.gather(src_d)
            self.cache.scatter(w.dst_slots, values)
            if verify:
                self._digest(w, values, rows)  # stream-ordered after the scatter, before any later copy or forward
            event = torch.cuda.Event()
            event.record(self.stream)  # covers the digest kernels: complete means digested
        for c in w.copies:
            c.event = event
        w.keep = [src_d, *values]
        self.launches += 2 * len(values)

    def _relocate(self, w: _Wave, src: torch.Tensor, verify: bool, rows: list[int] | None) -> None:
        """``_launch`` in the Triton kernels: the wave's moves as one [n, 2] tensor of slots (all reads before all
        writes, as torch's gather and scatter), the digests of the verified moves (``rows``, None for all) fused."""
        moves = torch.stack((src, w.dst_slots), dim=1)
        before = self.relocator.launches
        if not self.cuda:
            digests = self.relocator.relocate(moves, digests=verify)
        else:
            dev = self.cache.device
            self.stream.wait_stream(torch.cuda.current_stream(dev))  # the forward that wrote the sources
            with torch.cuda.stream(self.stream):
                moves = moves.pin_memory().to(dev, non_blocking=True)
                digests = self.relocator.relocate(moves, digests=verify)
                event = torch.cuda.Event()
                event.record(self.stream)  # covers the digests: complete means digested
            for c in w.copies:
                c.event = event
            w.keep = [moves]
        self.launches += self.relocator.launches - before
        if verify:
            src_d, dst_d = digests
            if rows is not None:
                idx = torch.tensor(rows, dtype=torch.int64).to(moves.device, non_blocking=True)
                src_d, dst_d = (Digests([d[idx] for d in x.per_group]) for x in (src_d, dst_d))
            w.src_digests, w.dst_digests = src_d, dst_d

    def _digest(self, w: _Wave, values: list[torch.Tensor], rows: list[int] | None) -> None:
        """Both digests of the wave's verified moves, as part of its work (call right after its scatter, on the
        stream that ran it): the sources' from the gathered values, the destinations' from what the scatter
        left. One pass each for every verified copy of the wave."""
        dst = w.dst_slots
        if rows is not None:
            idx = torch.tensor(rows, dtype=torch.int64).to(dst.device, non_blocking=True)
            values, dst = [v[idx] for v in values], dst[idx]
        w.src_digests = self.verifier.source_digests(values)
        w.dst_digests = self.verifier.destination_digests(dst)

    def _complete(self, c: _Copy) -> None:
        """The copy is known complete (its wave's event, which follows the digests, has fired): compare the
        wave's digests if that has not happened yet, then DONE (or FAILED under quarantine)."""
        was_ordered_and_committed = c.released
        w = c.wave
        w.keep = []
        if c.verify:
            if not w.compared:
                self._compare(w)
            if c.evidence is not None and not was_ordered_and_committed:
                c.status = CopyStatus.FAILED
                return
        c.status = CopyStatus.DONE

    def _compare(self, w: _Wave) -> None:
        """Every verified copy of the wave against its digests, one device-to-host read per storage group: each
        copy gets its own evidence (a mismatch is attributed to its request), under ``raise`` the first raises."""
        w.compared = True
        src, dst, w.src_digests, w.dst_digests = w.src_digests, w.dst_digests, None, None
        verified = [c for c in w.copies if c.verify]
        if dst is None:
            raise InvariantViolation("I1", f"copies of request(s) {[c.req_id for c in verified][:4]} were selected "
                                     f"for verify but have no destination digests")
        # read back on the relocation stream, which computed them (the event has fired, so this waits for
        # nothing; it keeps the caching allocator's stream bookkeeping of the digests on one stream)
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            found = self.verifier.compare_batch([(c.req_id, c.moves, c.row) for c in verified], src, dst)
        for c, evidence in zip(verified, found):
            c.evidence = evidence
