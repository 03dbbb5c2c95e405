"""vtoken's attention backend: the gather read path, and attention statistics for the score policies (H2O,
Scissorhands and TOVA: each step's newest row; SnapKV: each prompt's observation window).

vLLM's stock kernels read a dense prefix [0, seq_len) through the block table, so holes left by eviction
would be read. With ``read_path: gather`` vtoken's impl reads instead the slots the scheduler's token
table lists for the request (``attention_slots``, logical order), and masks causally by *logical* token
id, so lazy ``compact`` reclamation (and none at all, Naive-Evict) is safe.

Score-based policies need the newest query's attention weights per token, which fused kernels do not
return. vtoken records them on the last ``score_layers`` layers (mean over heads and those layers):
  * gather path: a by-product of the attention it computes anyway;
  * dense path (``VTokenScoreImpl``): the stock kernel runs unchanged, then a bounded score pass computes
    softmax(q_newest · K_live) for each request on the scored layers only: one query per request, no V.
The workers send the rows to the scheduler's ``TokenScores``.

Touch points (vllm 0.32): ``v1/attention/backends/registry.py`` (``register_backend`` overrides
``CPU_ATTN``), ``v1/attention/backends/cpu_attn.py`` (the stock backend and impl this subclasses; K/V are
written by its ``do_kv_cache_update`` through the slot mapping, which vtoken maps through the table).
The override is registered in every vLLM process, but the impl is the stock one unless the engine's
``additional_config`` selects the gather path or a score-based policy, so plain vLLM is unaffected.

Per layer, every query of the step (decode and prefill chunks alike) is one call of the device layer's
``attention``: its C kernel reads each request's live K/V in place, in logical order (torch's fused attention for
the prompt tokens of long prompts, the torch reference where the kernel does not apply; under strict verify the
reference beside them, compared: V5).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from ..device.gather_attention import attention, check_agreement
from .settings import ATTENTION_POLICIES, VTokenSettings

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
        if s is not None and s.policy in ATTENTION_POLICIES:  # Knorm reads keys only: the stock impl serves it
            return VTokenScoreImpl
        return CPUAttentionBackendImpl


def current_plan():
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        return None
    worker = getattr(get_kv_transfer_group(), "worker", None)
    return None if worker is None else worker.read_plan


def _attention(impl, layer, q, plan, query_request, query_pos, values: bool, weights_of, in_torch, fused):
    """The device layer's ``attention`` of queries ``q`` over their requests' live slots (its kernel reads K/V in
    place; ``in_torch`` in torch: ``fused`` in its fused attention, the rest in the reference), and under strict verify the torch reference too, which must agree
    within the fp32 bound (V5)."""
    args = (plan.cache, layer.layer_name, q, plan.slots, plan.ids, query_request, query_pos, impl.scale)
    got = attention(*args, values, weights_of, in_torch, fused)
    if plan.check:
        check_agreement(*args, got, weights_of, plan.req_ids)
    return got


class VTokenGatherImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        plan = current_plan()
        if attn_metadata is None or plan is None:  # warm-up and profiling runs: nothing is evicted yet
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        T = plan.query_pos.numel()
        weights_of = plan.weights_of(layer.layer_name)
        q = query[:T].reshape(T, self.num_heads, self.head_size)
        out, w = _attention(self, layer, q, plan, plan.query_request, plan.query_pos, True, weights_of,
                            plan.in_torch, plan.fused)
        output[:T] = out.view((T,) + output.shape[1:]).to(output.dtype)
        if weights_of is not None:  # the newest queries' weights (rows), the windows' (SnapKV's votes)
            plan.record(layer.layer_name, w)
        return output


class VTokenScoreImpl(CPUAttentionBackendImpl):
    """Dense path with a policy that reads attention (H2O, Scissorhands, TOVA; SnapKV): the stock kernel, then the
    score pass on the scored layers: each request's newest query over its live tokens, weights only (and, for
    SnapKV, the observation window's queries of each prompt that completes in the step)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        plan = current_plan()
        weights_of = None if attn_metadata is None or plan is None else plan.weights_of(layer.layer_name)
        if weights_of is None:
            return out
        k = len(weights_of)
        q = query[weights_of].reshape(k, self.num_heads, self.head_size)
        _, w = _attention(self, layer, q, plan, plan.query_request[weights_of], plan.query_pos[weights_of], False,
                          torch.arange(k), plan.in_torch[weights_of], plan.fused[weights_of])
        plan.record(layer.layer_name, w)
        return out
