"""Every layer's K/V tensors seen as one pool of slots (slot = block * block_size + offset).

Planes that live in the same storage with the same dtype form a ``Group``: one flat view of that
storage, and per in-block offset the element indices of all its planes, so moving n tokens across all
those layers is one gather and one scatter. Layers that share a backing buffer (the same elements) are
registered once; the duplicate's name is kept as an alias for error messages.

Every access takes slots as a 1-D integer tensor on the cache's device. On the CPU each call checks
them (``BlockOutOfRangeError`` names the first slot outside the cache: a negative one would otherwise
wrap around to the last block). On an accelerator that check would make the host wait for the device,
so instead a slot outside the cache is sent past the end of the storage: the access faults (a
device-side assertion) rather than reading or writing another block. ``check_slots`` is the host-side
check for callers that hold the slots on the CPU before uploading them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vtoken.core.errors import BlockOutOfRangeError, InvalidArgumentError

from .kv_layout import LayoutError, Plane

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Group:
    """Planes sharing one storage and dtype.

    ``offsets[o, e]`` is element e of the token at (block 0, offset o) in ``flat``; block b adds
    ``stride[e] * b``. Element range ``segments[i] = (start, end)`` belongs to ``names[i]`` ("layer.K").
    """

    flat: torch.Tensor
    offsets: torch.Tensor  # int64 [S, E]
    stride: torch.Tensor  # int64 [E]
    names: list[str] = field(default_factory=list)
    segments: list[tuple[int, int]] = field(default_factory=list)

    run: int = 1  # elements per contiguous, aligned run: moves index rows of ``run`` elements, not elements
    _strided: dict = field(default_factory=dict)  # (a, b) -> the range's strided view, or None (``strided``)

    @property
    def elems(self) -> int:
        return self.offsets.shape[1]

    def index(self, slots: torch.Tensor, block_size: int, a: int = 0, b: int | None = None) -> torch.Tensor:
        """Flat element indices ``[len(slots), b - a]`` of canonical elements [a, b) (default: all E) of the
        tokens at ``slots``."""
        return self.offsets[:, a:b][slots % block_size] + (slots // block_size).unsqueeze(1) * self.stride[a:b]

    def rows(self, slots: torch.Tensor, block_size: int) -> torch.Tensor:
        """Row indices ``[len(slots), E / run]`` into ``flat`` viewed as rows of ``run`` elements."""
        r = self.run
        return (self.offsets[:, ::r][slots % block_size] + (slots // block_size).unsqueeze(1) * self.stride[::r]) // r

    def strided(self, a: int, b: int) -> torch.Tensor | None:
        """Canonical elements [a, b) of every slot as a strided view ``[blocks, S, rows, cols]`` of ``flat``, if
        their layout is affine: element e of the token at (block n, offset o) at ``base + n * block_stride +
        o * token_stride + (e // cols) * row_stride + (e % cols) * col_stride`` (vLLM's layouts are: heads are
        the rows, head_dim the columns). None if no such factorisation holds. Computed once per range."""
        key = (a, b)
        if key not in self._strided:
            self._strided[key] = self._find_strided(a, b)
        return self._strided[key]

    def _find_strided(self, a: int, b: int) -> torch.Tensor | None:
        off, st = self.offsets[:, a:b], self.stride[a:b]
        S, E = off.shape
        if E == 0 or not bool((st == st[0]).all()):
            return None
        base, g = int(off[0, 0]), off[0] - off[0, 0]
        token = int(off[1, 0] - off[0, 0]) if S > 1 else 0
        if not torch.equal(off, off[0] + token * torch.arange(S).unsqueeze(1)):
            return None
        e = torch.arange(E)
        for cols in (d for d in range(E, 0, -1) if E % d == 0):
            col = int(g[1]) if cols > 1 else 0
            row = int(g[cols]) if cols < E else 0
            if torch.equal(g, (e // cols) * row + (e % cols) * col):
                if min(token, row, col) < 0 or int(st[0]) <= 0:
                    return None
                # as many blocks as the storage holds whole (the cache checks its slots; one past them faults)
                nb = (self.flat.numel() - base - (S - 1) * token - int(g.max()) - 1) // int(st[0]) + 1
                return self.flat.as_strided((nb, S, E // cols, cols), (int(st[0]), token, row, col),
                                            self.flat.storage_offset() + base)
        return None

    def token_views(self) -> list[torch.Tensor] | None:
        """Each segment's strided view (``strided``) as the storage's bits, in segment order, when moving tokens
        through them takes fewer indices than moving rows of ``run`` elements: two per token and segment
        instead of E / run. vLLM's CPU layout stores K dim-major, so its runs are one element long and a row
        move indexes every element of a token (about three times slower here, ``tests/bench/bench_kv_copy.py``).
        None when the row move is as good (a token-major layout) or a segment has no strided view."""
        if "tokens" not in self._strided:
            E, bounds = self.elems, sorted(self.segments)
            views = None
            if self.run * len(bounds) < E and [a for a, _ in bounds] == [0] + [b for _, b in bounds[:-1]] \
                    and bounds[-1][1] == E:
                found = [self.strided(a, b) for a, b in bounds]
                if all(v is not None for v in found):
                    views = [v.view(_BITS[self.flat.element_size()]) for v in found]
            self._strided["tokens"] = views
        return self._strided["tokens"]

    def row_view(self) -> torch.Tensor:
        """The storage's bits (an integer dtype of the same width: moves are bit-exact and work for every
        dtype, fp8 included) as rows of ``run`` elements."""
        n = self.flat.numel() - self.flat.numel() % self.run
        return self.flat[:n].view(_BITS[self.flat.element_size()]).view(-1, self.run)

    def find_run(self) -> None:
        """The longest run length r dividing E such that every r consecutive canonical elements of a token
        are r consecutive storage elements starting at a multiple of r (in every block)."""
        S, E = self.offsets.shape
        for r in sorted((d for d in range(1, E + 1) if E % d == 0), reverse=True):
            heads = self.offsets[:, ::r]
            if bool((self.stride % r == 0).all()) and bool((heads % r == 0).all()) and bool(
                    (self.offsets.view(S, E // r, r) == heads.unsqueeze(-1) + torch.arange(r)).all()):
                self.run = r
                return


class PagedKVCache:
    """The KV cache of a model: planes of every layer, grouped for batched token moves."""

    def __init__(self, planes: list[Plane]) -> None:
        if isinstance(planes, Plane) or not isinstance(planes, (list, tuple)):
            raise LayoutError(f"a KV cache takes a list of planes, got {type(planes).__name__}")
        planes = list(planes)
        if not planes:
            raise LayoutError("a KV cache needs at least one plane")
        bad = next((p for p in planes if not isinstance(p, Plane)), None)
        if bad is not None:
            raise LayoutError(f"a KV cache takes Planes (gpu_planes / cpu_plane), got {type(bad).__name__} {bad!r:.60}")
        S, nb = planes[0].block_size, planes[0].num_blocks
        for p in planes:
            if p.tensor.device != planes[0].tensor.device:
                raise LayoutError(f"layer {p.layer!r} is on {p.tensor.device}, layer {planes[0].layer!r} on "
                                  f"{planes[0].tensor.device}; a KV cache lives on one device")
            if p.block_size != S or p.num_blocks != nb:
                raise LayoutError(f"layer {p.layer!r}: {p.num_blocks} blocks of {p.block_size} slots, but layer "
                                  f"{planes[0].layer!r} has {nb} of {S}")
        self.block_size, self.num_blocks = S, nb
        self.device = planes[0].tensor.device
        self.aliases: dict[str, str] = {}  # layer -> the layer whose buffer it shares
        self._heads_views: dict[tuple, torch.Tensor | None] = {}  # (plane, head_dim) -> heads_view's answer
        self.planes: list[Plane] = []
        seen: dict[tuple, str] = {}
        for p in planes:
            key = (p.tensor.untyped_storage().data_ptr(), p.tensor.dtype, p.block_stride, p.parts,
                   tuple(p.offsets[0, :1].tolist()))
            if key in seen:
                self.aliases[p.layer] = seen[key]
                continue
            seen[key] = p.layer
            self.planes.append(p)
        self.groups = self._group(self.planes)
        self.bytes_per_token = sum(g.elems * g.flat.element_size() for g in self.groups)
        # a block index past the end of every group's storage, for the accelerator's out-of-range slots
        self._fault_slot = S * max(g.flat.numel() // max(1, int(g.stride.min())) + 1 for g in self.groups)
        self._guarded: tuple = (None, -1, None)  # (slots tensor, its version, its guarded copy): one per step

    # ---- slots ---------------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def check_slots(self, slots: torch.Tensor) -> None:
        """Raise unless ``slots`` is a 1-D integer tensor of slots inside the cache (a host-side check:
        on an accelerator it waits for the device)."""
        self._check_type(slots)
        if slots.numel():
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 0 or hi >= self.num_slots:
                bad = lo if lo < 0 else hi
                raise BlockOutOfRangeError(
                    f"slot {bad} (block {bad // self.block_size}, offset {bad % self.block_size}) outside the KV "
                    f"cache's {self.num_blocks} blocks of {self.block_size} slots")

    def _check_type(self, slots: object, what: str = "slots") -> None:
        if not isinstance(slots, torch.Tensor):
            raise InvalidArgumentError(f"{what} must be a 1-D integer tensor, got {type(slots).__name__} {slots!r:.60}")
        if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool or slots.dim() != 1:
            raise InvalidArgumentError(f"{what} must be a 1-D integer tensor, got {slots.dtype} of shape "
                                       f"{tuple(slots.shape)}")
        if slots.device != self.device:
            raise InvalidArgumentError(f"{what} are on {slots.device}, the KV cache on {self.device}")

    def _slots(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` checked (CPU) or guarded (accelerator) for one access (module docstring)."""
        if self.device.type == "cpu":
            self.check_slots(slots)
            return slots
        self._check_type(slots)
        last, version, guarded = self._guarded
        if last is slots and version == slots._version:  # the same slots, layer after layer
            return guarded
        guarded = self._guard(slots)
        self._guarded = (slots, slots._version, guarded)
        return guarded

    def _guard(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` with every slot outside the cache replaced by one whose elements lie past the end of
        every group's storage (so indexing with it faults instead of wrapping). No host synchronisation."""
        ok = (slots >= 0) & (slots < self.num_slots)
        return torch.where(ok, slots, torch.full_like(slots, self._fault_slot))

    @staticmethod
    def _group(planes: list[Plane]) -> list[Group]:
        by_storage: dict[tuple, list[Plane]] = {}
        for p in planes:
            by_storage.setdefault((p.tensor.untyped_storage().data_ptr(), p.tensor.dtype), []).append(p)
        groups = []
        for ps in by_storage.values():
            t = ps[0].tensor
            n = t.untyped_storage().nbytes() // t.element_size()
            flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (n,))
            g = Group(flat, torch.cat([p.offsets for p in ps], dim=1),
                      torch.cat([torch.full((p.elems,), p.block_stride, dtype=torch.int64) for p in ps]))
            start = 0
            for p in ps:
                per = p.elems // len(p.parts)
                for part in p.parts:
                    g.names.append(f"{p.layer}.{part}")
                    g.segments.append((start, start + per))
                    start += per
            probe = torch.arange(min(2, t.shape[0]) * ps[0].block_size)  # a sanity check on the first blocks
            if len(torch.unique(g.index(probe, ps[0].block_size))) != probe.numel() * g.elems:
                raise LayoutError(f"layers {[q.layer for q in ps]} overlap in one buffer without being the same "
                                  f"elements")
            g.find_run()
            g.offsets, g.stride = g.offsets.to(t.device), g.stride.to(t.device)
            groups.append(g)
        return groups

    def host_groups(self) -> list[tuple] | None:
        """Each group's storage as its bits, its ``offsets [S, E]`` and ``stride [E]``, as numpy arrays sharing the
        tensors' memory (a compiled mover's plain ABI: ``integration/fastpath/relocate.py``); None off the CPU."""
        if self.device.type != "cpu":
            return None
        return [(g.flat.view(_BITS[g.flat.element_size()]).numpy(), g.offsets.numpy(), g.stride.numpy())
                for g in self.groups]

    # ---- bulk access (one gather / one scatter per group) ----------------------------------------
    def gather(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """The tokens' bits at ``slots``, per group ``[len(slots), E]`` (an integer dtype as wide as the
        group's): a copy, so later writes cannot change it."""
        slots = self._slots(slots)
        n, S = slots.numel(), self.block_size
        out, at = [], None
        for g in self.groups:
            views = g.token_views()
            if views is None:
                out.append(g.row_view().index_select(0, g.rows(slots, S).flatten()).view(n, g.elems))
                continue
            at = at or (slots // S, slots % S)
            # NOTE: the segments tile [0, E) in order (token_views checks), so this is canonical order
            out.append(torch.cat([v[at].reshape(n, v.shape[2] * v.shape[3]) for v in views], 1))
        return out

    def scatter(self, slots: torch.Tensor, values: list[torch.Tensor]) -> None:
        """Write what ``gather`` returned for as many slots (per group ``[len(slots), E]``, the group's
        integer dtype) at ``slots``. Checked whole before anything is written."""
        slots = self._slots(slots)
        n = slots.numel()
        if not isinstance(values, (list, tuple)) or len(values) < len(self.groups):
            raise InvalidArgumentError(f"scatter needs one values tensor per group ({len(self.groups)}), got "
                                       f"{type(values).__name__} of {len(values) if isinstance(values, (list, tuple)) else '?'}")
        for i, (g, v) in enumerate(zip(self.groups, values)):
            want = _BITS[g.flat.element_size()]
            if not isinstance(v, torch.Tensor) or v.dtype != want or v.numel() != n * g.elems or v.device != self.device:
                raise InvalidArgumentError(
                    f"scatter: values of group {i} ({g.names[0]}...) must be {want} [{n}, {g.elems}] on {self.device}, "
                    f"got {v.dtype if isinstance(v, torch.Tensor) else type(v).__name__} "
                    f"{tuple(v.shape) if isinstance(v, torch.Tensor) else ''}")
        at = None
        for g, v in zip(self.groups, values):
            views = g.token_views()
            if views is None:
                g.row_view().index_copy_(0, g.rows(slots, self.block_size).flatten(), v.view(-1, g.run))
                continue
            at = at or (slots // self.block_size, slots % self.block_size)
            v, a = v.view(n, g.elems), 0
            for view in views:  # NOTE: the segments tile [0, E) in order (token_views checks)
                rows, cols = view.shape[2], view.shape[3]
                view[at] = v[:, a:a + rows * cols].reshape(n, rows, cols)
                a += rows * cols

    # ---- per-layer access for models, tests and the fuzzer ----------------------------------------
    def segment(self, name: str) -> tuple[Group, int, int]:
        """The plane ``name`` ("layer.K"; an alias resolved) as (its group, its element range [a, b) there), or a
        ``LayoutError`` naming the known planes."""
        if not isinstance(name, str):
            raise LayoutError(f"a plane name must be a string like 'layer.K', got {name!r}")
        layer, _, part = name.partition(".")
        name = f"{self.aliases.get(layer, layer)}.{part}"
        for g in self.groups:
            if name in g.names:
                return (g, *g.segments[g.names.index(name)])
        raise LayoutError(f"no plane {name!r}; known: {self.plane_names()}")

    def plane_names(self) -> list[str]:
        return [n for g in self.groups for n in g.names]

    def write(self, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values [len(slots), heads * head_dim]`` as plane ``name`` ("layer.K" / "layer.V")."""
        g, a, b = self.segment(name)
        slots = self._slots(slots)
        if not isinstance(values, torch.Tensor) or values.numel() != slots.numel() * (b - a) \
                or values.device != self.device:
            raise InvalidArgumentError(
                f"write {name!r}: values must be a [{slots.numel()}, {b - a}] tensor on {self.device}, got "
                f"{tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__}")
        g.flat[g.index(slots, self.block_size, a, b)] = values.reshape(slots.numel(), b - a).to(g.flat.dtype)

    def heads_view(self, name: str, head_dim: int) -> torch.Tensor | None:
        """Plane ``name`` as a strided view ``[blocks, S, heads, head_dim]`` of its storage (element d of head h of
        the token at (block n, offset o) at ``[n, o, h, d]``), if its layout is affine in head and element (every
        layout vLLM uses); else None. For kernels that read K/V in place (``gather_attention``), every layer of
        every step: computed once per (plane, head_dim)."""
        if not isinstance(name, str):
            self.segment(name)  # raises LayoutError, naming what it got
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
            return None
        key = (name, head_dim)
        if key not in self._heads_views:
            self._heads_views[key] = self._heads_view(name, head_dim)
        return self._heads_views[key]

    def _heads_view(self, name: str, head_dim: int) -> torch.Tensor | None:
        g, a, b = self.segment(name)
        view = g.strided(a, b)
        E = b - a
        if view is None or E % head_dim:
            return None
        _, S, rows, cols = view.shape
        s0, s1, s2, s3 = view.stride()
        e = torch.arange(E)
        at = (e // cols) * s2 + (e % cols) * s3  # element e's offset inside its token
        heads = E // head_dim
        hs = int(at[head_dim]) if heads > 1 else 0
        ds = int(at[1]) if head_dim > 1 else 0
        if not torch.equal(at, (e // head_dim) * hs + (e % head_dim) * ds):
            return None
        # NOTE: the cache's blocks only: a strided view may run on into another plane's storage
        return view.as_strided((self.num_blocks, S, heads, head_dim), (s0, s1, hs, ds), view.storage_offset())

    def read(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """Plane ``name`` of the tokens at ``slots``, ``[len(slots), heads * head_dim]``: through the plane's
        strided view where its layout has one (``Group.strided``: every layout vLLM uses), else element by element."""
        g, a, b = self.segment(name)
        slots = self._slots(slots)
        view = g.strided(a, b)
        if view is not None:  # two indices per token (block, offset), not one per element
            return view[slots // self.block_size, slots % self.block_size].reshape(len(slots), b - a)
        return g.flat[g.index(slots, self.block_size, a, b)]
