"""vLLM's per-layer KV tensors as one ``PagedKVCache`` (worker side).

Depends on vllm 0.32: the CPU backend's cache shape ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` (``v1/attention/backends/cpu_attn.py``) and ``ModelConfig.get_num_kv_heads`` /
``get_head_size``. The in-block order is probed from the kernel's own cache-write op at start-up.
"""

from __future__ import annotations

import torch

from ..device.kv_cache import PagedKVCache
from ..device.kv_layout import cpu_plane, probe_block_order
from .compat import UnsupportedConfigError


def paged_cache(kv_caches: dict[str, torch.Tensor], vllm_config) -> PagedKVCache:
    """The cache vtoken moves and verifies tokens in: every layer, K and V, in the kernel's own order."""
    first = next(iter(kv_caches.values()))
    if first.device.type != "cpu":
        raise UnsupportedConfigError(f"vtoken's vLLM integration is verified on the CPU backend only; the KV "
                                     f"layout on {first.device.type} is not verified yet")
    from .vllm_cpu_writer import vllm_cpu_writer

    mc = vllm_config.model_config
    heads, head_size = mc.get_num_kv_heads(vllm_config.parallel_config), mc.get_head_size()
    block_size = vllm_config.cache_config.block_size
    expected = (heads, block_size, 2 * head_size)
    for name, t in kv_caches.items():
        if tuple(t.shape[1:]) != expected:
            raise UnsupportedConfigError(f"layer {name!r}: KV tensor {tuple(t.shape)}, expected [num_blocks, "
                                         f"{heads}, {block_size}, {2 * head_size}] (vLLM 0.32 CPU layout)")
    write, _isa = vllm_cpu_writer(first.dtype, block_size, head_size)
    order = probe_block_order(write, heads, block_size, head_size, first.dtype)
    return PagedKVCache([cpu_plane(name, t, order) for name, t in kv_caches.items()])
