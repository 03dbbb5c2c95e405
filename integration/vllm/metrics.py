"""vtoken's counters in vLLM's own stats: the periodic ``KV Transfer metrics: ...`` log line and Prometheus.

vLLM 0.32 (``distributed/kv_transfer/kv_connector/v1/metrics.py``) asks the scheduler-side connector for a
``KVConnectorStats`` after every step (``get_kv_connector_stats``), accumulates them per logging interval
with ``aggregate``, logs ``reduce()`` every interval when stats logging is on (``vllm serve``'s default),
and hands each step's ``data`` to the connector's ``KVConnectorPromMetrics.observe`` for ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# per-interval counts (summed)
COUNTERS = {
    "tokens_evicted": "tokens the eviction policy evicted",
    "plans_committed": "relocation plans committed (densify: a request made dense; compact: a request's "
                       "sparse blocks packed; none with reclaim off)",
    "plans_aborted": "relocation plans aborted (a refused launch, a failed copy, a stale plan, a request "
                     "that left mid-copy)",
    "tokens_moved": "token relocations of committed plans, copied by the workers (densify and compact alike)",
    "blocks_released": "blocks committed plans returned to vLLM's pool (densify: those past ceil(live / block "
                       "size); compact: sources minus the destinations kept; release: wholly dead blocks)",
    "releases": "releases committed on the gather path, whatever the reclaimer: a request's wholly dead private "
                "blocks returned without a copy (the paper's Naive-Evict)",
    "pressure_steps": "steps that ended with vLLM short of blocks (running requests' next blocks and the waiting "
                      "request's prompt beyond the free pool): a round then runs whatever theta_F says, compact "
                      "first and densify in place where compact cannot shrink a request (gather path)",
    "packs": "plans a pressure round made on the gather path to densify in place a request compact could not "
             "shrink, so that it holds ceil(live / block size) blocks (in plans_committed too)",
    "copies_verified": "copies whose K/V digests strict verify compared (one per shard under tensor parallelism)",
    "mismatches": "copies whose digests differed",
    "quarantined": "requests failed by quarantine",
    "write_slots_audited": "write slots checked against the token tables",
    "seconds": "scheduler-side seconds spent in vtoken",
    "worker_seconds": "worker-side seconds spent in vtoken (copies, verification, slot mapping; slowest worker)",
}
# the latest value (not summed)
GAUGES = {
    "waste_ratio": "F: share of allocated KV slots holding no live token",
    "retained_blocks": "blocks held by running requests",
    "ideal_blocks": "sum over running requests of ceil(live tokens / block size)",
}


@dataclass
class VTokenStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> VTokenStats:
        out = dict(self.data)
        for k, v in other.data.items():
            out[k] = out.get(k, 0) + v if k in COUNTERS else v
        return VTokenStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not self.data


class VTokenPromMetrics(KVConnectorPromMetrics):
    """``vllm:vtoken_<counter>_total`` counters and ``vllm:vtoken_<gauge>`` gauges, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {k: create_metric_per_engine(self._counter_cls(
            name=f"vllm:vtoken_{k}_total", documentation=doc, labelnames=labelnames), per_engine_labelvalues)
            for k, doc in COUNTERS.items()}
        self.gauges = {k: create_metric_per_engine(self._gauge_cls(
            name=f"vllm:vtoken_{k}", documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent"),
            per_engine_labelvalues) for k, doc in GAUGES.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            if k in self.counters and v:
                self.counters[k][engine_idx].inc(v)
            elif k in self.gauges:
                self.gauges[k][engine_idx].set(v)
