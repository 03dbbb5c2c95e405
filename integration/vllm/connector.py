"""``VTokenConnector``: vtoken's channel between vLLM's scheduler and its workers (a KV connector).

vLLM 0.32 has no way to replace a block id in the middle of a running request; a KV connector gives
vtoken a hook on each side of every step. This module is the one place that touches vLLM's
private state; each touch names its vLLM file:

  scheduler side  ``bind_kv_cache_manager``: the ``KVCacheManager``; a request's blocks are
                  ``coordinator.single_type_managers[0].req_to_blocks[req_id]``
                  (``v1/core/single_type_kv_cache_manager.py``), allocated from and freed to vLLM's
                  ``BlockPool`` through ``VllmBlockAllocator``.
                  ``build_connector_meta`` runs after the step's allocation (``v1/core/sched/scheduler.py``):
                  relocations planned there travel to the workers in ``SchedulerOutput``.
  worker side     ``register_kv_caches``: every layer's KV tensor; its caller is the model runner
                  (``v1/worker/gpu_model_runner.py``, asserted). ``handle_preemptions`` runs at the top of
                  ``execute_model``, before ``_update_states`` and ``_prepare_inputs``: vtoken copies the
                  blocks there (device layer, strict verify), then rewrites the request's block id in
                  ``runner.requests[r].block_ids`` and in the ``input_batch.block_table`` row
                  (``v1/worker/block_table.py``), so the step's attention and writes use the new block.

Order within a step (no async scheduling, which ``compat`` refuses): the scheduler swaps block i of
request r from ``old`` to ``new`` and frees ``old`` in ``build_connector_meta``; vLLM cannot hand
``old`` out again before its next ``schedule()``, which comes after this step's ``execute_model``,
whose first act is the copy. So the copy reads ``old`` before anything can reuse it (I5), and the
forward reads ``new`` only after the copy (I3).

Implemented so far (issue #6 in progress): the relocation path with strict verify, driven by the
relocation drill (``drill_every``). Eviction policies and ``densify`` come next; ``plugin`` refuses
them at start-up until then.
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorWorkerMetadata)

from vtoken.core.block_pool import Purpose
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.token_table import Move

from ..copy_engine import TorchCopyEngine
from ..verify import Verifier, VerifyConfig
from .allocator import VllmBlockAllocator
from .settings import VTokenSettings

Relocation = tuple[str, int, int, int]


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
        torch._C.set_num_threads(cores)  # (request, index in its block list, old block, new block)


@dataclass
class VTokenMeta(KVConnectorMetadata):
    step: int
    relocations: list[Relocation] = field(default_factory=list)


@dataclass
class VTokenWorkerMeta(KVConnectorWorkerMetadata):
    relocated: int = 0
    verified: int = 0
    mismatches: int = 0

    def aggregate(self, other: VTokenWorkerMeta) -> VTokenWorkerMeta:
        return VTokenWorkerMeta(self.relocated + other.relocated, self.verified + other.verified,
                                self.mismatches + other.mismatches)


@dataclass
class SchedulerStats:
    steps: int = 0
    planned: int = 0  # relocations sent to the workers
    skipped: int = 0  # blocks the drill could not move (shared, hashed, or new this step)
    relocated: int = 0  # reported done by the workers
    verified: int = 0
    mismatches: int = 0


class VTokenConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = VTokenSettings.from_additional_config(vllm_config.additional_config) or VTokenSettings()
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.step = 0
        self.stats = SchedulerStats()
        self.allocator: VllmBlockAllocator | None = None
        self.runner = None
        self.engine: TorchCopyEngine | None = None
        self._done = VTokenWorkerMeta()
        self.moved: Counter = Counter()  # (request, block index) -> relocations (worker side)
        self.tail_moves = 0

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ---- scheduler side ----------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.allocator = VllmBlockAllocator(kv_cache_manager.block_pool, self.block_size)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> VTokenMeta:
        self.step += 1
        self.stats.steps += 1
        relocations = []
        every = self.settings.drill_every
        if every and self.step % every == 0:
            relocations = self._drill(scheduler_output, self.step // every)
        self.stats.planned += len(relocations)
        return VTokenMeta(self.step, relocations)

    def _drill(self, so, round_no: int) -> list[Relocation]:
        """Relocate one block of every running request: block ``round_no mod n`` of its n written blocks, so
        over rounds every block moves, the tail block (still being written) included, and blocks move twice."""
        manager = self._kv_cache_manager.coordinator.single_type_managers[0]
        cached = so.scheduled_cached_reqs
        out = []
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if rid in cached.resumed_req_ids:
                continue
            blocks = manager.req_to_blocks[rid]
            written = len(blocks) - (len(new_ids[0]) if new_ids else 0)  # the worker does not know new ones yet
            if written <= 0:
                continue
            i = round_no % written
            old = blocks[i]
            if old.is_null or old.ref_cnt != 1 or old.block_hash is not None:
                self.stats.skipped += 1  # shared or prefix-cached: never relocated
                continue
            [new_id] = self.allocator.allocate(1, Purpose.EVACUATION)
            blocks[i] = self.allocator.pool.blocks[new_id]
            self.allocator.free([old.block_id])
            out.append((rid, i, old.block_id, new_id))
        return out

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, VTokenWorkerMeta):
            self.stats.relocated += meta.relocated
            self.stats.verified += meta.verified
            self.stats.mismatches += meta.mismatches

    def request_finished(self, request, block_ids):
        return False, None

    # ---- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from .kv_bridge import paged_cache

        runner = inspect.currentframe().f_back.f_locals.get("self")
        assert isinstance(runner, GPUModelRunner), f"register_kv_caches called by {type(runner).__name__}"
        self.runner = runner
        match_threads_to_cores()
        cache = paged_cache(kv_caches, self.vllm_config)
        s = self.settings
        self.engine = TorchCopyEngine(cache, Verifier(cache, VerifyConfig(
            s.strict_verify, sample_every=s.sample_every, on_mismatch=s.on_mismatch,
            evidence_dir=s.evidence_dir, seed=s.seed)))

    def handle_preemptions(self, kv_connector_metadata) -> None:
        meta = kv_connector_metadata
        if not isinstance(meta, VTokenMeta) or not meta.relocations:
            return
        counters = self.engine.verifier.counters
        verified, mismatches = counters.verified, counters.mismatches
        for rid, i, old, new in meta.relocations:
            self._copy_block(rid, old, new)
            self._rewrite_block_table(rid, i, old, new)
        self._done = VTokenWorkerMeta(self._done.relocated + len(meta.relocations),
                                      self._done.verified + counters.verified - verified,
                                      self._done.mismatches + counters.mismatches - mismatches)

    def _copy_block(self, rid: str, old: int, new: int) -> None:
        """Every slot of ``old`` to the same offset of ``new``, all layers, K and V; verified per settings."""
        moves = [Move(o, old, o, new, o) for o in range(self.block_size)]
        h = self.engine.submit(moves, req_id=rid)
        status = self.engine.wait(h)  # CPU: already done; RelocationMismatch raises here under "raise"
        assert status is CopyStatus.DONE, f"relocation of request {rid!r} block {old} -> {new}: {status.value}"
        self.engine.release(h)

    def _rewrite_block_table(self, rid: str, i: int, old: int, new: int) -> None:
        r = self.runner
        ids = r.requests[rid].block_ids[0]
        assert ids[i] == old, f"worker has block {ids[i]} at index {i} of {rid!r}, scheduler moved {old}"
        ids[i] = new
        self.moved[(rid, i)] += 1
        self.tail_moves += i == len(ids) - 1  # the block this step's new tokens are written into
        row = r.input_batch.req_id_to_index.get(rid)
        if row is not None:  # a request not in the batch rebuilds its row from block_ids when it returns
            table = r.input_batch.block_table[0].block_table.np
            assert table[row, i] == old
            table[row, i] = new

    def build_connector_worker_meta(self) -> VTokenWorkerMeta | None:
        if not self._done.relocated:
            return None  # nothing to report: no per-step traffic
        done, self._done = self._done, VTokenWorkerMeta()
        return done

    # the KV-transfer hooks vtoken does not use
    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
