"""The device-layer setup ``vtoken fuzz --target tensors`` drives (torch: imported only by that target)."""

from __future__ import annotations

import torch

from vtoken.integration.device.copy_engine import TorchCopyEngine
from vtoken.integration.device.kv_cache import PagedKVCache
from vtoken.integration.device.kv_layout import cpu_plane, gpu_planes
from vtoken.integration.device.tensor_tags import TensorTagStore
from vtoken.integration.device.verify import Verifier, VerifyConfig


def tensor_engine(num_blocks: int, block_size: int, seed: int = 0) -> TorchCopyEngine:
    """Four layers, three layouts, three dtypes, GQA/MQA heads, one shared buffer; strict verify raises. Tokens move
    with the compiled mover in an odd pool, with torch in an even one."""
    S = block_size
    k0, v0 = torch.zeros(num_blocks, S, 2, 4), torch.zeros(num_blocks, S, 2, 4)
    stacked = torch.zeros(2, num_blocks, S, 1, 4, dtype=torch.bfloat16)
    cpu = torch.zeros(num_blocks, 2, S, 2 * 4, dtype=torch.float16)
    cache = PagedKVCache(gpu_planes("layer0", (k0, v0)) + gpu_planes("layer1", stacked)
                         + [cpu_plane("layer2", cpu)] + gpu_planes("layer3", (k0, v0)))
    # NOTE: an odd pool moves tokens with the compiled mover (the fast path's, vLLM's default on the CPU), an even
    # one with torch's gather and scatter (the reference): a campaign runs both, a replay the same one as its run
    mover = None
    if num_blocks % 2:
        from vtoken.integration.fastpath import unavailable
        if unavailable() is None:
            from vtoken.integration.fastpath.relocate import host_mover
            mover = host_mover(cache)
    engine = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict", seed=seed)), mover=mover)
    engine.store = TensorTagStore(cache)
    return engine
