"""The cache-write op of vLLM's CPU attention backend, as a ``CacheWriter`` for ``probe_block_order``.

Depends on vllm 0.32 ``v1/attention/backends/cpu_attn.py`` (the ``[B, H, 2S, D]`` view of the
``[B, H, S, 2D]`` cache, K rows then V rows, the ISA choice ``_get_attn_isa``) and
``_custom_ops.cpu_attn_reshape_and_cache``. Imported only where vLLM is installed.
"""

from __future__ import annotations

import torch

from ..device.kv_layout import CacheWriter


def vllm_cpu_writer(dtype: torch.dtype, block_size: int, head_size: int) -> tuple[CacheWriter, str]:
    """The writer the CPU backend uses for this dtype and shape, and its ISA path's name."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size)

    def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        nb, h, s, d2 = cache.shape
        key_cache, value_cache = cache.view(nb, h, 2 * s, d2 // 2).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    return write, isa
