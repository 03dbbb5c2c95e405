"""vtoken's attention backend: the gather read path, and attention scores for H2O and Scissorhands.

vLLM's stock kernels read a dense prefix [0, seq_len) through the block table, so holes left by eviction
would be read. With ``read_path: gather`` vtoken's impl reads instead the slots the scheduler's token
table lists for the request (``attention_slots``, logical order), and masks causally by *logical* token
id, so lazy ``compact`` reclamation (and none at all, Naive-Evict) is safe.

Score-based policies need the newest query's attention weights per token, which fused kernels do not
return. vtoken records them on the last ``score_layers`` layers (mean over heads and those layers):
  * gather path: a by-product of the attention it computes anyway;
  * dense path (``VTokenScoreImpl``): the stock kernel runs unchanged, then a bounded score pass computes
    softmax(q_newest · K_live) for each request on the scored layers only: one K gather and one
    (heads x live tokens) product per request and scored layer; no V, no other queries.
The workers send the rows to the scheduler's ``TokenScores``.

Touch points (vllm 0.32): ``v1/attention/backends/registry.py`` (``register_backend`` overrides
``CPU_ATTN``), ``v1/attention/backends/cpu_attn.py`` (the stock backend and impl this subclasses; K/V are
written by its ``do_kv_cache_update`` through the slot mapping, which vtoken maps through the table).
The override is registered in every vLLM process, but the impl is the stock one unless the engine's
``additional_config`` selects the gather path or a score-based policy, so plain vLLM is unaffected.

Correctness first, in torch: per layer, one gather of the decode requests' live K/V through the device
layer's ``PagedKVCache`` (the kernel's own in-block order), padded to the longest, and one batched product;
prefill chunks (several queries) one request at a time.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .settings import SCORE_POLICIES, VTokenSettings

CLASS_PATH = "vtoken.integration.vllm.gather_backend.VTokenCPUAttentionBackend"


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CPU_ATTN, CLASS_PATH)


def engine_settings() -> VTokenSettings | None:
    from vllm.config import get_current_vllm_config_or_none
    config = get_current_vllm_config_or_none()
    return VTokenSettings.from_additional_config(config.additional_config) if config is not None else None


class VTokenCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        s = engine_settings()
        if s is not None and s.read_path == "gather":
            return VTokenGatherImpl
        if s is not None and s.policy in SCORE_POLICIES:
            return VTokenScoreImpl
        return CPUAttentionBackendImpl


def current_plan():
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        return None
    worker = getattr(get_kv_transfer_group(), "worker", None)
    return None if worker is None else worker.read_plan


def _batched_decode(impl, layer, query, plan, with_output: bool):
    """Attention of the step's decode requests over their live slots: one K (and V) gather and one batched
    product per layer. Returns (outputs [R, H*D] or None, weights [R, H, N])."""
    b = plan.decode
    H, KVH, D = impl.num_heads, impl.num_kv_heads, impl.head_size
    R, N = b.slots.shape
    flat = b.slots.flatten()
    k = plan.cache.read(f"{layer.layer_name}.K", flat).view(R, N, KVH, D)
    q = query[b.rows].reshape(R, KVH, H // KVH, D)  # heads grouped by their KV head (GQA)
    s = torch.einsum("rkgd,rnkd->rkgn", q, k) * impl.scale
    s.masked_fill_(~b.valid.view(R, 1, 1, N), float("-inf"))  # padding, and causal by logical id
    w = torch.softmax(s, dim=-1)
    out = None
    if with_output:
        v = plan.cache.read(f"{layer.layer_name}.V", flat).view(R, N, KVH, D)
        out = torch.einsum("rkgn,rnkd->rkgd", w, v).reshape(R, H * D)
    return out, w.reshape(R, H, N)


def _add_rows(plan, index: list[int], w: torch.Tensor) -> None:
    """Add the newest queries' weights, mean over heads, to the requests' score rows."""
    mean = w.mean(dim=1).to(torch.float64)
    for b, i in enumerate(index):
        plan.rows[i] += mean[b, : plan.rows[i].numel()]


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
        scored = plan.scores(layer.layer_name)
        if plan.decode is not None:
            out, w = _batched_decode(self, layer, query, plan, with_output=True)
            output[plan.decode.rows] = out.view((out.shape[0],) + output.shape[1:]).to(output.dtype)
            if scored:
                _add_rows(plan, plan.decode.index, w)
        for i, (qs, qe, slots, ids, qpos) in plan.multi_query():
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
            if scored:  # the newest query's weights, mean over heads
                plan.rows[i] += w[:, -1, :].mean(dim=0).to(torch.float64)
        plan.layers += scored
        return output


class VTokenScoreImpl(CPUAttentionBackendImpl):
    """Dense path with H2O or Scissorhands: the stock kernel, then the score pass on the scored layers."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        plan = current_plan()
        if attn_metadata is None or plan is None or not plan.scores(layer.layer_name):
            return out
        if plan.decode is not None:
            _add_rows(plan, plan.decode.index, _batched_decode(self, layer, query, plan, with_output=False)[1])
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_size
        k_name = f"{layer.layer_name}.K"
        for i, (_, qe, slots, ids, qpos) in plan.multi_query():
            k = plan.cache.read(k_name, slots).view(-1, KVH, D)
            q = query[qe - 1].reshape(KVH, H // KVH, D)  # the newest query, heads grouped by their KV head
            s = torch.einsum("kgd,nkd->kgn", q, k) * self.scale
            s.masked_fill_(ids.view(1, 1, -1) > qpos[-1], float("-inf"))
            plan.rows[i] += torch.softmax(s, dim=-1).reshape(H, -1).mean(dim=0).to(torch.float64)
        plan.layers += 1
        return out
