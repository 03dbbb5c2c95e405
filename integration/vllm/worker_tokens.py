"""``WorkerTokens``: the worker half of vtoken inside vLLM (one per worker process).

Touch points, each named with its vLLM 0.32 file:
  ``v1/worker/gpu_model_runner.py``  ``runner.requests[r].block_ids``, ``runner.input_batch`` and the
        ``_prepare_inputs`` method, wrapped on the runner instance: while it runs, its one call of the batch's
        ``compute_slot_mapping`` is handed ``positions - gap`` (each request's ``gap``), so the write slots are
        the table's; afterwards vtoken lowers ``seq_lens`` (and the CPU-side upper bound) by the gaps.
        ``positions`` stay logical, so RoPE sees the true positions.
  ``v1/worker/block_table.py``  ``BlockTable.add_row`` and ``MultiGroupBlockTable.compute_slot_mapping``,
        ``slot_mapping``.

Per step (``apply``, called from ``handle_preemptions``, before ``_update_states``):
  1. run the copies the scheduler planned after the previous forward, all requests' as one batch (device layer,
     ``run_batch``; verified per ``strict_verify``); a copy whose verification fails is reported FAILED;
  2. install the block lists those copies changed (the worker's list and the block-table row);
  3. remember the step's gaps (and, under strict verify, the table's write slots to audit);
  4. patch the read lists of the step's requests (gather path, score policies: evictions, a commit's moves,
     appends), kept in one table (``ReadTable``), by the step's changes (``StepReads``) in one kernel call: only a
     first step or a log overflow resends a list whole; strict verify sends them whole every ``READ_CHECK_EVERY``
     steps to check the copy. Score policies' statistics (``DeviceScores``) are aligned with the read lists and
     patched with them;
  5. after the forward (``take_scores``): record the step's attention rows into those statistics, the key norms
     of the tokens that joined the read lists (Knorm: read from the KV cache, where the forward wrote them) and
     the votes of the prompts that completed (SnapKV: their observation windows), and rank the victims the
     scheduler asked for (``StepOrders.rank``); only the victims go back (and, under strict verify, the rows, norms
     and votes, for the scheduler's reference scores).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from vtoken.core.copy_engine import CopyStatus
from vtoken.core.errors import InvariantViolation
from vtoken.core.scores import ROW_STATISTICS

from ..device.copy_engine import TorchCopyEngine
from ..device.scores import DeviceScores
from ..fastpath import available as compiled_kernels
from ..fastpath import reads as R
from ..fastpath.moves import SentCopies
from .compat import UnsupportedConfigError


# Prompt tokens of a prompt longer than this are attended in torch (gather_attention.prefill_attention): its
# queries share one K/V read and BLAS products there, which beat the kernel's one query at a time (64 x 64 query-key
# pairs is where they cross on the byte-llama: `git show 67c0072:docs/results.md`, "Hot path II, part 4"). Every
# other query, every generated token included, goes to the kernel.
LONG_PROMPT = 64
# Of those, the prompt tokens of a prompt longer than this go to torch's fused attention
# (gather_attention.prefill_attention), the others to the reference: the fused path's aligned shapes (256-query
# blocks, keys padded to 512) cost more than they save below ~200 tokens (1.5 against 0.4 ms a layer at 65 tokens,
# 1.7 against 2.1 at 256, 24 against 73 at 1,536: `git show 67c0072:docs/results.md`, "Hot path II, part 7").
FUSED_PROMPT = 256


def _places(ids: np.ndarray, wanted: np.ndarray) -> np.ndarray | None:
    """Where each of ``wanted`` lies in the ascending ``ids``, or None when one is not there."""
    at = np.searchsorted(ids, wanted)
    if len(wanted) and (int(at.max()) >= len(ids) or not np.array_equal(ids[at], wanted)):
        return None
    return at


@dataclass
class ReadPlan:
    """What attention reads this step (the gather path, and the dense path's score pass): each request's live
    slots and their logical ids in logical order, padded into one batch (rows in batch order), and each of the
    step's query tokens' request and logical position. One attention call per layer covers every query."""
    cache: object  # PagedKVCache
    slots: torch.Tensor  # int64 [R, N]: live slots in logical order, padded with slot 0
    ids: torch.Tensor  # int64 [R, N]: their logical ids, padded with PAD (never attended)
    query_request: torch.Tensor  # int64 [T]: each query token's request (row)
    query_pos: torch.Tensor  # int64 [T]: its logical position; it attends the ids at or before it
    newest: torch.Tensor  # int64 [R]: each request's newest query token, whose attention feeds the scores
    in_torch: torch.Tensor  # bool [T]: the queries torch attends (prompt tokens of long prompts), not the kernel
    fused: torch.Tensor  # bool [T]: of those, the ones its fused attention attends (prompts past FUSED_PROMPT)
    req_ids: list  # batch order
    rows: torch.Tensor | None = None  # score-based policies: [R, N] float64, attention summed over scored layers
    scored_layers: frozenset = frozenset()  # names of the layers whose attention feeds the rows
    layers: int = 0
    check: bool = False  # strict verify: the kernel's attention against the reference (V5)
    # SnapKV: the queries of the observation windows of the prompts that complete in this step (indices into the
    # step's queries), and their rows summed into each request's votes [R, N] float64 over scored layers
    window: torch.Tensor | None = None
    votes: torch.Tensor | None = None
    vote_layers: int = 0

    def scores(self, layer_name: str) -> bool:
        return self.rows is not None and layer_name in self.scored_layers

    def observes(self, layer_name: str) -> bool:
        return self.votes is not None and layer_name in self.scored_layers

    def weights_of(self, layer_name: str) -> torch.Tensor | None:
        """The queries whose weights this layer records: each request's newest (rows), then the windows' (votes)."""
        parts = [p for p, on in ((self.newest, self.scores(layer_name)), (self.window, self.observes(layer_name)))
                 if on]
        return None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)

    def record(self, layer_name: str, w: torch.Tensor) -> None:
        """This layer's weights ``[len(weights_of), H, N]``, mean over heads, into the rows and the votes."""
        if self.scores(layer_name):
            self.rows += w[: len(self.newest)].mean(dim=1).to(torch.float64)
            w = w[len(self.newest):]
            self.layers += 1
        if self.observes(layer_name):
            self.votes.index_add_(0, self.query_request[self.window], w.mean(dim=1).to(torch.float64))
            self.vote_layers += 1


class WorkerTokens:
    def __init__(self, runner, engine: TorchCopyEngine, block_size: int,
                 scored_layers: frozenset = frozenset(), check_attention: bool = False, tp_group=None,
                 statistics: tuple[str, ...] = ("accumulated", "persistence"), gather: bool = True,
                 head_size: int | None = None, observation: tuple[int, int] | None = None) -> None:
        groups = len(runner.input_batch.block_table.block_tables)
        if groups != 1:
            raise UnsupportedConfigError(f"vtoken supports one KV cache group (full attention); this model has "
                                         f"{groups}")
        self.runner = runner
        self.engine = engine
        self.scored_layers = scored_layers  # score policies: the layers whose attention rows or keys are recorded
        # what the policy reads: attention rows (H2O, Scissorhands, TOVA) and/or key norms (Knorm)
        self.attention_rows = bool(scored_layers) and bool(set(statistics) & set(ROW_STATISTICS))
        self.key_layers = sorted(scored_layers) if "key_norm" in statistics else []
        self.head_size = head_size
        self.observation = observation if scored_layers else None  # SnapKV: (window, kernel)
        # attention reads through the lists: gather, the score pass
        self.plan_reads = gather or self.attention_rows or self.observation is not None
        self.check_attention = check_attention  # strict verify: V5 on every attention the kernel computes
        # tensor parallelism: each rank attends with its own heads, so a step's rows are summed over the ranks
        # (``take_scores``) and every rank records, and ranks victims from, the mean over all heads
        self.tp_group = tp_group
        self.block_size = block_size
        self.gaps: dict[str, int] = {}
        # NOTE: every request's read list (live slots, their token ids, logical order) and the layout version it is
        # at, one row of a table, patched by the scheduler's per-step changes (``StepReads``) in one call, never
        # resent whole except on a first step or a log overflow: the paper's lookup cache (§3.2). numpy arrays in
        # host memory, which is the device's on vLLM's CPU backend (``_patch_reads``' NOTE); a CUDA port would keep
        # them on the device, where a patch is one launch for the whole batch
        self.reads = R.ReadTable(compiled=compiled_kernels())  # NOTE: padded with R.PAD, attention's PAD
        self.reading = False  # this step's orders carried read lists: attention reads through them
        # score policies: per-request statistics aligned with the read lists, and this step's rankings to run
        self.scores = DeviceScores(statistics=tuple(statistics)) if scored_layers else None
        self.unkeyed: dict[str, list[np.ndarray]] = {}  # Knorm: ids whose key norms the next take_scores reads
        self.ranks: dict = {}
        self.send_rows = False  # strict verify: the rows travel too, for the scheduler's reference scores
        self.read_plan: ReadPlan | None = None  # gather read path: what attention reads this step
        self.audit: dict[str, list[int]] = {}
        self.done: list[int] = []
        self.failed: list[int] = []
        self.audited = 0  # write slots checked against the scheduler's tables
        self.seconds = 0.0  # worker-side time spent in vtoken (copies, verification, slot mapping, audit)
        self._wrap_prepare_inputs()

    # ---- handle_preemptions ------------------------------------------------------------------
    def apply(self, orders) -> None:
        t0 = time.perf_counter()
        # NOTE: one batch for the step's copies, every request's (as few launches as their order allows, one
        # digest pass, one read-back); each copy still settles on its own, so a mismatch fails its request only
        # (under "raise" ``run_batch`` raises RelocationMismatch)
        copies = orders.copies
        if copies:
            if copies.__class__ is SentCopies:  # the fast path's step: one record
                handles, statuses = copies.handles, self.engine.run_batch(copies.copies)
            else:
                handles, statuses = [h for h, _, _ in copies], self.engine.run_batch([(m, r) for _, r, m in copies])
            if statuses.count(CopyStatus.DONE) == len(statuses):
                self.done += handles
            else:
                for handle, status in zip(handles, statuses):
                    (self.done if status is CopyStatus.DONE else self.failed).append(handle)
        for rid, blocks in orders.layouts.items():
            self._install_layout(rid, blocks)
        self.gaps = orders.gaps
        self.audit = orders.write_slots
        for rid in orders.forget:
            self.reads.forget(rid)
            self.unkeyed.pop(rid, None)
            if self.scores is not None:
                self.scores.drop(rid)
        self.ranks, self.send_rows = orders.rank, orders.rows
        self.reading = orders.reads is not None and len(orders.reads) > 0
        if self.reading:
            self._patch_reads(orders.reads)
        self.seconds += time.perf_counter() - t0

    def _patch_reads(self, reads: R.StepReads) -> None:
        """Patch the step's requests' read lists by their changes (``ReadTable.apply``: one kernel call, checked: a
        change must find the copy at its version, and every evicted and moved id in it), and the score policies'
        statistics with them.

        NOTE: the lists are numpy arrays, not tensors: numpy's cost per operation here is a third of torch's (`git
        show 67c0072:docs/results.md`, "Hot path II, part 5"); attention and the scores read them through
        ``torch.from_numpy``, which copies nothing. Ids ascend (a full list is in logical order, evictions keep it,
        joined tokens are newer than every other, moves change slots only), so every id is found by binary search."""
        scores, table = self.scores, self.reads
        replaced = {}
        if scores is not None:  # each token of a list resent whole keeps its scores, found by id
            replaced = {rid: table.lists(rid)[1].copy() for rid, whole in zip(reads.req_ids, reads.whole.tolist())
                        if whole == R.REPLACE and rid in table}
        removed = table.apply(reads)
        if scores is None:
            return
        for i, (rid, whole) in enumerate(zip(reads.req_ids, reads.whole.tolist())):
            ids = table.lists(rid)[1].copy()  # NOTE: copies: the table's rows change with the next patch
            if whole == R.REPLACE:
                old = replaced.get(rid)
                scores.realign(rid, None if old is None else torch.from_numpy(old), torch.from_numpy(ids))
                if self.key_layers:  # every key norm again: read from the cache, they are what they were
                    self.unkeyed[rid] = [ids]
                continue
            (a, b), (j, k) = reads.evicted_at[i:i + 2].tolist(), reads.joined_at[i:i + 2].tolist()
            if b > a:
                keep = np.ones(len(ids) - (k - j) + (b - a), dtype=bool)
                keep[removed[a:b]] = False
                scores.keep(rid, torch.from_numpy(keep))
            if k > j:
                scores.extend(rid, k - j)
                if self.key_layers:
                    self.unkeyed.setdefault(rid, []).append(ids[len(ids) - (k - j):])

    def _install_layout(self, rid: str, blocks: list[int]) -> None:
        r = self.runner
        ids = r.requests[rid].block_ids[0]
        ids[:] = blocks
        row = r.input_batch.req_id_to_index.get(rid)
        if row is not None:  # not in the batch: its row is rebuilt from block_ids when it returns
            r.input_batch.block_table[0].add_row(list(blocks), row)

    # ---- slot mapping through the table (dense read path); what attention reads (gather, scores) ----------------------------------------
    def _wrap_prepare_inputs(self) -> None:
        runner = self.runner
        prepare_inputs = runner._prepare_inputs

        def _prepare_inputs(scheduler_output, num_scheduled_tokens):
            if not self.gaps:
                out = prepare_inputs(scheduler_output, num_scheduled_tokens)
                t0 = time.perf_counter()
            else:
                # NOTE: vLLM computes the step's slot mapping inside ``_prepare_inputs`` from its logical positions
                # (which RoPE keeps reading); for that one call it is handed the physical ones instead, so the slots
                # are the token table's and vLLM computes them once (``_physical_positions``)
                t0 = time.perf_counter()
                gap = self._step_gaps()  # NOTE: vLLM's batch is this step's (``_update_states`` ran before)
                tables = runner.input_batch.block_table
                compute = tables.compute_slot_mapping
                tables.compute_slot_mapping = lambda num_reqs, query_start_loc, positions: compute(
                    num_reqs, query_start_loc, self._physical_positions(positions, gap))
                self.seconds += time.perf_counter() - t0
                try:
                    out = prepare_inputs(scheduler_output, num_scheduled_tokens)
                finally:
                    del tables.compute_slot_mapping
                t0 = time.perf_counter()
                self._map_through_table(gap)
            if self.audit:
                self._audit(scheduler_output.total_num_scheduled_tokens)
            self.read_plan = self._read_plan(scheduler_output.total_num_scheduled_tokens) \
                if self.reading and self.plan_reads else None
            self.seconds += time.perf_counter() - t0
            return out

        runner._prepare_inputs = _prepare_inputs

    def _step_gaps(self) -> np.ndarray:
        """Each batch row's gap this step (``orders.gaps``; 0 for a request without one)."""
        batch = self.runner.input_batch
        gap = np.zeros(batch.num_reqs, dtype=np.int64)
        for rid, g in self.gaps.items():
            gap[batch.req_id_to_index[rid]] = g
        return gap

    def _physical_positions(self, positions: torch.Tensor, gap: np.ndarray) -> torch.Tensor:
        """The step's query positions less their requests' gaps: where the table writes each token. Timed as vtoken's,
        though vLLM calls it (the slot mapping it then computes is vLLM's own work, done once)."""
        t0 = time.perf_counter()
        per_token = torch.from_numpy(gap[self.runner.req_indices.np[:positions.shape[0]]]).to(positions.device)
        physical = positions - per_token
        self.seconds += time.perf_counter() - t0
        return physical

    def _map_through_table(self, gap: np.ndarray) -> None:
        """After vLLM prepared the step: its sequence lengths less the gaps (attention reads n_live tokens)."""
        r = self.runner
        n = len(gap)
        gap_t = torch.from_numpy(gap)
        r.seq_lens[:n] -= gap_t.to(r.seq_lens.device, r.seq_lens.dtype)
        r.optimistic_seq_lens_cpu[:n] -= gap_t.to(r.optimistic_seq_lens_cpu.dtype)

    def _read_plan(self, num_tokens: int) -> ReadPlan:
        """The requests' read lists padded into one batch, and every query token's request and position."""
        r = self.runner
        batch = r.input_batch
        n = batch.num_reqs
        req_ids = list(batch.req_ids[:n])
        slots, ids = (torch.from_numpy(a) for a in self.reads.batch(req_ids))  # padded with PAD ids
        # NOTE: the index arithmetic in numpy, handed to torch without a copy: a torch call costs several times a
        # numpy one at these sizes, and this runs once per step
        starts_np = r.query_start_loc.np[: n + 1].astype(np.int64)
        # one query per request (a decode step): the query's index is its request's
        request_np = np.arange(n) if num_tokens == n else np.repeat(np.arange(n), np.diff(starts_np))
        positions_np = r.positions[:num_tokens].to(torch.int64).numpy()
        prompt_np = batch.num_prompt_tokens[:n].astype(np.int64)[request_np]
        # NOTE: which implementation attends a query depends on the query alone (is it a token of a prompt longer
        # than LONG_PROMPT, or FUSED_PROMPT?), never on how its request was chunked, cached or recomputed: the
        # kernel and torch differ in their last bits, and prefix caching on and off must stay bit-identical on the
        # gather path.
        in_torch_np = (positions_np < prompt_np) & (prompt_np > LONG_PROMPT)
        newest, query_request, positions, prompt = (torch.from_numpy(a) for a in (starts_np[1:] - 1, request_np,
                                                                                   positions_np, prompt_np))
        in_torch, fused = torch.from_numpy(in_torch_np), torch.from_numpy(in_torch_np & (prompt_np > FUSED_PROMPT))
        rows = torch.zeros(ids.shape, dtype=torch.float64) if self.attention_rows else None
        window = votes = None
        if self.observation is not None:
            # NOTE: a prompt completes in this step when its last token is one of the step's queries (a prefill, its
            # last chunk, or a recompute after preemption); its window is its last w prompt positions among them
            w = self.observation[0]
            completes = torch.zeros(n, dtype=torch.bool)
            completes[query_request[positions == prompt - 1]] = True
            chosen = (positions < prompt) & (positions >= prompt - w) & completes[query_request]
            if bool(chosen.any()):
                window = torch.nonzero(chosen).flatten()
                votes = torch.zeros(ids.shape, dtype=torch.float64)
        return ReadPlan(self.engine.cache, slots, ids, query_request, positions, newest, in_torch, fused,
                        req_ids, rows, self.scored_layers, check=self.check_attention, window=window, votes=votes)

    def take_scores(self) -> tuple[dict[str, list[int]], dict[str, tuple[list[int], list[float]]], int, dict, dict]:
        """After the forward: record this step's attention rows (mean over heads and scored layers) into the
        requests' scores, and the key norms of the tokens that joined the read lists, then rank the victims of
        every request the scheduler sent a ranking for. Returns (the victims, per request; under strict verify the
        rows as (token ids, weights), else nothing; how many rows were recorded; under strict verify the key norms
        and the votes as (token ids, values), else nothing). Host work: the victims (and rows, norms and votes only
        when they travel)."""
        t0 = time.perf_counter()
        keys = self._take_key_norms() if self.unkeyed else {}
        observed = self._take_votes()
        plan, rows, recorded = self.read_plan, {}, 0
        if plan is not None and plan.rows is not None and plan.layers:
            batch = plan.rows / plan.layers if plan.layers > 1 else plan.rows  # x / 1 is x: one op less
            if self.tp_group is not None:
                # NOTE: every rank reaches this in the same step (the same orders, the same layers), so the
                # collective pairs up; each rank's row is the mean over its heads, equally many on every rank,
                # so the mean of the ranks' rows is the mean over all heads (TP = 1's). Float64 goes over gloo
                # (vLLM's shared-memory all-reduce on CPU takes 16- and 32-bit floats only); its result is the
                # same on every rank, so every rank ranks the same victims
                torch.distributed.all_reduce(batch, group=self.tp_group.cpu_group)
                batch /= self.tp_group.world_size
            lengths = [len(self.reads.lists(rid)[1]) for rid in plan.req_ids]
            self.scores.record_all(plan.req_ids, batch, lengths)  # every request's row in one batch
            recorded = len(plan.req_ids)
            if self.send_rows:
                for i, (rid, n) in enumerate(zip(plan.req_ids, lengths)):
                    rows[rid] = (self.reads.lists(rid)[1].tolist(), batch[i, :n].tolist())
            plan.rows, plan.layers = None, 0  # recorded once
        victims = {}
        for rid, (ranking, bound, protected) in self.ranks.items():  # read lists ascend: DeviceScores.rank's NOTE
            victims[rid] = self.scores.rank(rid, torch.from_numpy(self.reads.lists(rid)[1]), ranking, bound, protected)
        self.ranks = {}
        self.seconds += time.perf_counter() - t0
        return victims, rows, recorded, keys, observed

    def _take_votes(self) -> dict[str, tuple[list[int], list[float]]]:
        """SnapKV's statistic for the prompts that completed in this step: each window query's row (mean over heads
        and scored layers) averaged over the window's queries, then pooled over ``kernel`` neighbours in the read
        list (``avg_pool1d``, zero padding counted: ``snapkv.pool_votes``). Every rank gets the same (all-reduced)
        votes, as for the rows. Returns them as (token ids, votes) when they travel (strict verify)."""
        plan = self.read_plan
        if plan is None or plan.votes is None or not plan.vote_layers:
            return {}
        votes = plan.votes / plan.vote_layers
        if self.tp_group is not None:  # every rank has the same windows (the same orders and queries)
            torch.distributed.all_reduce(votes, group=self.tp_group.cpu_group)
            votes /= self.tp_group.world_size
        counts = torch.bincount(plan.query_request[plan.window], minlength=len(plan.req_ids))
        kernel, out = self.observation[1], {}
        for i in torch.nonzero(counts).flatten().tolist():
            rid = plan.req_ids[i]
            n = len(self.reads.lists(rid)[1])
            mean = (votes[i, :n] / int(counts[i])).view(1, 1, n)
            pooled = torch.nn.functional.avg_pool1d(mean, kernel, stride=1, padding=kernel // 2).flatten()
            self.scores.set_values("observed", rid, torch.arange(n), pooled)
            if self.send_rows:
                out[rid] = (self.reads.lists(rid)[1].tolist(), pooled.tolist())
        plan.votes, plan.vote_layers = None, 0  # recorded once
        return out

    def _take_key_norms(self) -> dict[str, tuple[list[int], list[float]]]:
        """Knorm's statistic where the keys are: for every token that joined a read list since the last call (its
        key written by this step's forward, or earlier for a prefix-cache hit), the L2 norm of its key in the KV
        cache, averaged over the KV heads and the scored layers (float64), all requests in one read per layer.
        Under tensor parallelism each rank holds as many heads, so the mean of the ranks' means is the mean over
        all heads, as for the attention rows. Returns them as (token ids, norms) when they travel (strict verify)."""
        rids = [rid for rid in self.unkeyed if rid in self.reads]
        wanted = [np.concatenate(self.unkeyed[rid]) for rid in rids]
        self.unkeyed = {}
        at = []
        for rid, ids in zip(rids, wanted):  # the read list ascends: each id by binary search
            where = _places(self.reads.lists(rid)[1], ids)
            if where is None:
                raise InvariantViolation("V4", f"request {rid!r}: tokens {ids[:8].tolist()} joined its read list "
                                               f"but are no longer in it before their key norms were read")
            at.append(where)
        slots = torch.from_numpy(np.concatenate([self.reads.lists(rid)[0][a] for rid, a in zip(rids, at)])) if rids \
            else torch.zeros(0, dtype=torch.int64)
        norms = torch.zeros(len(slots), dtype=torch.float64)
        if len(slots):
            cache, D = self.engine.cache, self.head_size
            for layer in self.key_layers:
                k = cache.read(f"{layer}.K", slots).view(len(slots), -1, D).to(torch.float64)
                norms += torch.linalg.vector_norm(k, dim=-1).mean(dim=1)
            norms /= len(self.key_layers)
        if self.tp_group is not None:  # every rank has the same joined tokens: the collective pairs up
            torch.distributed.all_reduce(norms, group=self.tp_group.cpu_group)
            norms /= self.tp_group.world_size
        out, start = {}, 0
        for rid, ids, a in zip(rids, wanted, at):
            part = norms[start:start + len(a)]
            start += len(a)
            self.scores.set_keys(rid, torch.from_numpy(a), part)
            if self.send_rows:
                out[rid] = (ids.tolist(), part.tolist())
        return out

    def _audit(self, num_tokens: int) -> None:
        """Strict verify: the write slots vLLM will use are exactly the ones the scheduler's table assigned."""
        r = self.runner
        batch = r.input_batch
        slots = batch.block_table[0].slot_mapping.gpu[:num_tokens].cpu().tolist()
        starts = r.query_start_loc.np
        for rid, expected in self.audit.items():
            i = batch.req_id_to_index[rid]
            got = slots[starts[i]:starts[i + 1]]
            if got != expected:
                raise InvariantViolation("I2", f"request {rid!r}: the worker writes slots {got[:8]}, its token table "
                                               f"assigned {expected[:8]}")
            self.audited += len(got)

    def take_reports(self) -> tuple[list[int], list[int]]:
        done, failed = self.done, self.failed
        self.done, self.failed = [], []
        return done, failed
