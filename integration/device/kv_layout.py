"""Where one token's K and V elements live inside a paged KV tensor.

A ``Plane`` is one tensor plus, for each in-block offset o, the element
indices (into the tensor's untyped storage, counted in elements of its dtype)
of the token at (block 0, offset o), in canonical order ``[K or V][head][dim]``;
block b adds ``b * block_stride``. With that table, a token-granular move is a
flat gather/scatter, whatever the layout.

Layouts (per layer):
  vLLM GPU        K and V, each ``[num_blocks, block_size, num_kv_heads, head_dim]``, or stacked
                  as one ``[2, num_blocks, ...]`` tensor: ``gpu_planes``.
  vLLM CPU        ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; the in-block order
                  depends on the kernel's ISA path, so ``probe_block_order`` learns it from the
                  kernel's own cache-write op; ``cpu_plane`` takes the learned order (default: what
                  the ``vec``/``vec16`` paths write, ``default_cpu_block_order``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vtoken.core.checks import check_int
from vtoken.core.errors import ConfigError


class LayoutError(ConfigError):
    """A KV tensor does not have the shape, or a probed kernel the behaviour, a layout requires."""


@dataclass(frozen=True)
class Plane:
    """One tensor's share of a layer's K/V: ``offsets[o]`` are the storage element indices of the token
    at (block 0, offset o); block b's are ``offsets[o] + b * block_stride``.

    Invariant (checked at construction): all indices of all blocks lie inside the tensor's storage, and
    the token tables of distinct offsets are disjoint; the tensor has at least one block, the block at
    least one slot and a slot at least one element; ``offsets`` is an int64 tensor on the CPU.
    """

    layer: str
    tensor: torch.Tensor
    block_stride: int
    offsets: torch.Tensor  # int64 [block_size, elems]
    parts: tuple[str, ...]  # what the elems are, in order: ("K",), ("V",) or ("K", "V")

    def __post_init__(self) -> None:
        if not isinstance(self.layer, str):
            raise LayoutError(f"a plane's layer name must be a string, got {self.layer!r}")
        if not isinstance(self.tensor, torch.Tensor):
            raise LayoutError(f"layer {self.layer!r}: the KV tensor must be a torch.Tensor, got {type(self.tensor).__name__}")
        if not isinstance(self.offsets, torch.Tensor) or self.offsets.dtype != torch.int64 or self.offsets.dim() != 2 \
                or self.offsets.device.type != "cpu":
            raise LayoutError(f"layer {self.layer!r}: offsets must be an int64 [block_size, elems] tensor on the CPU, "
                              f"got {self.offsets!r:.80}")
        if self.tensor.dim() == 0:
            raise LayoutError(f"layer {self.layer!r}: the KV tensor has no block dimension (a scalar)")
        check_int(f"layer {self.layer!r}: block_stride", self.block_stride, 1, error=LayoutError)
        if not (isinstance(self.parts, tuple) and self.parts in (("K",), ("V",), ("K", "V"))):
            raise LayoutError(f"layer {self.layer!r}: parts must be ('K',), ('V',) or ('K', 'V'), got {self.parts!r}")
        S, E = self.offsets.shape
        nb = self.num_blocks
        if S < 1 or E < 1 or nb < 1 or E % len(self.parts):
            raise LayoutError(f"layer {self.layer!r}: {nb} blocks of {S} slots of {E} elements; each must be "
                              f"at least 1 (and the elements split evenly over {self.parts})")
        lo, hi = int(self.offsets.min()), int(self.offsets.max()) + (nb - 1) * self.block_stride
        size = self.tensor.untyped_storage().nbytes() // self.tensor.element_size()
        if lo < 0 or hi >= size:
            raise LayoutError(f"layer {self.layer!r}: token elements [{lo}, {hi}] fall outside the tensor's "
                              f"storage of {size} elements")
        if self.offsets.unique().numel() != S * E:
            raise LayoutError(f"layer {self.layer!r}: two offsets of a block share an element")

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[self._block_dim]

    @property
    def _block_dim(self) -> int:
        return 0

    @property
    def block_size(self) -> int:
        return self.offsets.shape[0]

    @property
    def elems(self) -> int:
        return self.offsets.shape[1]


def _plane_from_view(layer: str, view: torch.Tensor, part: str) -> Plane:
    """A ``[num_blocks, block_size, heads, dim]`` view (any strides)."""
    if not isinstance(view, torch.Tensor):
        raise LayoutError(f"layer {layer!r}: {part} must be a torch.Tensor, got {type(view).__name__}")
    if view.dim() != 4:
        raise LayoutError(f"layer {layer!r}: {part} must be [num_blocks, block_size, num_kv_heads, head_dim], "
                          f"got shape {tuple(view.shape)}")
    nb, S, H, D = view.shape
    st = view.stride()
    o = torch.arange(S).view(S, 1, 1) * st[1]
    h = torch.arange(H).view(1, H, 1) * st[2]
    d = torch.arange(D).view(1, 1, D) * st[3]
    offsets = (view.storage_offset() + o + h + d).reshape(S, H * D)
    return Plane(layer, view, st[0], offsets, (part,))


def gpu_planes(layer: str, kv: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> list[Plane]:
    """vLLM's GPU layout: a ``(K, V)`` pair of ``[num_blocks, block_size, heads, dim]`` tensors, or one
    ``[2, num_blocks, block_size, heads, dim]`` tensor."""
    if isinstance(kv, torch.Tensor):
        if kv.dim() != 5 or kv.shape[0] != 2:
            raise LayoutError(f"layer {layer!r}: a stacked KV tensor must be [2, num_blocks, block_size, "
                              f"num_kv_heads, head_dim], got shape {tuple(kv.shape)}")
        k, v = kv[0], kv[1]
    else:
        if not isinstance(kv, (tuple, list)) or len(kv) != 2 \
                or not all(isinstance(t, torch.Tensor) for t in kv):
            raise LayoutError(f"layer {layer!r}: KV must be a (K, V) pair of tensors or one stacked tensor, "
                              f"got {type(kv).__name__} {kv!r:.60}")
        k, v = kv
        if k.shape != v.shape or k.dtype != v.dtype:
            raise LayoutError(f"layer {layer!r}: K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype} "
                              f"differ")
        if k.device != v.device:
            raise LayoutError(f"layer {layer!r}: K is on {k.device} and V on {v.device}; a layer's K and V "
                              f"must share a device")
    return [_plane_from_view(layer, k, "K"), _plane_from_view(layer, v, "V")]


def default_cpu_block_order(num_kv_heads: int, block_size: int, head_size: int) -> torch.Tensor:
    """The in-block order vLLM 0.32's CPU kernels write on their ``vec`` and ``vec16`` paths (learned with
    ``probe_block_order`` from ``cpu_attn_reshape_and_cache``, tests/test_device_layer.py): per head, K
    dim-major (element d of the token at offset o at d * S + o) in the first S * D elements, then V
    token-major (o * D + d). int64 ``[block_size, 2 * heads * head_size]``, canonical order K[h][d] then
    V[h][d]. Other ISA paths (``amx``) may differ: probe them."""
    for what, n in (("num_kv_heads", num_kv_heads), ("block_size", block_size), ("head_size", head_size)):
        check_int(what, n, 1, error=LayoutError)
    H, S, D = num_kv_heads, block_size, head_size
    o = torch.arange(S).view(S, 1, 1)
    h = torch.arange(H).view(1, H, 1) * (2 * S * D)
    d = torch.arange(D).view(1, 1, D)
    k = h + d * S + o
    v = h + S * D + o * D + d
    return torch.cat([k.reshape(S, H * D), v.reshape(S, H * D)], dim=1)


def cpu_plane(layer: str, cache: torch.Tensor, block_order: torch.Tensor | None = None) -> Plane:
    """vLLM's CPU layout ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (contiguous), with the
    in-block order ``block_order`` (from ``probe_block_order``; default ``default_cpu_block_order``)."""
    if not isinstance(cache, torch.Tensor):
        raise LayoutError(f"layer {layer!r}: a CPU KV tensor must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() != 4 or cache.shape[3] % 2 or not cache.is_contiguous() or 0 in cache.shape:
        raise LayoutError(f"layer {layer!r}: a CPU KV tensor must be contiguous [num_blocks, num_kv_heads, "
                          f"block_size, 2*head_size], got shape {tuple(cache.shape)}")
    nb, H, S, D2 = cache.shape
    order = default_cpu_block_order(H, S, D2 // 2) if block_order is None else block_order
    if not isinstance(order, torch.Tensor) or order.dtype != torch.int64 or order.device.type != "cpu":
        raise LayoutError(f"layer {layer!r}: block order must be an int64 CPU tensor (probe_block_order's), "
                          f"got {order!r:.60}")
    if tuple(order.shape) != (S, H * D2):
        raise LayoutError(f"layer {layer!r}: block order has shape {tuple(order.shape)}, expected {(S, H * D2)}")
    block_elems = H * S * D2
    return Plane(layer, cache, block_elems, cache.storage_offset() + order, ("K", "V"))


# (key [T, H, D], value [T, H, D], cache [num_blocks, H, S, 2D], slot_mapping [T] int64) -> None
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def probe_block_order(write: CacheWriter, num_kv_heads: int, block_size: int, head_size: int,
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.Tensor:
    """Learn where ``write`` (a kernel's cache-update op) puts each K/V element inside a block.

    Writes a full block of tokens ceil(log2(n + 1)) times, each time with element i holding bit j of
    i + 1 (only 0 and 1, exact in every dtype), into block 1 of a two-block zeroed cache, and decodes
    each cache position's code from the bits. Returns ``[block_size, 2 * heads * head_size]`` in
    canonical order (K[h][d] then V[h][d]), like ``default_cpu_block_order``.
    Raises ``LayoutError`` if the op writes outside block 1, loses or duplicates an element.
    """
    if not callable(write):
        raise LayoutError(f"probe: the cache-write op must be callable, got {write!r}")
    for what, k in (("num_kv_heads", num_kv_heads), ("block_size", block_size), ("head_size", head_size)):
        check_int(f"probe: {what}", k, 1, error=LayoutError)
    H, S, D = num_kv_heads, block_size, head_size
    n = S * 2 * H * D
    codes = torch.arange(1, n + 1, device=device).view(S, 2, H, D)
    found = torch.zeros(2 * H * S * 2 * D, dtype=torch.int64, device=device)
    slots = torch.arange(S, 2 * S, device=device)
    for bit in range((n + 1).bit_length()):
        cache = torch.zeros(2, H, S, 2 * D, dtype=dtype, device=device)
        bits = ((codes >> bit) & 1).to(dtype)
        write(bits[:, 0].contiguous(), bits[:, 1].contiguous(), cache, slots)
        got = cache.reshape(-1).to(torch.float32)
        if not bool(((got == 0) | (got == 1)).all()):
            raise LayoutError("probe: the cache-write op changed values (expected a pure copy of 0s and 1s)")
        found |= got.to(torch.int64) << bit
    block_elems = H * S * 2 * D
    if bool(found[:block_elems].any()):
        raise LayoutError("probe: the cache-write op wrote into block 0 for slots of block 1")
    in_block = found[block_elems:]
    order = torch.full((n,), -1, dtype=torch.int64, device=device)
    pos = torch.nonzero(in_block).flatten()
    if bool((in_block > n).any()):
        raise LayoutError("probe: the cache-write op wrote two K/V elements to one position of the block")
    order[in_block[pos] - 1] = pos
    if pos.numel() != n or bool((order < 0).any()):
        raise LayoutError(f"probe: {n - int((order >= 0).sum())} of {n} K/V elements were not written to a "
                          f"distinct position of the block")
    return order.view(S, 2 * H * D).cpu()
