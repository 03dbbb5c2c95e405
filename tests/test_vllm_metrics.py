"""vtoken's counters reach vLLM's stats: Prometheus (``/metrics``) and the periodic log line."""

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402

from vtoken.integration.vllm.connector import VTokenConnector  # noqa: E402
from vtoken.integration.vllm.metrics import COUNTERS, GAUGES, VTokenStats  # noqa: E402


def prom() -> dict:
    import prometheus_client
    return {s.name: s.value for m in prometheus_client.REGISTRY.collect() if "vtoken" in m.name for s in m.samples
            if s.name.endswith("_total") or s.name.removeprefix("vllm:vtoken_") in GAUGES}


def test_counters_are_exported_to_prometheus():
    res = H.run({"policy": "streaming_llm", "budget": 0.5, "strict_verify": "strict"}, disable_log_stats=False)
    p, s, w = prom(), res["scheduler"], res["worker"]
    assert p["vllm:vtoken_tokens_evicted_total"] == s["evicted"] > 0
    assert p["vllm:vtoken_tokens_moved_total"] == s["moves"] > 0
    assert p["vllm:vtoken_blocks_released_total"] == s["blocks_released"] > 0
    assert p["vllm:vtoken_plans_committed_total"] == s["plans_committed"] > 0
    assert p["vllm:vtoken_copies_verified_total"] == w["verified"] > 0
    assert p["vllm:vtoken_write_slots_audited_total"] == w["audited"] > 0
    assert p["vllm:vtoken_mismatches_total"] == 0
    assert 0 < p["vllm:vtoken_seconds_total"] and 0 < p["vllm:vtoken_worker_seconds_total"]
    assert p["vllm:vtoken_retained_blocks"] == 0 and p["vllm:vtoken_waste_ratio"] == 0  # all requests finished


def test_the_log_line_sums_counters_and_keeps_the_latest_gauges():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    logging = KVConnectorLogging(KVTransferConfig(kv_connector="VTokenConnector", kv_role="kv_both",
                                                  kv_connector_module_path="vtoken.integration.vllm.connector"))
    logging.observe({"tokens_evicted": 3, "copies_verified": 2, "waste_ratio": 0.5, "retained_blocks": 9})
    logging.observe({"tokens_evicted": 4, "copies_verified": 0, "waste_ratio": 0.25, "retained_blocks": 7})
    lines = []
    logging.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
    assert lines == ["KV Transfer metrics: tokens_evicted=7, copies_verified=2, waste_ratio=0.25, retained_blocks=7"]


def test_stats_objects():
    assert VTokenConnector.build_kv_connector_stats({"tokens_evicted": 1}).data == {"tokens_evicted": 1}
    assert VTokenStats().is_empty() and not VTokenStats(data={"seconds": 0.0}).is_empty()
    assert set(COUNTERS).isdisjoint(GAUGES)


def test_help_texts_of_relocation_series_hold_under_every_planner():
    """A series that densify and compact both feed says so; none names one planner only (issue #17: the help of
    plans_committed and blocks_released said "densify" under compact too)."""
    relocation = {"plans_committed", "plans_aborted", "tokens_moved", "blocks_released"}
    for name, doc in COUNTERS.items():
        assert ("densify" in doc) == ("compact" in doc), f"{name}: {doc!r} names one planner only"
    assert all("compact" in COUNTERS[n] or "plan" in COUNTERS[n] for n in relocation)
    assert "densify: those past ceil(live / block size); compact: sources minus the destinations kept" \
        in COUNTERS["blocks_released"]
