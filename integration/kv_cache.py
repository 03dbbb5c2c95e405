"""Every layer's K/V tensors seen as one pool of slots (slot = block * block_size + offset).

Planes that live in the same storage with the same dtype form a ``Group``: one flat view of that
storage, and per in-block offset the element indices of all its planes, so moving n tokens across all
those layers is one gather and one scatter. Layers that share a backing buffer (the same elements) are
registered once; the duplicate's name is kept as an alias for error messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
        if not planes:
            raise LayoutError("a KV cache needs at least one plane")
        S, nb = planes[0].block_size, planes[0].num_blocks
        for p in planes:
            if p.block_size != S or p.num_blocks != nb:
                raise LayoutError(f"layer {p.layer!r}: {p.num_blocks} blocks of {p.block_size} slots, but layer "
                                  f"{planes[0].layer!r} has {nb} of {S}")
        self.block_size, self.num_blocks = S, nb
        self.device = planes[0].tensor.device
        self.aliases: dict[str, str] = {}  # layer -> the layer whose buffer it shares
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

    # ---- bulk access (one gather / one scatter per group) ----------------------------------------
    def gather(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """The tokens' bits at ``slots``, per group ``[len(slots), E]`` (an integer dtype as wide as the
        group's): a copy, so later writes cannot change it."""
        n = slots.numel()
        return [g.row_view().index_select(0, g.rows(slots, self.block_size).flatten()).view(n, -1)
                for g in self.groups]

    def scatter(self, slots: torch.Tensor, values: list[torch.Tensor]) -> None:
        for g, v in zip(self.groups, values):
            g.row_view().index_copy_(0, g.rows(slots, self.block_size).flatten(), v.view(-1, g.run))

    # ---- per-layer access for models, tests and the fuzzer ----------------------------------------
    def _segment(self, name: str) -> tuple[Group, int, int]:
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
        g, a, b = self._segment(name)
        g.flat[g.index(slots, self.block_size, a, b)] = values.to(g.flat.dtype)

    def read(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        g, a, b = self._segment(name)
        return g.flat[g.index(slots, self.block_size, a, b)]
