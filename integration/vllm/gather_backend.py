"""The gather read path: attention over exactly each request's live slots, in logical order (Eq. 2).

vLLM's stock kernels read a dense prefix [0, seq_len) through the block table, so holes left by eviction
would be read. With ``read_path: gather`` vtoken's backend reads instead the slots the scheduler's token
table lists for the request (``attention_slots``, logical order), and masks causally by *logical* token
id, so lazy ``compact`` reclamation (and none at all, Naive-Evict) is safe. For H2O and Scissorhands it also
records each request's attention row (the newest query's softmax weights, mean over heads and layers) and
the workers send it to the scheduler's ``TokenScores``.

Touch points (vllm 0.32): ``v1/attention/backends/registry.py`` (``register_backend`` overrides
``CPU_ATTN``), ``v1/attention/backends/cpu_attn.py`` (the stock backend and impl this subclasses; K/V are
written by its ``do_kv_cache_update`` through the slot mapping, which vtoken maps through the table).
The override is registered in every vLLM process, but the impl is the stock one unless the engine's
``additional_config`` selects the gather path, so plain vLLM is unaffected.

Correctness first: per request and layer, one gather of its live K/V through the device layer's
``PagedKVCache`` (the kernel's own in-block order), then attention in torch.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .settings import VTokenSettings

CLASS_PATH = "vtoken.integration.vllm.gather_backend.VTokenCPUAttentionBackend"


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CPU_ATTN, CLASS_PATH)


def gather_enabled() -> bool:
    from vllm.config import get_current_vllm_config_or_none
    config = get_current_vllm_config_or_none()
    s = VTokenSettings.from_additional_config(config.additional_config) if config is not None else None
    return s is not None and s.read_path == "gather"


class VTokenCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return VTokenGatherImpl if gather_enabled() else CPUAttentionBackendImpl


def current_plan():
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        return None
    worker = getattr(get_kv_transfer_group(), "worker", None)
    return None if worker is None else worker.read_plan


class VTokenGatherImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        plan = current_plan()
        if attn_metadata is None or plan is None:  # warm-up and profiling runs: nothing is evicted yet
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_size
        group = H // KVH
        cache = plan.cache
        k_name, v_name = f"{layer.layer_name}.K", f"{layer.layer_name}.V"
        for i, (qs, qe, slots, ids, qpos) in enumerate(plan.requests):
            k = cache.read(k_name, slots).view(-1, KVH, D)
            v = cache.read(v_name, slots).view(-1, KVH, D)
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            q = query[qs:qe].reshape(-1, H, D)
            s = torch.einsum("mhd,nhd->hmn", q, k) * self.scale
            s.masked_fill_(ids.view(1, 1, -1) > qpos.view(1, -1, 1), float("-inf"))  # causal, by logical id
            w = torch.softmax(s, dim=-1)
            o = torch.einsum("hmn,nhd->mhd", w, v)
            output[qs:qe] = o.reshape(output[qs:qe].shape).to(output.dtype)
            if plan.rows is not None:  # score-based policies: the newest query's weights, mean over heads
                plan.rows[i] += w[:, -1, :].mean(dim=0).to(torch.float64)
        if plan.rows is not None:
            plan.layers += 1
        return output
