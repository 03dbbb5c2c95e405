"""A deterministic serving simulator: a scheduler, a fake model, and the vToken runtime.

The "model" writes one content tag per token and reads them back through the
runtime's read slots each step, so any lost or misplaced token fails I1 at
the very read that would have produced a wrong output. Its attention weights
are synthetic but structured (attention sinks, ~10% heavy hitters, a recency
bump), which is what H2O and Scissorhands need to behave like themselves.

One seed reproduces a run exactly. Used by ``vtoken demo``, the tests, and as
the base of the fuzzer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from ..block_pool import BlockPool, Purpose, blocks_needed, blocks_short
from ..checks import check_enum
from ..errors import ConfigError, InvariantViolation
from .inmemory import InMemoryCopyEngine, TagStore
from .read_mirror import ReadListMirror
from ..reference.invariants import check_all
from ..metrics import measure
from ..plan import PlanKind
from ..policies import make_policy
from ..policies.snapkv import pool_votes
from ..reclamation import Ordering, ReclaimConfig
from ..runtime import ReadPath, VTokenRuntime, check_budget

RECLAIM_MODES = ("off", "compact", "densify")


@dataclass(frozen=True)
class RequestSpec:
    req_id: int
    arrival: int  # step at which it becomes waiting
    prompt_len: int
    output_len: int


def synthetic_workload(num_requests: int, seed: int, prompt: tuple[int, int] = (16, 96),
                       output: tuple[int, int] = (64, 256), arrival_gap: int = 2) -> list[RequestSpec]:
    """Uniform prompt and output lengths in the given inclusive ranges; one arrival every ``arrival_gap`` steps."""
    rng = random.Random(seed)
    return [
        RequestSpec(i, i * arrival_gap, rng.randint(*prompt), rng.randint(*output))
        for i in range(num_requests)
    ]


@dataclass(frozen=True)
class SimConfig:
    num_blocks: int = 1024
    block_size: int = 16
    headroom: int = 8
    policy: str | None = "random"  # None: native, no eviction
    budget: float = 0.5
    evict_every: int = 1  # the eviction cadence beta (VTokenRuntime): under budget + beta a request waits
    reclaim: str = "compact"
    read_path: str = "gather"
    ordering: str = "poll"
    theta_f: float = 0.25
    low_watermark: int | None = None
    check_every: int = 1
    burst_df: float | None = None  # the adaptive trigger (ReclaimConfig.burst_df); None: the fixed one
    max_sources: int = 8
    copy_delay: int = 0  # steps a copy stays in flight before it completes
    max_running: int = 64
    seed: int = 0
    check_invariants: bool = False
    # (from step, budget) pairs, steps increasing: from that step on the budget is that value (``budget``
    # before the first); a drop makes every running request evict its new excess at once (an eviction burst)
    budget_schedule: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.reclaim not in RECLAIM_MODES:
            raise ConfigError(f"reclaim must be one of {list(RECLAIM_MODES)}, got {self.reclaim!r}")
        # checked here, not when the simulation builds its runtime (a ValueError then); kept as given
        check_enum("read_path", self.read_path, ReadPath)
        check_enum("ordering", self.ordering, Ordering)
        if self.copy_delay < 0 or self.max_running < 1:
            raise ConfigError(f"copy_delay must be >= 0 and max_running >= 1, got {self.copy_delay}, {self.max_running}")
        prev = -1
        for entry in self.budget_schedule:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], int)
                    and not isinstance(entry[0], bool) and entry[0] > prev):
                raise ConfigError(f"budget_schedule must be (step, budget) pairs with int steps >= 0 in increasing "
                                  f"order, got {entry!r} after step {prev}")
            try:
                check_budget(entry[1])
            except ConfigError as e:
                raise ConfigError(f"budget_schedule at step {entry[0]}: {e}") from None
            prev = entry[0]

    def budget_at(self, step: int) -> float:
        """The budget in force at ``step`` under ``budget_schedule``."""
        budget = self.budget
        for start, b in self.budget_schedule:
            if start > step:
                break
            budget = b
        return budget


@dataclass
class SimResult:
    steps: int = 0
    finished: int = 0
    preemptions: int = 0
    peak_running: int = 0
    invariant_checks: int = 0
    samples: int = 0
    sum_waste: float = 0.0
    sum_low_util: float = 0.0
    sum_retained: int = 0
    sum_ideal: int = 0
    sum_allocated: int = 0
    reclaim: dict = field(default_factory=dict)

    def _mean(self, x: float) -> float:
        return x / self.samples if self.samples else 0.0

    @property
    def mean_waste_ratio(self) -> float:
        return self._mean(self.sum_waste)

    @property
    def mean_low_util_share(self) -> float:
        return self._mean(self.sum_low_util)

    @property
    def mean_retained_blocks(self) -> float:
        return self._mean(self.sum_retained)

    @property
    def mean_ideal_blocks(self) -> float:
        return self._mean(self.sum_ideal)

    @property
    def mean_allocated_blocks(self) -> float:
        return self._mean(self.sum_allocated)


def content_tag(req_id: int, token_id: int) -> int:
    """What the model writes for a token: unique per (request, logical token), never 0."""
    return req_id * 1_000_003 + token_id + 1


def attention_weights(req_id: int, tokens: list[int], total_len: int) -> list[float]:
    raw = []
    for t in tokens:
        h = ((t * 2654435761) ^ (req_id * 40503)) & 0xFFFF
        w = 20.0 if h % 10 == 0 else 1.0
        if t < 4:
            w += 10.0
        if t >= total_len - 8:
            w += 5.0
        raw.append(w)
    z = sum(raw)
    return [w / z for w in raw]


def key_norm(req_id: int, token_id: int) -> float:
    """The model's key norm for a token: low for the tokens ``attention_weights`` favours (sinks, the heavy
    hitters), as Knorm's paper observes in real models, high for the rest, with a per-token spread."""
    h = ((token_id * 2654435761) ^ (req_id * 40503)) & 0xFFFF
    return (1.0 if h % 10 == 0 or token_id < 4 else 4.0) + (h % 97) / 97.0


def observation(req_id: int, read_tokens: list[int], prompt_len: int, window: int, kernel: int) -> list[float]:
    """SnapKV's votes as the model computes them at the end of a prompt of ``prompt_len`` tokens: the attention rows
    of its last ``window`` queries over ``read_tokens`` (a query at position p reads the tokens up to p), averaged
    over those queries, then pooled over ``kernel`` neighbours (``snapkv.pool_votes``)."""
    votes = [0.0] * len(read_tokens)
    queries = range(max(0, prompt_len - window), prompt_len)
    for p in queries:
        seen = [i for i, t in enumerate(read_tokens) if t <= p]
        for i, w in zip(seen, attention_weights(req_id, [read_tokens[i] for i in seen], p + 1)):
            votes[i] += w
    return pool_votes([v / len(queries) for v in votes], kernel)


def build_runtime(cfg: SimConfig) -> tuple[VTokenRuntime, InMemoryCopyEngine]:
    pool = BlockPool(cfg.num_blocks, cfg.block_size, cfg.headroom)
    engine = InMemoryCopyEngine(TagStore(cfg.num_blocks, cfg.block_size), auto_complete=cfg.copy_delay == 0)
    reclaim = None
    if cfg.reclaim != "off":
        reclaim = ReclaimConfig(
            planner=PlanKind(cfg.reclaim), theta_f=cfg.theta_f, low_watermark=cfg.low_watermark,
            check_every=cfg.check_every, max_sources=cfg.max_sources, ordering=Ordering(cfg.ordering),
            burst_df=cfg.burst_df,
        )
    policy = make_policy(cfg.policy) if cfg.policy else None
    rt = VTokenRuntime(pool, engine, policy, cfg.budget, reclaim, ReadPath(cfg.read_path), cfg.seed,
                       evict_every=cfg.evict_every)
    rt.manager.verify_fast_paths = cfg.check_invariants  # V3: each fast plan against its reference planner
    return rt, engine


class Simulator:
    def __init__(self, cfg: SimConfig, workload: list[RequestSpec]) -> None:
        self.cfg = cfg
        self.rt, self.engine = build_runtime(cfg)
        self.pending = sorted(workload, key=lambda r: (r.arrival, r.req_id))
        self.specs = {r.req_id: r for r in workload}
        self.waiting: list[tuple[int, int]] = []  # (req_id, tokens to prefill)
        self.running: list[int] = []  # admission order; the last is preempted first
        self.generated: dict[int, int] = {}
        self.submitted_at: dict[int, int] = {}
        self.result = SimResult()
        self.mirror = ReadListMirror()

    def run(self, max_steps: int = 100_000) -> SimResult:
        step = 0
        while (self.pending or self.waiting or self.running) and step < max_steps:
            self.step(step)
            step += 1
        self.result.steps = step
        stats = self.rt.manager.stats
        self.result.reclaim = {
            "plans_committed": stats.plans_committed,
            "plans_aborted": sum(stats.plans_aborted.values()),
            "moves_committed": stats.moves_committed,
            "blocks_released": stats.blocks_released,
            "releases_committed": stats.releases_committed,
        }
        return self.result

    def step(self, step: int) -> None:
        rt, S = self.rt, self.cfg.block_size
        if self.cfg.budget_schedule:
            budget = self.cfg.budget_at(step)
            if budget != rt.budget:
                rt.set_budget(budget)
        while self.pending and self.pending[0].arrival <= step:
            spec = self.pending.pop(0)
            self.waiting.append((spec.req_id, spec.prompt_len))
            self.generated[spec.req_id] = 0
        rt.manager.settle()  # blocks released by finished copies count before anyone is preempted
        appends = {r: 1 for r in self.running}
        self._fit(appends)
        while self.waiting and len(self.running) < self.cfg.max_running and rt.manager.admission_open():
            r, n = self.waiting[0]
            if not self._fits(appends, extra=blocks_needed(n, S)):
                break
            rt.admit(r)
            appends[r] = n
            self.waiting.pop(0)
            self.running.append(r)
        inputs = rt.begin_step(appends)
        if self.cfg.check_invariants:  # V2: the step's deltas, patched onto last step's lists, give this step's
            self.mirror.apply(inputs)
            self.mirror.check(inputs)
        attention = self._forward(inputs)
        keys = {r: [key_norm(r, t) for t in req.new_tokens] for r, req in inputs.requests.items()} \
            if "key_norm" in rt.scores.recorded else None  # only for a policy that reads them (Knorm)
        observed = {r: observation(r, req.read_tokens, self.specs[r].prompt_len, rt.policy.window, rt.policy.kernel)
                    for r, req in inputs.requests.items() if self.specs[r].prompt_len - 1 in req.new_tokens} \
            if "observed" in rt.scores.recorded else None  # at the end of each prompt, for SnapKV
        rt.set_pressure(self._blocks_short())
        rt.end_step(attention, keys, observed)
        for r in list(self.running):
            if r in appends:  # every forward emits one token per request (prefill included)
                self.generated[r] += 1
            if self.generated[r] >= self.specs[r].output_len:
                rt.finish(r)
                self.running.remove(r)
                self.result.finished += 1
        self._complete_copies(step)
        self.result.peak_running = max(self.result.peak_running, len(self.running))
        self._sample()
        if self.cfg.check_invariants:
            self.result.invariant_checks += check_all(
                rt, content_tag, dense=rt.read_path is ReadPath.DENSE and rt.policy is not None
            )

    # ---- scheduling ------------------------------------------------------------------
    def _fits(self, appends: dict[int, int], extra: int = 0) -> bool:
        need = extra + sum(self.rt.blocks_to_grow(r, n) for r, n in appends.items())
        return self.rt.pool.can_allocate(need, Purpose.ADMISSION)

    def _blocks_short(self) -> int:
        """The engine's pressure (``block_pool.blocks_short``): the requests that go on past this step, and the
        waiting head's prompt when a seat is free. A plan made now commits at the next step's settle, so the
        watermark leaves compaction a few steps."""
        pool = self.rt.pool
        going_on = sum(self.generated[r] + 1 < self.specs[r].output_len for r in self.running)
        waiting = blocks_needed(self.waiting[0][1], self.cfg.block_size) \
            if self.waiting and going_on < self.cfg.max_running else 0
        return blocks_short(going_on, waiting, pool.num_free, pool.headroom)

    def _fit(self, appends: dict[int, int]) -> None:
        """Preempt the most recently admitted requests until this step's growth fits (vLLM's rule)."""
        while appends and not self._fits(appends):
            victim = self.running.pop()
            del appends[victim]
            n = self.rt.preempt(victim)
            self.waiting.insert(0, (victim, n))
            self.result.preemptions += 1

    # ---- the model -------------------------------------------------------------------------
    def _forward(self, inputs) -> dict[int, list[float]]:
        store = self.engine.store
        out = {}
        for r, req in inputs.requests.items():
            for t, slot in zip(req.new_tokens, req.write_slots):
                if slot >= 0:
                    store.write(slot, content_tag(r, t))
            for t, slot in zip(req.read_tokens, req.read_slots):
                got = store.read(slot)
                if got != content_tag(r, t):
                    raise InvariantViolation(
                        "I1", f"step {inputs.iteration}: request {r} token {t} read content {got} at slot "
                        f"{slot}, expected {content_tag(r, t)} (replay: seed {self.cfg.seed})"
                    )
            out[r] = attention_weights(r, req.read_tokens, self.rt.table.total_len(r))
        return out

    def _complete_copies(self, step: int) -> None:
        if self.cfg.copy_delay == 0:
            return
        for h in self.engine.pending():
            self.submitted_at.setdefault(h, step)
            if step - self.submitted_at[h] >= self.cfg.copy_delay:
                self.engine.complete(h)

    def _sample(self) -> None:
        if not self.running:
            return
        m = measure(self.rt.pool, self.rt.table)
        res = self.result
        res.samples += 1
        res.sum_waste += m.waste_ratio
        res.sum_low_util += m.low_util_share
        res.sum_retained += m.total_retained
        res.sum_ideal += m.total_ideal
        res.sum_allocated += m.allocated_blocks


def run(cfg: SimConfig, workload: list[RequestSpec], max_steps: int = 100_000) -> SimResult:
    return Simulator(cfg, workload).run(max_steps)


def compare_modes(cfg: SimConfig, workload: list[RequestSpec]) -> dict[str, SimResult]:
    """The same workload and eviction decisions with no reclamation, compact and densify."""
    out = {"off": run(replace(cfg, reclaim="off"), workload)}
    out["compact"] = run(replace(cfg, reclaim="compact"), workload)
    out["densify"] = run(replace(cfg, reclaim="densify", ordering="event", read_path="dense"), workload)
    return out
