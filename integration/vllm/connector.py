"""``VTokenConnector``: vtoken's channel between vLLM's scheduler and its workers (a KV connector).

vLLM 0.32 has no way to replace a block id in the middle of a running request, nor to read a
request's KV through anything but a dense prefix; a KV connector gives vtoken a hook on each side of
every step. The glue is here; the two halves are ``scheduler_tokens.SchedulerTokens`` (token
tables, policy, densify, the block manager's sizing: ``manager_hooks``) and
``worker_tokens.WorkerTokens`` (copies, block-table rewrites, slot mapping through the table).

  scheduler side  ``bind_kv_cache_manager``: the ``KVCacheManager`` (``v1/core/kv_cache_manager.py``).
                  ``build_connector_meta`` runs after the step's allocation (``v1/core/sched/scheduler.py``):
                  the step's orders travel to the workers in ``SchedulerOutput``.
                  ``update_connector_output`` runs after the forward, in ``update_from_output``, after
                  finished requests were freed: copy reports come back, then evict + densify.
  worker side     ``register_kv_caches``: every layer's KV tensor; its caller is the model runner
                  (``v1/worker/gpu_model_runner.py``, asserted). ``handle_preemptions`` runs at the top of
                  ``execute_model``, before ``_update_states`` and ``_prepare_inputs``.

Why the order is safe (no async scheduling, which ``compat`` refuses): blocks densify empties are freed
in ``update_connector_output`` after step k-1; schedule k may hand them to another request, but the
copies that read them run at the top of ``execute_model`` k, before ``_update_states`` zeroes new blocks
and before the forward writes anything (I5). Copy destinations are the request's own holes; the
forward reads them only after the copy (I3). A block densify writes into loses its prefix-cache hash
before schedule k can hand it out (``manager_hooks.uncache``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorWorkerMetadata)

from ..copy_engine import TorchCopyEngine
from ..verify import Verifier, VerifyConfig
from .scheduler_tokens import SchedulerTokens, StepOrders
from .settings import VTokenSettings


def match_threads_to_cores() -> None:
    """With a KV connector configured, vLLM 0.32's multiprocess CPU worker comes up with more OpenMP
    threads than cores in its affinity mask (seen: 2 threads on 1 core; the same worker without a
    connector has 1). Oversubscribed spinning threads made every parallel op of a step (slot mapping,
    argmax) several times slower. ``v1/worker/cpu_worker.py`` replaces ``torch.set_num_threads`` with
    a no-op after thread binding, so the underlying setter is called directly."""
    import os

    import torch

    cores = len(os.sched_getaffinity(0))
    if torch.get_num_threads() > cores:
        torch._C.set_num_threads(cores)


POOL_CHECK_EVERY = 64  # strict verify walks vLLM's whole pool (P1) once per this many steps: O(pool size)


@dataclass
class VTokenMeta(KVConnectorMetadata):
    step: int
    orders: StepOrders = field(default_factory=StepOrders)


@dataclass
class VTokenWorkerMeta(KVConnectorWorkerMetadata):
    done: list[int] = field(default_factory=list)  # copy handles finished and verified per settings
    failed: list[int] = field(default_factory=list)  # copy handles whose verification failed (quarantine)
    failed_requests: list[str] = field(default_factory=list)  # drill relocations that failed (quarantine)
    relocated: int = 0  # drill relocations
    verified: int = 0  # token relocations hashed and compared
    mismatches: int = 0
    audited: int = 0  # write slots checked against the scheduler's token tables
    seconds: float = 0.0  # worker-side time in vtoken
    attention: dict = field(default_factory=dict)  # request -> (token ids, weights): H2O / Scissorhands

    def aggregate(self, other: VTokenWorkerMeta) -> VTokenWorkerMeta:
        return VTokenWorkerMeta(self.done + other.done, self.failed + other.failed,
                                self.failed_requests + other.failed_requests, self.relocated + other.relocated,
                                self.verified + other.verified, self.mismatches + other.mismatches,
                                self.audited + other.audited, max(self.seconds, other.seconds),
                                {**self.attention, **other.attention})


@dataclass
class WorkerCounters:
    """What the workers reported, summed on the scheduler side."""

    relocated: int = 0
    verified: int = 0
    mismatches: int = 0
    audited: int = 0
    quarantined: int = 0
    seconds: float = 0.0


class VTokenConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = VTokenSettings.from_additional_config(vllm_config.additional_config) or VTokenSettings()
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.step = 0
        self.tokens: SchedulerTokens | None = None  # scheduler side
        self._scheduler = None
        self.quarantined: list[str] = []
        self.workers = WorkerCounters()
        self.worker = None  # WorkerTokens, worker side
        self.engine: TorchCopyEngine | None = None
        self._reported = VTokenWorkerMeta()

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ---- scheduler side ----------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.tokens = SchedulerTokens(self.settings, kv_cache_manager, self.block_size)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> VTokenMeta:
        if self._scheduler is None:  # the caller is ``Scheduler._build_kv_connector_meta``
            from vllm.v1.core.sched.scheduler import Scheduler
            self._scheduler = inspect.currentframe().f_back.f_locals.get("self")
            assert isinstance(self._scheduler, Scheduler), f"build_connector_meta called by {self._scheduler!r}"
        self.step += 1
        every = self.settings.drill_every
        drill = self.step // every if every and self.step % every == 0 else None
        return VTokenMeta(self.step, self.tokens.on_schedule(scheduler_output, drill))

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, VTokenWorkerMeta):
            corrupted = self.tokens.on_reports(meta.done, meta.failed) + meta.failed_requests
            if corrupted:
                self.fail_requests(corrupted)
            w = self.workers
            w.relocated += meta.relocated
            w.verified += meta.verified
            w.mismatches += meta.mismatches
            w.audited += meta.audited
            w.seconds += meta.seconds
        self.tokens.after_step(meta.attention if isinstance(meta, VTokenWorkerMeta) else None)
        if self.settings.strict_verify == "strict":
            self.tokens.check(pool=self.step % POOL_CHECK_EVERY == 0)

    def fail_requests(self, req_ids: list[str]) -> None:
        """Quarantine: end these requests with an error at the next ``update_from_output``, which sends the
        client a FINISHED_ERROR output; every other request keeps running. vLLM 0.32 has no connector API
        for this; ``v1/core/sched/scheduler.py`` fails the requests in ``grammar_compile_error_reqs`` that
        way, with no other effect, so vtoken adds its own there."""
        self.quarantined.extend(req_ids)
        self.workers.quarantined += len(req_ids)
        self._scheduler.grammar_compile_error_reqs.update(req_ids)

    def get_kv_connector_stats(self):
        """vtoken's counters for vLLM's stats logging and Prometheus (``metrics.py``); scheduler side only."""
        if self.tokens is None:
            return None
        from .metrics import VTokenStats
        return VTokenStats(data=self.tokens.metrics(self.workers))

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        from .metrics import VTokenStats
        return VTokenStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from .metrics import VTokenPromMetrics
        return VTokenPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def request_finished(self, request, block_ids):
        self.tokens.finished(request.request_id)
        return False, None

    # ---- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from .kv_bridge import paged_cache
        from .worker_tokens import WorkerTokens

        runner = inspect.currentframe().f_back.f_locals.get("self")
        assert isinstance(runner, GPUModelRunner), f"register_kv_caches called by {type(runner).__name__}"
        match_threads_to_cores()
        cache = paged_cache(kv_caches, self.vllm_config)
        s = self.settings
        self.engine = TorchCopyEngine(cache, Verifier(cache, VerifyConfig(
            s.strict_verify, sample_every=s.sample_every, on_mismatch=s.on_mismatch,
            evidence_dir=s.evidence_dir, seed=s.seed)))
        from .settings import SCORE_POLICIES
        from vllm.model_executor.models.utils import extract_layer_index
        layers = sorted(kv_caches, key=extract_layer_index)  # the model's attention layers, in order
        scored = frozenset(layers[-s.score_layers:] if s.score_layers else layers) if s.policy in SCORE_POLICIES \
            else frozenset()
        self.worker = WorkerTokens(runner, self.engine, self.block_size, scored)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if isinstance(kv_connector_metadata, VTokenMeta):
            self.worker.apply(kv_connector_metadata.orders)

    def build_connector_worker_meta(self) -> VTokenWorkerMeta | None:
        w, c = self.worker, self.engine.verifier.counters
        done, failed, failed_requests = w.take_reports()
        now = VTokenWorkerMeta(done, failed, failed_requests, w.relocated, c.verified, c.mismatches, w.audited,
                               w.seconds)
        last, self._reported = self._reported, now
        delta = VTokenWorkerMeta(done, failed, failed_requests, now.relocated - last.relocated,
                                 now.verified - last.verified, now.mismatches - last.mismatches,
                                 now.audited - last.audited, now.seconds - last.seconds, w.take_attention())
        if not (done or failed or failed_requests or delta.relocated or delta.verified or delta.mismatches
                or delta.audited or delta.seconds or delta.attention):
            return None  # nothing to report: no per-step traffic
        return delta

    # the KV-transfer hooks vtoken does not use
    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
