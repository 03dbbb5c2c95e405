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
  worker side     ``register_kv_caches``: every layer's KV tensor (``GPUModelRunner.initialize_kv_cache``,
                  ``v1/worker/gpu_model_runner.py``). ``handle_preemptions`` runs at the top of
                  ``execute_model``, before ``_update_states`` and ``_prepare_inputs``.

Wiring. A KV connector sees neither the scheduler that built it nor the model runner whose KV it gets, and
vtoken needs both (the scheduler to fail a request, the runner to rewrite block tables and slot mappings). The
plugin (``plugin.install_connector``) therefore also installs two thin subclasses of vLLM's own classes, and
they hand themselves to the connector explicitly:
  ``VTokenScheduler``  (``scheduler_cls``) after ``Scheduler.__init__``: ``connector.bind_scheduler(self)``;
                  and at the top of ``update_from_output``, before vLLM builds the step's outputs:
                  ``connector.quarantine_before_outputs`` (below).
  ``VTokenCPUWorker``  (``worker_cls``) after ``Worker.initialize_from_config`` (which creates the
                  worker-side connector and, inside ``initialize_kv_cache``, registers the KV caches):
                  ``connector.bind_model_runner(self.model_runner)``.
A connector used without them raises ``WiringError`` at its first step instead of guessing.

Quarantine (``on_mismatch: quarantine``). A copy that fails verification at the top of step k has already
been read by step k's forward for that request, so step k's sampled token comes from unverified K/V. The
workers report the failure in step k's ``VTokenWorkerMeta``; ``update_from_output`` k reads it (through
``VTokenScheduler``) *before* its per-request loop: the request's sampled token (and prompt logprobs) are
dropped from the step's ``ModelRunnerOutput`` and the request goes into ``grammar_compile_error_reqs``, which
the same call ends with ``FINISHED_ERROR`` after the loop (vLLM 0.32's one way to fail a running request). So
the client receives no token computed after the failed copy, and the request leaves the batch at step k+1,
exactly as if it had been aborted after step k. ``update_connector_output`` runs later in the same call
(after the error pass), so it cannot do this itself.

Why the order is safe (no async scheduling, which ``compat`` refuses): blocks densify empties are freed
in ``update_connector_output`` after step k-1; schedule k may hand them to another request, but the
copies that read them run at the top of ``execute_model`` k, before ``_update_states`` zeroes new blocks
and before the forward writes anything (I5). Copy destinations are the request's own holes; the
forward reads them only after the copy (I3). A block densify writes into loses its prefix-cache hash
before schedule k can hand it out (``manager_hooks.uncache``).
"""

from __future__ import annotations

import importlib.util
import time
from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorWorkerMetadata)
from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.worker.cpu_worker import CPUWorker

from vtoken.core.errors import ConfigError, InvariantViolation

from ..device.copy_engine import TorchCopyEngine
from ..device.verify import Verifier, VerifyConfig
from .scheduler_tokens import SchedulerTokens, StepOrders
from .worker_copies import ShardReports
from .settings import VTokenSettings

logger = init_logger("vllm.vtoken")  # under "vllm": its handlers print it, as they print vLLM's own lines


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


class WiringError(ConfigError):
    """vtoken's KV connector runs without vtoken's scheduler or worker class (``plugin.install_connector`` sets
    both; a ``kv_transfer_config`` naming the connector by hand does not)."""


POOL_CHECK_EVERY = 64  # strict verify walks vLLM's whole pool (P1) and checks every prefix-cached block against
# its request's hash chain (B3) once per this many steps; B1, B2 and I7 run every step


@dataclass
class VTokenMeta(KVConnectorMetadata):
    step: int
    orders: StepOrders = field(default_factory=StepOrders)


@dataclass
class VTokenWorkerMeta(KVConnectorWorkerMetadata):
    done: list[int] = field(default_factory=list)  # copy handles finished and verified per settings
    failed: list[int] = field(default_factory=list)  # copy handles whose verification failed (quarantine)
    verified: int = 0  # token relocations hashed and compared
    mismatches: int = 0
    audited: int = 0  # write slots checked against the scheduler's token tables
    seconds: float = 0.0  # worker-side time in vtoken
    victims: dict = field(default_factory=dict)  # request -> victims ranked on the worker: H2O / Scissorhands
    scored: int = 0  # attention rows recorded into the workers' scores this step
    attention: dict = field(default_factory=dict)  # strict verify: request -> (token ids, weights), the reference's
    verified_by_rank: dict = field(default_factory=dict)  # tensor parallelism: rank -> relocations it verified
    key_norms: dict = field(default_factory=dict)  # strict verify, Knorm: request -> (token ids, key norms)
    observed: dict = field(default_factory=dict)  # strict verify, SnapKV: request -> (token ids, votes)

    def aggregate(self, other: VTokenWorkerMeta) -> VTokenWorkerMeta:
        """Two ranks' reports as one (vLLM's ``KVOutputAggregator`` folds every rank's, in rank order). Copies are
        listed once per rank (``ShardReports`` settles them); verification counts add up, one per shard; the
        victims every rank ranked from the same all-reduced scores must agree.
        raises: InvariantViolation (TP1) when two ranks ranked different victims for a request."""
        for r in self.victims.keys() & other.victims.keys():
            if self.victims[r] != other.victims[r]:
                raise InvariantViolation("TP1", f"request {r!r}: two ranks ranked different victims "
                                                f"({self.victims[r][:8]}... and {other.victims[r][:8]}...)")
        by_rank = dict(Counter(self.verified_by_rank) + Counter(other.verified_by_rank))
        return VTokenWorkerMeta(self.done + other.done, self.failed + other.failed, self.verified + other.verified,
                                self.mismatches + other.mismatches, self.audited + other.audited,
                                max(self.seconds, other.seconds), {**self.victims, **other.victims},
                                max(self.scored, other.scored), {**self.attention, **other.attention}, by_rank,
                                {**self.key_norms, **other.key_norms}, {**self.observed, **other.observed})


@dataclass
class WorkerCounters:
    """What the workers reported, summed on the scheduler side."""

    verified: int = 0
    mismatches: int = 0
    audited: int = 0
    quarantined: int = 0
    seconds: float = 0.0
    verified_by_rank: dict = field(default_factory=dict)  # tensor parallelism: each rank's share of ``verified``


class VTokenConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = VTokenSettings.from_additional_config(vllm_config.additional_config) or VTokenSettings()
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.step = 0
        self.tokens: SchedulerTokens | None = None  # scheduler side
        self.scheduler: Scheduler | None = None  # scheduler side: bound by ``VTokenScheduler``
        self.quarantined: list[str] = []  # requests quarantine failed, each once, in order
        self.workers = WorkerCounters()
        # NOTE: one scheduler, every tensor-parallel rank a worker; each reports every copy it ran on its shard
        self.shards = ShardReports(vllm_config.parallel_config.tensor_parallel_size)
        self.worker = None  # WorkerTokens, worker side
        self.engine: TorchCopyEngine | None = None
        self.tp_group = None  # worker side: the tensor-parallel group (None without tensor parallelism)
        self.rank: int | None = None  # worker side: its rank in that group
        self._reported = VTokenWorkerMeta()

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ---- scheduler side ----------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        c = self.vllm_config
        self.tokens = SchedulerTokens(self.settings, kv_cache_manager, self.block_size,
                                      (c.scheduler_config.max_num_seqs, c.model_config.max_model_len))
        logger.info("vtoken: %s", self.tokens.runtime_note)

    def bind_scheduler(self, scheduler) -> None:
        """``VTokenScheduler.__init__``, right after vLLM's (which built this connector and bound the manager)."""
        if not isinstance(scheduler, Scheduler):
            raise WiringError(f"vtoken needs vLLM's Scheduler (v1/core/sched/scheduler.py), got "
                              f"{type(scheduler).__name__}")
        if self.tokens is None:
            raise WiringError("bind_scheduler before bind_kv_cache_manager: vLLM's Scheduler binds the KV cache "
                              "manager in its constructor")
        self.scheduler = scheduler
        self.tokens.scheduler = scheduler

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> VTokenMeta:
        if self.scheduler is None:
            raise WiringError(f"vtoken's connector runs under a scheduler that did not bind itself: set "
                              f"scheduler_cls={SCHEDULER_CLS!r} (the vtoken plugin does, given "
                              f"additional_config={{'vtoken': {{...}}}})")
        self.step += 1
        every = self.settings.drill_every
        drill = self.step // every if every and self.step % every == 0 else None
        return VTokenMeta(self.step, self.tokens.on_schedule(scheduler_output, drill))

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, VTokenWorkerMeta):
            t0 = time.perf_counter()
            corrupted = self.tokens.on_reports(*self.shards.settle(meta.done, meta.failed))
            self.tokens.stats.seconds += time.perf_counter() - t0  # vtoken's, as ``on_schedule`` and ``after_step``
            if corrupted:
                self.fail_requests(corrupted)
            w = self.workers
            w.verified += meta.verified
            w.mismatches += meta.mismatches
            w.audited += meta.audited
            w.seconds += meta.seconds
            w.verified_by_rank = dict(Counter(w.verified_by_rank) + Counter(meta.verified_by_rank))
        if isinstance(meta, VTokenWorkerMeta):
            self.tokens.after_step(meta.attention, meta.victims, meta.scored, meta.key_norms, meta.observed)
        else:
            self.tokens.after_step()
        if self.settings.strict_verify == "strict":
            periodic = self.step % POOL_CHECK_EVERY == 0  # O(pool) and O(hashed blocks x S): not every step
            self.tokens.check(pool=periodic, requests=self.scheduler.requests if periodic else None)

    def quarantine_before_outputs(self, model_runner_output) -> list[str]:
        """``VTokenScheduler.update_from_output``, before vLLM builds the step's outputs: the requests whose
        copies failed verification in this step lose what this step computed for them (sampled tokens, prompt
        logprobs: their forward read the unverified K/V) and are failed in this same ``update_from_output``.
        Returns the requests failed now."""
        kv = model_runner_output.kv_connector_output
        meta = kv.kv_connector_worker_meta if kv is not None else None
        if not isinstance(meta, VTokenWorkerMeta) or not meta.failed:
            return []
        failed = self.fail_requests([self.tokens.engine.request_of(h) for h in meta.failed])
        out = model_runner_output
        index = out.req_id_to_index
        drop = {index[r] for r in failed if r in index}
        if drop and out.sampled_token_ids:
            out.sampled_token_ids = [[] if i in drop else ids for i, ids in enumerate(out.sampled_token_ids)]
        for r in failed:
            out.prompt_logprobs_dict.pop(r, None)
            out.prompt_token_id_logprobs_dict.pop(r, None)
        return failed

    def fail_requests(self, req_ids: list[str]) -> list[str]:
        """Quarantine: end these requests with an error in the current ``update_from_output``, which sends the
        client a FINISHED_ERROR output; every other request keeps running. vLLM 0.32 has no connector API
        for this; ``v1/core/sched/scheduler.py`` fails the requests in ``grammar_compile_error_reqs`` that
        way, with no other effect, so vtoken adds its own there. Counts requests, not failures: a request
        with several failed copies, or reported again after vLLM ended it, is failed and counted once.
        Returns the requests newly failed."""
        requests, pending = self.scheduler.requests, self.scheduler.grammar_compile_error_reqs
        new = [r for r in dict.fromkeys(req_ids) if r in requests and not requests[r].is_finished() and r not in pending]
        self.quarantined.extend(new)
        self.workers.quarantined += len(new)
        for r in new:
            self.tokens.uncache_request(r)
        self.scheduler.grammar_compile_error_reqs.update(new)
        return new

    def get_kv_connector_stats(self):
        """vtoken's counters for vLLM's stats logging and Prometheus (``metrics.py``); scheduler side only."""
        if self.tokens is None:
            return None
        from .metrics import VTokenStats
        t0 = time.perf_counter()
        data = self.tokens.metrics(self.workers)
        self.tokens.stats.seconds += time.perf_counter() - t0  # vtoken's: vLLM asks every step it logs stats
        return VTokenStats(data=data)

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
        """The KV tensors (``GPUModelRunner.initialize_kv_cache``); the runner itself follows in
        ``bind_model_runner``."""
        from .kv_bridge import paged_cache

        match_threads_to_cores()
        cache = paged_cache(kv_caches, self.vllm_config)
        s = self.settings
        self.tp_group = _tp_group(self.vllm_config)
        self.rank = None if self.tp_group is None else self.tp_group.rank_in_group
        # the compiled relocation (any read path, policy or rank count): numba's on a CPU cache, Triton's on a GPU;
        # torch's otherwise, the reference
        mover, triton = None, False
        if s.fast_path and cache.device.type == "cuda":
            triton = importlib.util.find_spec("triton") is not None
            if not triton:
                logger.warning("vtoken: tokens move with torch's gather and scatter: Triton is not installed")
        elif s.fast_path:
            from vtoken.integration.fastpath import unavailable
            if unavailable() is None:
                from vtoken.integration.fastpath.relocate import host_mover
                mover = host_mover(cache)
        verifier = Verifier(cache, VerifyConfig(s.strict_verify, sample_every=s.sample_every, on_mismatch=s.on_mismatch,
                                                evidence_dir=s.evidence_dir, seed=s.seed), rank=self.rank)
        try:
            self.engine = TorchCopyEngine(cache, verifier, mover=mover, triton=triton)
        except Exception as e:  # NOTE: the kernels compile at their first launch, in the engine's warm-up
            if not triton:
                raise
            logger.warning("vtoken: tokens move with torch's gather and scatter: the Triton kernels failed to "
                           "build (%s: %s)", type(e).__name__, e)
            self.engine = TorchCopyEngine(cache, verifier, mover=mover)
        self._layer_names = list(kv_caches)

    def bind_model_runner(self, runner) -> None:
        """``VTokenCPUWorker.initialize_from_config``, after vLLM's (which registered the KV caches)."""
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from .settings import SCORE_POLICIES, observation_of, statistics_of
        from .worker_tokens import WorkerTokens

        if not isinstance(runner, GPUModelRunner):
            raise WiringError(f"vtoken needs vLLM's V1 model runner (v1/worker/gpu_model_runner.py), got "
                              f"{type(runner).__name__}")
        if runner.vllm_config is not self.vllm_config:
            # NOTE: vLLM keeps a process's first KV connector agent (ensure_kv_transfer_initialized returns early
            # while one exists), so an engine started while an earlier one in this process is still alive would
            # run with the earlier engine's vtoken settings: refuse, naming the fix
            raise WiringError("the worker's vtoken connector belongs to an earlier engine in this process, still "
                              "alive (vLLM keeps the first KV connector agent): shut that engine down first "
                              "(llm.llm_engine.engine_core.shutdown(), or drop every reference to it)")
        if self.engine is None:
            raise WiringError("bind_model_runner before register_kv_caches: vLLM registers the KV caches in "
                              "initialize_kv_cache")
        s = self.settings
        layers = sorted(self._layer_names, key=extract_layer_index)  # the model's attention layers, in order
        scored = frozenset(layers[-s.score_layers:] if s.score_layers else layers) if s.policy in SCORE_POLICIES \
            else frozenset()
        self.worker = WorkerTokens(runner, self.engine, self.block_size, scored,
                                   check_attention=s.strict_verify == "strict", tp_group=self.tp_group,
                                   statistics=statistics_of(s.policy), gather=s.read_path == "gather",
                                   head_size=runner.model_config.get_head_size(),
                                   observation=observation_of(s.policy))

    def _worker(self):
        if self.worker is None:
            raise WiringError(f"vtoken's connector runs in a worker that did not bind its model runner: set "
                              f"worker_cls={WORKER_CLS!r} (the vtoken plugin does, given "
                              f"additional_config={{'vtoken': {{...}}}})")
        return self.worker

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if isinstance(kv_connector_metadata, VTokenMeta):
            self._worker().apply(kv_connector_metadata.orders)

    def build_connector_worker_meta(self) -> VTokenWorkerMeta | None:
        w, c = self._worker(), self.engine.verifier.counters
        done, failed = w.take_reports()
        victims, rows, scored, keys, observed = w.take_scores() if w.scores is not None else ({}, {}, 0, {}, {})
        now = VTokenWorkerMeta(done, failed, c.verified, c.mismatches, w.audited, w.seconds)
        last, self._reported = self._reported, now
        delta = VTokenWorkerMeta(done, failed, now.verified - last.verified, now.mismatches - last.mismatches,
                                 now.audited - last.audited, now.seconds - last.seconds, victims, scored, rows,
                                 key_norms=keys, observed=observed)
        if self.rank is not None and delta.verified:
            delta.verified_by_rank = {self.rank: delta.verified}
        if not (done or failed or delta.verified or delta.mismatches or delta.audited or delta.seconds or victims
                or scored or keys or observed):
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


def _tp_group(vllm_config):
    """This worker's tensor-parallel group (``distributed/parallel_state.py``: its ``rank_in_group``, and the ranks
    whose attention rows make one score row), None without tensor parallelism."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return None
    from vllm.distributed import get_tp_group
    return get_tp_group()


# ---- the two classes that wire the connector (installed by ``plugin.install_connector``) ----------------------
SCHEDULER_CLS = f"{__name__}.VTokenScheduler"
WORKER_CLS = f"{__name__}.VTokenCPUWorker"


class VTokenScheduler(Scheduler):
    """vLLM's scheduler, unchanged except that it hands itself to vtoken's connector once built, and lets the
    connector quarantine before each step's outputs are built (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.connector, VTokenConnector):
            raise WiringError(f"{type(self).__name__} is vtoken's scheduler; its KV connector is "
                              f"{type(self.connector).__name__}, not VTokenConnector")
        self.connector.bind_scheduler(self)

    def update_from_output(self, scheduler_output, model_runner_output):
        self.connector.quarantine_before_outputs(model_runner_output)
        return super().update_from_output(scheduler_output, model_runner_output)


class VTokenCPUWorker(CPUWorker):
    """vLLM's CPU worker, unchanged except that it hands its model runner to vtoken's connector once the KV
    caches exist (module docstring)."""

    def initialize_from_config(self, kv_cache_config) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        super().initialize_from_config(kv_cache_config)
        connector = get_kv_transfer_group() if has_kv_transfer_group() else None
        if not isinstance(connector, VTokenConnector):
            raise WiringError(f"{type(self).__name__} is vtoken's worker; its KV connector is "
                              f"{type(connector).__name__}, not VTokenConnector")
        connector.bind_model_runner(self.model_runner)
