"""The whole-system state machine: requests, policies, reclamation, copies, pool pressure, bad calls.

One machine drives the real core (``VTokenRuntime`` with its pool, token
table, reclamation manager and ``InMemoryCopyEngine``) and keeps an
independent **shadow model**: ``shadow[req][token] = content tag`` for every
live token, and ``content[req]`` for every token ever synced. After every rule
every core checker runs, and the shadow proves I1 end to end: the tags the
next attention read sees through each request's attention slots are the
shadow's live tokens, in logical order.

Rules take plain integers (``index``) instead of ``st.data()`` so that a
failing program printed by Hypothesis replays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from vtoken.core import errors as E
from vtoken.core.block_pool import BlockPool, Purpose
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
from vtoken.core.sim.read_mirror import ReadListMirror
from vtoken.core.reference.invariants import check_all, next_read_view
from vtoken.core.policies import POLICIES, RenamedRequests, make_policy
from vtoken.core.policies.base import RequestView
from vtoken.core.reclamation import LAUNCH_FAILED, PlanState, ReclaimConfig
from vtoken.core.runtime import ReadPath, VTokenRuntime
from vtoken.core.sim.simulator import attention_weights
from vtoken.core.token_table import NO_SLOT, Move

from .bad_calls import BAD_ARGUMENTS, BAD_CALLS, TEETH, BadCalls, names_in
from .events import EVENTS
from .oracles import OracleViolation, Oracles, check_policy_choice
from .profiles import PROFILES, Profile



def observed_vote(tag: int) -> float:
    """The fuzzer's model of SnapKV's pooled vote for a token at its prompt's end: a function of its content, 8
    levels, so ties are common."""
    return ((tag * 40503) >> 5 & 0x7) / 64.0


def key_norm(tag: int) -> float:
    """The fuzzer's model of a key's norm: a function of the token's content (a shared prefix's tokens then have
    their source's norms, as in a real KV cache), 16 levels apart by 1/4096 so ties are common."""
    return ((tag * 2654435761) >> 7 & 0xF) / 4096.0


@dataclass
class FuzzPolicy:
    """A real policy plus victims the fuzzer queued (arbitrary choices, in-flight tokens included).

    ``names``: the name the policy sees for a request (``RenamedRequests`` renames the view); ``misbehave``, when
    set, makes the next answer for a request over its budget invalid in that way, once."""

    base: object | None
    queued: dict = field(default_factory=dict)
    name: str = "fuzz"
    oracles: Oracles | None = None  # checks every choice of ``base`` against its reference rule
    names: dict = field(default_factory=dict)
    misbehave: str | None = None  # the next invalid answer to give
    misbehaved: str | None = None  # the last one given
    asked: set = field(default_factory=set)  # the requests asked since the machine last cleared it
    key_norm_of: Callable | None = None  # request -> (token -> the norm its key must have), for the key oracle

    @property
    def statistics(self) -> tuple[str, ...]:
        return getattr(self.base, "statistics", ())

    def select_victims(self, view: RequestView) -> list[int]:
        req = self._request_of(view)
        self.asked.add(req)
        if self.oracles is not None and 0 < view.excess < self.oracles.rt.evict_every:
            raise OracleViolation("cadence", f"request {req!r} is {view.excess} token(s) over its budget, fewer than "
                                             f"evict_every {self.oracles.rt.evict_every}, and was asked for victims")
        if self.oracles is not None:
            self.oracles.check_protected(req, view)
        live = set(view.live)
        if self.misbehave and view.excess > 0:
            return self._invalid_answer(view)
        chosen = [t for t in dict.fromkeys(self.queued.pop(req, [])) if t in live and t not in view.protected]
        chosen = chosen[: view.excess]
        if self.base is not None and len(chosen) < view.excess:
            base = list(self.base.select_victims(view))
            if self.oracles is not None:
                self.oracles.scores.check_view(req, view, self.statistics,
                                               self.key_norm_of(req) if self.key_norm_of else None)
                check_policy_choice(self.base, view, base)
            chosen += [t for t in base if t not in chosen][: view.excess - len(chosen)]
        return chosen

    def _request_of(self, view: RequestView) -> object:
        """The request a view is of; the view must carry its policy name when it has one."""
        by_name = {v: k for k, v in self.names.items()}
        req = by_name.get(view.req_id, view.req_id)
        if self.names.get(req, req) != view.req_id:
            raise OracleViolation("policy", f"the policy saw request id {view.req_id!r}; its policy name is "
                                            f"{self.names[req]!r}")
        return req

    def _invalid_answer(self, view: RequestView) -> list[int]:
        kind, self.misbehave = self.misbehave, None
        self.misbehaved = kind
        live = list(view.live)
        if kind == "raises":
            raise ValueError("a policy bug")
        if kind == "duplicate":
            return [live[0]] * 2
        if kind == "too_many":
            return live[: view.excess + 1]
        dead = [t for t in range(view.total_len) if t not in set(live)]
        return [dead[0] if dead else view.total_len]


class VTokenMachine(BadCalls, RuleBasedStateMachine):
    """State machine over the whole core. ``profiles``/``policies`` restrict what ``setup`` may draw."""

    profiles: tuple[str, ...] = tuple(PROFILES)
    policies: tuple[str, ...] = tuple(sorted(POLICIES)) + ("none",)
    #: the device model: one relocation stream, as the real engine has (False: copies finish in any order)
    one_stream: bool = True

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.rt: VTokenRuntime | None = None

    # ---- setup ------------------------------------------------------------------------------
    @initialize(
        profile=st.runner().flatmap(lambda m: st.sampled_from(m.profiles)),
        policy=st.runner().flatmap(lambda m: st.sampled_from(m.policies)),
        block_size=st.sampled_from([2, 4, 8]),
        num_blocks=st.integers(6, 40),
        headroom=st.integers(0, 3),
        budget=st.sampled_from([0.3, 0.5, 0.75, 1.0]),
        theta_f=st.sampled_from([0.0, 0.1, 0.25, 0.5]),
        check_every=st.integers(1, 3),
        max_sources=st.integers(1, 8),
        low_watermark=st.one_of(st.none(), st.integers(0, 12)),
        burst_df=st.sampled_from([None, None, 0.05, 0.2]),  # None: the fixed trigger; else the adaptive one
        evict_every=st.sampled_from([1, 1, 2, 4]),  # the eviction cadence beta
    )
    def setup(self, profile, policy, block_size, num_blocks, headroom, budget, theta_f, check_every,
              max_sources, low_watermark, burst_df=None, evict_every=1):  # defaults: replays saved before them
        prof: Profile = PROFILES[profile]
        self.profile = prof
        headroom = min(headroom, num_blocks - 1)
        self.pool = BlockPool(num_blocks, block_size, headroom)
        self.engine = self.make_engine(num_blocks, block_size)
        self.store = self.engine.store
        reclaim = None
        if prof.planner is not None:
            reclaim = ReclaimConfig(planner=prof.planner, theta_f=theta_f, low_watermark=low_watermark,
                                    check_every=check_every, max_sources=max_sources, ordering=prof.ordering,
                                    burst_df=burst_df)
        self.policy = FuzzPolicy(None if policy == "none" else make_policy(policy))
        self.policy.key_norm_of = lambda req: lambda t: key_norm(self.content[req][t])
        self.rt = VTokenRuntime(self.pool, self.engine, RenamedRequests(self.policy, self.policy.names), budget,
                                reclaim, prof.read_path, seed=0, evict_every=evict_every)
        self.oracles = self.policy.oracles = Oracles(self.rt, self.engine).attach()
        self.mirror = ReadListMirror()  # V2: the step deltas, patched the way a worker would
        self.rt.manager.verify_fast_paths = True  # V3: every fast plan against its reference planner
        self.S = block_size
        self.content: dict[int, list[int]] = {}  # every synced or to-be-synced token's tag
        self.shadow: dict[int, dict[int, int]] = {}  # live tokens: request -> token -> tag
        self.prefill: dict[int, int] = {}  # tokens to append at the next step
        self.waiting: list[int] = []  # preempted, to be recomputed
        self.next_req = 0
        self.next_tag = 1
        EVENTS["runs"] += 1

    # ---- helpers ---------------------------------------------------------------------------------
    def make_engine(self, num_blocks: int, block_size: int):
        """The copy engine under test, with a ``store`` of content tags (``TensorMachine``: real tensors)."""
        return InMemoryCopyEngine(TagStore(num_blocks, block_size), auto_complete=False, one_stream=self.one_stream)

    @property
    def table(self):
        return self.rt.table

    @property
    def manager(self):
        return self.rt.manager

    def _tags(self, n: int) -> list[int]:
        tags = list(range(self.next_tag, self.next_tag + n))
        self.next_tag += n
        return tags

    def _live(self, req: int) -> list[int]:
        return sorted(self.shadow[req])

    def state(self) -> tuple:
        """Everything a rejected call must leave untouched."""
        m = self.manager
        return (
            self.pool.snapshot(), self.table.state(),
            tuple((k, v.state, v.handle) for k, v in m.inflight.items()), len(m.orphans),
            tuple((h, self.engine.poll(h)) for h in self.engine.pending()), self.store.state(),
        )

    def _rejected(self, exc: type, call, *args, names: tuple[str, ...] = (), state=None) -> None:
        """``call(*args)`` raises ``exc``, changes nothing (``state``: what to compare, ``self.state`` by default)
        and says what is wrong: its message is not empty and contains each of ``names``."""
        state = state or self.state
        before = state()
        try:
            call(*args)
        except exc as e:
            message = str(e)
        else:
            raise AssertionError(f"{call.__name__}{args} was accepted; expected {exc.__name__}")
        after = state()
        assert after == before, f"rejected {call.__name__}{args} changed the state"
        missing = [n for n in names if not names_in(message, n)]
        assert message and message != "None" and not missing, \
            f"rejected {call.__name__}{args} says {message!r}, which does not name {missing or 'anything'}"
        EVENTS["rejected_calls"] += 1

    def _running(self, req: int) -> bool:
        return req in self.table

    def _in_flight_copy(self, req: int) -> bool:
        rec = self.manager.inflight.get(req)
        return rec is not None and rec.state is PlanState.COPYING and rec.handle is not None \
            and self.engine.poll(rec.handle) is CopyStatus.PENDING

    # ---- requests ---------------------------------------------------------------------------------
    @precondition(lambda self: self.rt is not None)
    @rule(target=requests, prompt=st.integers(1, 24))
    def admit(self, prompt):
        admissible = self.rt.can_admit(prompt)
        self.oracles.check_can_admit(prompt, admissible)
        if not admissible:
            EVENTS["admission_deferred"] += 1
            return multiple()
        req = self.next_req
        self.next_req += 1
        self.rt.admit(req)
        self.oracles.scores.forget(req)
        self.content[req] = self._tags(prompt)
        self.shadow[req] = {}
        self.prefill[req] = prompt
        return req

    @rule(target=requests, source=requests, blocks=st.integers(1, 3), extra=st.integers(1, 8))
    def admit_sharing_prefix(self, source, blocks, extra):
        if not self._running(source):
            return multiple()
        req = self.next_req
        try:
            before = self.state()
            self.rt.admit(req, share_prefix_of=source, shared_blocks=blocks)
        except (E.BlockNotOwnedError, E.AdmissionClosedError, E.PlanConflictError) as e:
            # not full in place, backpressure, or a plan of the source in flight on those blocks
            assert self.state() == before, "a rejected prefix share changed the state"
            named = f"{req!r}" if isinstance(e, E.AdmissionClosedError) else f"request {source!r}"
            assert named in str(e), f"a refused prefix share of {source!r} says {str(e)!r}, not naming {named}"
            return multiple()
        self.next_req += 1
        self.oracles.scores.forget(req)
        n = blocks * self.S
        self.content[req] = self.content[source][:n] + self._tags(extra)
        self.shadow[req] = {t: self.content[req][t] for t in range(n)}
        self.prefill[req] = extra
        EVENTS["prefix_shares"] += 1
        return req

    @rule(req=consumes(requests), preempt=st.booleans())
    def leave(self, req, preempt):
        """The request finishes, or is preempted to be recomputed later (by ``resume``)."""
        if not self._running(req):
            return
        mid_copy = self._in_flight_copy(req)
        if preempt:
            n = self.rt.preempt(req)
            assert n == len(self.content[req]) - self.prefill.pop(req, 0)
            self.content[req] = self.content[req][:n]  # recompute re-prefills exactly what was synced
            self.shadow[req] = {}
            self.waiting.append(req)
            EVENTS["preemptions"] += 1
            EVENTS["preempted_mid_copy"] += mid_copy
        else:
            self.rt.finish(req)
            for d in (self.content, self.shadow, self.prefill):
                d.pop(req, None)
            EVENTS["finished_mid_copy"] += mid_copy

    @precondition(lambda self: self.rt is not None and any(self._in_flight_copy(r) for r in self.manager.inflight))
    @rule(preempt=st.booleans())
    def leave_mid_copy(self, preempt):
        """A request whose plan's copy is still pending finishes or is preempted."""
        req = min(r for r in self.manager.inflight if self._in_flight_copy(r))
        self.leave(req, preempt)

    @precondition(lambda self: self.rt is not None and self.waiting)
    @rule(target=requests)
    def resume(self):
        req = self.waiting[0]
        n = len(self.content[req])
        admissible = n > 0 and self.rt.can_admit(n)
        if n:
            self.oracles.check_can_admit(n, admissible)
        if not admissible:
            if n == 0:
                self.waiting.pop(0)
                del self.content[req], self.shadow[req]
            return multiple()
        self.waiting.pop(0)
        self.rt.admit(req)
        self.oracles.scores.forget(req)
        self.prefill[req] = n
        return req

    # ---- Algorithm 1 ----------------------------------------------------------------------------------
    @precondition(lambda self: self.rt is not None)
    @rule(n=st.integers(1, 4))
    def steps(self, n):
        """n decode iterations of Algorithm 1 (stops early when the pool cannot fit one)."""
        for _ in range(n):
            if not self.step():
                return

    def step(self, appends: dict | None = None, between=None, settle_first: bool = True) -> bool:
        """One iteration: begin_step, the forward (writes, then the reads checked against the shadow), end_step.

        ``appends``: the tokens each request gets (default: every running request, its prompt or one);
        ``between``: called after the forward, before end_step (a request leaving mid-step);
        ``settle_first=False``: begin_step itself must settle, and forecast what settling frees."""
        rt = self.rt
        if settle_first:
            rt.manager.settle()
        if appends is None:
            appends = {r: self.prefill.get(r, 1) for r in self.table.request_ids()}
        need = sum(rt.blocks_to_grow(r, n) for r, n in appends.items())
        lengths = {r: self.table.total_len(r) for r in self.table.request_ids()}
        if self.pool.can_allocate(need, Purpose.ADMISSION):
            inputs = rt.begin_step(appends)
        elif settle_first:
            EVENTS["steps_blocked"] += 1
            self._rejected(E.PoolExhaustedError, rt.begin_step, appends)
            return False
        else:  # begin_step must settle first, and forecast what settling frees before it does
            before = self.state()
            try:
                inputs = rt.begin_step(appends)
            except E.PoolExhaustedError:
                assert self.state() == before, "a refused begin_step changed the state"
                self._check_refusal_after_settling(appends)
                return False
            EVENTS["steps_fitting_only_after_settle"] += 1
        prefilling = {r for r in appends if r in self.prefill}  # their prompts complete in this step
        for r, n in appends.items():
            if r not in self.prefill:
                self.content[r] += self._tags(n)
            self.prefill.pop(r, None)
        store = self.store
        weights, keys, observed = {}, {}, {}
        assert set(inputs.requests) == set(self.table.request_ids()), "a running request is missing from the step"
        self.mirror.apply(inputs)
        self.mirror.check(inputs)
        for r, req in inputs.requests.items():
            assert req.req_id == r, f"StepInputs.requests[{r!r}].req_id is {req.req_id!r}"
            want_new = range(lengths[r], lengths[r] + appends.get(r, 0))
            assert req.new_tokens == want_new, f"request {r}: new tokens {req.new_tokens}, appended {want_new}"
            for t, slot in zip(req.new_tokens, req.write_slots):
                assert slot != NO_SLOT
                store.write(slot, self.content[r][t])
                self.shadow[r][t] = self.content[r][t]
            assert req.read_tokens == sorted(req.read_tokens) or rt.read_path is ReadPath.DENSE
            assert sorted(req.read_tokens) == self._live(r), f"request {r}: attention reads {req.read_tokens}"
            got = [store.read(s) for s in req.read_slots]
            want = [self.shadow[r][t] for t in req.read_tokens]
            assert got == want, f"request {r}: attention read {got}, shadow has {want} (I1)"
            weights[r] = attention_weights(r, req.read_tokens, self.table.total_len(r))
            keys[r] = [key_norm(self.content[r][t]) for t in req.new_tokens]
            if r in prefilling:
                observed[r] = [observed_vote(self.content[r][t]) for t in req.read_tokens]
        if self.engine.pending():
            EVENTS["steps_with_copies_in_flight"] += 1
        if between is not None:
            between()
        # a row of a request that left during the step is dropped (end_step's contract): shadow the others
        shadowed = {r: (inputs.requests[r].read_tokens, w) for r, w in weights.items() if r in self.table}
        votes = {r: (inputs.requests[r].read_tokens, v) for r, v in observed.items() if r in self.table}
        self._evict_chosen(shadowed, rt.end_step, weights, keys, observed, votes=votes)
        EVENTS["steps"] += 1
        return True

    def _evict_chosen(self, rows: dict, call, *args, votes: dict | None = None) -> None:
        """``call(*args)`` records this step's attention ``rows`` (request -> (token ids, weights)) and ``votes``
        (the same, SnapKV's observations) and evicts the victims it returns: the score shadow takes them first (and
        gives them back if the call raises), the content shadow loses the victims after."""
        self.oracles.scores.apply(rows, votes or {})
        due = self._due(args[0] if args and call == self.rt.evict_and_reclaim else self.table.request_ids())
        self.policy.asked = set()
        try:
            victims = call(*args)
        except BaseException:
            self.oracles.scores.undo()
            raise
        if due - self.policy.asked:
            missed = sorted(due - self.policy.asked)
            raise OracleViolation("cadence", f"request(s) {missed[:8]} were {self.rt.evict_every} or more tokens over "
                                             f"their budget (evict_every) and the policy was not asked for victims")
        for r, ts in victims.items():
            for t in ts:
                del self.shadow[r][t]
            EVENTS["evictions"] += len(ts)

    def _due(self, req_ids) -> set:
        """The requests ``evict_every`` says must be asked for victims now: at least beta tokens over budget."""
        rt, t = self.rt, self.table
        return {r for r in req_ids if r in t and t.num_live(r) - rt.token_budget(t.total_len(r)) >= rt.evict_every}

    def _check_refusal_after_settling(self, appends: dict) -> None:
        """Forecast oracle: begin_step refused the appends, so they must not fit once settled either."""
        self.rt.manager.settle()
        need = sum(self.rt.blocks_to_grow(r, n) for r, n in appends.items())
        if self.pool.can_allocate(need, Purpose.ADMISSION):
            raise OracleViolation("forecast", f"begin_step refused appends {appends} (PoolExhaustedError), yet "
                                              f"once settled they need {need} blocks and {self.pool.num_free} are "
                                              f"free with headroom {self.pool.headroom}")
        EVENTS["steps_blocked"] += 1

    # ---- schedules vLLM produces: partial steps, departures mid-step, no pre-settle, the engine allocating ----
    @precondition(lambda self: self.rt is not None)
    @rule(skip=st.integers(0, 2**16))
    def step_partial(self, skip):
        """A step that schedules only some running requests (vLLM's token budget): the one left out appends
        nothing, and its StepRequest has no new tokens."""
        running = self.table.request_ids()
        if len(running) < 2:
            return
        left_out = running[skip % len(running)]
        self.step(appends={r: self.prefill.get(r, 1) for r in running if r != left_out})
        EVENTS["partial_steps"] += 1

    @precondition(lambda self: self.rt is not None)
    @rule(index=st.integers(0, 2**16), preempt=st.booleans())
    def step_with_departure(self, index, preempt):
        """A request finishes or is preempted between the forward and end_step (vLLM aborts mid-step);
        end_step gets its row too, and must drop it and record every other one."""
        def depart():
            running = self.table.request_ids()
            if running:
                self.leave(running[index % len(running)], preempt)
                EVENTS["departures_mid_step"] += 1
        self.step(between=depart)

    @precondition(lambda self: self.rt is not None and self.engine.pending())
    @rule()
    def step_unsettled(self):
        """begin_step straight after copies changed state, with no settle before it: begin_step settles, and
        when the appends do not fit before settling it forecasts what settling will free."""
        self.step(settle_first=False)

    @precondition(lambda self: self.rt is not None and self.engine.pending())
    @rule(index=st.integers(0, 2**16))
    def forecast_then_settle(self, index):
        """Forecast oracle, exact: what ``begin_step`` forecasts settling frees (``_room_after_settle``:
        blocks the appends need, blocks free) is what a real ``settle`` then gives. A copy completes first
        (the newest one, on one stream: every copy), so there is something to forecast."""
        pending = self._pending()
        if hasattr(self.engine, "complete"):
            self.engine.complete(pending[index % len(pending)])
        appends = {r: self.prefill.get(r, 1) for r in self.table.request_ids()}
        forecast = self.rt._room_after_settle(appends)
        self.manager.settle()
        actual = (sum(self.rt.blocks_to_grow(r, n) for r, n in appends.items()), self.pool.num_free)
        if forecast != actual:
            raise OracleViolation("forecast", f"begin_step's forecast of settling is (need {forecast[0]}, free "
                                              f"{forecast[1]}); settling gave (need {actual[0]}, free {actual[1]})")
        EVENTS["forecasts_checked"] += 1

    @precondition(lambda self: self.rt is not None)
    @rule()
    def engine_step(self):
        """One iteration the way vLLM drives the core: the engine allocates each request's blocks and syncs
        them (``rt.sync``), the forward writes and reads, then ``evict_and_reclaim`` with (token ids, weights)."""
        rt, pool = self.rt, self.pool
        rt.manager.settle()
        running = self.table.request_ids()
        appends = {r: self.prefill.get(r, 1) for r in running}
        prefilling = {r for r in running if r in self.prefill}  # their prompts complete in this step
        need = {r: rt.blocks_to_grow(r, n) for r, n in appends.items()}
        if not running or not pool.can_allocate(sum(need.values()), Purpose.ADMISSION):
            return
        writes = []
        for r, n in appends.items():
            if r not in self.prefill:
                self.content[r] += self._tags(n)
            self.prefill.pop(r, None)
            total = self.table.total_len(r) + n
            slots = rt.sync(r, pool.allocate(need[r], Purpose.ADMISSION), total)
            assert len(slots) == n, f"sync of {n} tokens of request {r} returned {len(slots)} write slots"
            writes += [(r, t, slot) for t, slot in zip(range(total - n, total), slots)]
        self.engine.before_compute()  # the forward waits on ordered copies, then writes the new K/V
        for r, t, slot in writes:
            self.store.write(slot, self.content[r][t])
            self.shadow[r][t] = self.content[r][t]
        rows, keys, votes = {}, {}, {}
        for r, t, _ in writes:
            ids, norms = keys.setdefault(r, ([], []))
            ids.append(t)
            norms.append(key_norm(self.content[r][t]))
        read = next_read_view(rt)
        for r in running:
            tokens = self.table.live_token_ids(r)
            got = [read(s) for s in self.table.attention_slots(r)]
            assert got == [self.shadow[r][t] for t in tokens], f"request {r}: read {got} (I1)"
            rows[r] = (tokens, attention_weights(r, tokens, self.table.total_len(r)))
            if r in prefilling:
                votes[r] = (tokens, [observed_vote(self.content[r][t]) for t in tokens])
        self._evict_chosen(rows, rt.evict_and_reclaim, running, rows, keys, votes, votes=votes)
        EVENTS["engine_steps"] += 1

    @rule(req=requests)
    def detach(self, req):
        """The engine frees a finished request's blocks itself (vLLM): ``detach`` hands back the block list
        and forgets the request's scores; while a plan of it is in flight it is refused."""
        if not self._running(req):
            return
        if self.manager.in_flight(req) is not None:
            return self._rejected(E.PlanConflictError, self.rt.detach, req, names=(f"request {req!r}",))
        blocks = self.table.block_ids(req)
        got = self.rt.detach(req)
        assert got == blocks, f"detach({req}) returned {got}, its block list is {blocks}"
        assert req not in self.table and req not in self.rt.scores, f"detach({req}) left the request behind"
        self.pool.free(got)
        for d in (self.content, self.shadow, self.prefill):
            d.pop(req, None)
        EVENTS["detached"] += 1

    @rule(req=requests)
    def rename_for_policy(self, req):
        """Give a request a policy name (what vLLM's plugin does: seeds follow arrival, not random ids)."""
        if self._running(req):
            self.policy.names[req] = ("policy-name", req)

    # ---- the checkers have teeth on every reachable state ------------------------------------------------
    @precondition(lambda self: self.rt is not None)
    @rule(kind=st.sampled_from(TEETH), index=st.integers(0, 2**16))
    def checker_has_teeth(self, kind, index):
        """Plant one defect in a copy of the current state (or in the planner's answer) and require the
        executed check that guards it to raise InvariantViolation with its invariant's name and a message
        naming the defect, leaving the real state alone. A check that keeps quiet, or names the wrong
        invariant, would let the bug it exists for pass unreported."""
        getattr(self, "_teeth_" + kind.split("_")[0])(kind, index)

    @precondition(lambda self: self.rt is not None)
    @rule(budget=st.sampled_from([0.3, 0.5, 0.75, 1.0, 2, 0.0, 1.5, True]))
    def set_budget(self, budget):
        """Change the eviction budget: a drop is an eviction burst at the next end_step (the adaptive trigger's
        case); a bad value must raise ConfigError and change nothing."""
        if budget is True or budget in (0.0, 1.5):
            return self._refused_setting("set_budget", budget, E.ConfigError, lambda: self.rt.budget)
        self.rt.set_budget(budget)
        EVENTS["budget_changes"] += 1

    @precondition(lambda self: self.rt is not None)
    @rule(blocks=st.sampled_from([0, 0, 1, 3, 64, -1, 2.0, True]))
    def set_pressure(self, blocks):
        """The engine's pressure (blocks it is short of): while > 0 every step's end runs a compaction round on the
        gather path whatever θ_F says, under the same plan rules and headroom bound (the oracles hold each plan to
        them); a bad value must raise InvalidArgumentError and change nothing."""
        if blocks in (-1, 2.0) or blocks is True:
            return self._refused_setting("set_pressure", blocks, E.InvalidArgumentError, lambda: self.rt.pressure)
        self.rt.set_pressure(blocks)
        EVENTS["pressure_changes"] += 1

    @precondition(lambda self: self.rt is not None)
    @rule(req=requests, index=st.integers(0, 2**16))
    def cache_block(self, req, index):
        """A prefix cache hashes one of a running request's blocks (vLLM hashes full blocks): a later request may
        map it, so compaction must leave it in place from now on (the planner oracle holds it to that)."""
        if not self._running(req):
            return
        blocks = self.rt.block_ids(req)
        if blocks:
            self.rt.pool.cache(blocks[index % len(blocks)])
            EVENTS["blocks_cached"] += 1

    def _refused_setting(self, name: str, value, error: type, read) -> None:
        """``self.rt.<name>(value)`` raises ``error`` and changes nothing: neither the state nor the setting
        (``read()``)."""
        before = (self.state(), read())
        try:
            getattr(self.rt, name)(value)
        except error:
            pass
        else:
            raise AssertionError(f"{name}({value!r}) was accepted; expected {error.__name__}")
        assert (self.state(), read()) == before, f"rejected {name}({value!r}) changed the state"
        EVENTS["rejected_calls"] += 1

    @precondition(lambda self: self.rt is not None and self.profile.read_path is ReadPath.GATHER)
    @rule(req=requests, index=st.integers(0, 2**16), moving=st.booleans())
    def evict_now(self, req, index, moving):
        """Evict any live token right now, preferring one whose move is in flight."""
        if not self._running(req) or not self.shadow[req]:
            return
        live = self._live(req)
        rec = self.manager.inflight.get(req)
        if moving and rec is not None:
            in_flight = [m.token_id for m in rec.plan.moves if m.token_id in self.shadow[req]]
            live = in_flight or live
            EVENTS["evictions_of_moving_tokens"] += bool(in_flight)
        t = live[index % len(live)]
        self.table.evict_token(req, t)
        del self.shadow[req][t]
        EVENTS["evictions"] += 1

    @precondition(lambda self: self.rt is not None and self.profile.read_path is ReadPath.GATHER)
    @rule(req=requests, index=st.integers(0, 2**16), count=st.integers(2, 40))
    def evict_several(self, req, index, count):
        """Evict several live tokens in one call (a policy's victims of one step): each returned position is the
        one ``position_of`` gave its token before. Gather path only, as ``evict_now`` (the dense path's
        evictions go through the policy, so densify fills their holes)."""
        if not self._running(req) or not self.shadow[req]:
            return
        live = self._live(req)
        chosen = [live[(index + 7 * k) % len(live)] for k in range(min(count, len(live)))]
        chosen = list(dict.fromkeys(chosen))  # distinct, in the order drawn
        expected = [self.table.position_of(req, t) for t in chosen]
        positions = self.table.evict_tokens(req, chosen)
        assert positions == expected, f"evict_tokens({req}, {chosen}) returned {positions}, held {expected}"
        for t in chosen:
            del self.shadow[req][t]
        EVENTS["evictions"] += len(chosen)

    @rule(req=requests, index=st.integers(0, 2**16))
    def queue_victim(self, req, index):
        """Make the next end_step evict this token through the policy path."""
        if not self._running(req) or not self.shadow[req]:
            return
        live = self._live(req)
        self.policy.queued.setdefault(req, []).append(live[index % len(live)])

    # ---- reclamation and the copy stream ----------------------------------------------------------------
    @precondition(lambda self: self.rt is not None and self.profile.planner is not None)
    @rule(req=requests)
    def plan_now(self, req):
        """Plan one request now, outside the F trigger; a second plan in flight must be refused (I4)."""
        if not self._running(req):
            return
        if req in self.manager.inflight:
            return self._rejected(E.PlanConflictError, self.manager.plan_request, req)
        rec = self.manager.plan_request(req)
        EVENTS["plans_made" if rec else "no_plan"] += 1

    @precondition(lambda self: self.rt is not None and self.profile.read_path is ReadPath.GATHER)
    @rule(req=requests, pick=st.none() | st.lists(st.integers(0, 2**16), max_size=4))
    def release_now(self, req, pick):
        """Naive-Evict's release (``ReclamationManager.plan_release``) between steps, whatever the planner: over
        the whole list, or over a few of its indices (the cursor's block and one past the list among them: never
        released); a second plan in flight is refused, changing nothing. The oracle holds it to its definition."""
        if not self._running(req):
            return
        if req in self.manager.inflight:
            return self._rejected(E.PlanConflictError, self.manager.plan_release, req)
        n = len(self.table.block_ids(req))
        rec = self.manager.plan_release(req, None if pick is None else [x % (n + 2) for x in pick])
        EVENTS["releases_made" if rec else "no_release"] += 1

    @precondition(lambda self: self.rt is not None)
    @rule(req=requests, index=st.integers(0, 2**16))
    def relocate_now(self, req, index):
        """The relocation drill (``VTokenRuntime.relocate_block``): one block's live tokens to a fresh block,
        same offsets, planned and launched between steps; under POLL its copy stays pending, so evictions,
        departures and failures can meet it in flight. A second plan in flight and an index outside the list
        are refused, changing nothing."""
        if not self._running(req) or not self.table.block_ids(req):
            return
        if req in self.manager.inflight:
            return self._rejected(E.PlanConflictError, self.rt.relocate_block, req, 0)
        n = len(self.table.block_ids(req))
        if index % 7 == 0:
            return self._rejected(E.InvalidArgumentError, self.rt.relocate_block, req, n + index % 3)
        rec = self.rt.relocate_block(req, index % n)
        EVENTS["relocations_planned" if rec else "no_plan"] += 1

    @precondition(lambda self: self.rt is not None)
    @rule()
    def launch(self):
        self.manager.launch()

    @precondition(lambda self: self.rt is not None and self.profile.planner is not None
                  and self.profile.read_path is ReadPath.GATHER and hasattr(self.engine, "fail_next_submit"))
    @rule(req=requests)
    def launch_refused(self, req):
        """The engine refuses the next copy launch (submit raises, having written nothing): ``launch`` aborts
        that plan, frees its destinations, leaves the table alone, launches the others and does not raise.
        Gather path only: on the dense path an aborted densify leaves holes the next read refuses (I7)."""
        m = self.manager
        if self._running(req) and req not in m.inflight:
            EVENTS["plans_made" if m.plan_request(req) else "no_plan"] += 1
        planned = [r for r in m.inflight.values() if r.state is PlanState.PLANNED and r.plan.moves]
        if not planned:
            return
        victim, table_before = planned[0], self.table.state()  # launch submits in inflight order
        self.engine.fail_next_submit()
        refused = m.launch()
        assert refused and len(refused) == 1 and refused[0] is victim and victim.state is PlanState.ABORTED, \
            f"a refused launch left the plan of {victim.plan.req_id!r} {victim.state.value} (returned {refused!r})"
        assert victim.abort_reason == LAUNCH_FAILED and victim.handle is None
        assert m.inflight.get(victim.plan.req_id) is not victim, "an aborted plan is still in flight"
        assert all(self.pool.ref_count(b) == 0 for b in victim.plan.dst_blocks), "destinations not returned"
        assert self.table.state() == table_before, "a refused launch changed the token table"
        EVENTS["copy_launches_refused"] += 1

    @precondition(lambda self: self.rt is not None)
    @rule()
    def settle(self):
        # NOTE: not counted here: ``teardown`` adds the manager's totals, this rule's commits and aborts included
        # (counting them here too counted them twice, and a gather-off run then showed more commits than plans)
        self.manager.settle()

    def _pending(self, status: CopyStatus | None = None) -> list[int]:
        return [h for h in self.engine.pending() if status is None or self.engine.poll(h) is status]

    @precondition(lambda self: self.rt is not None and self.engine.pending())
    @rule(index=st.integers(0, 2**16))
    def complete_copy(self, index):
        """Complete any pending copy, late. On one stream (the default) the copies before it complete first."""
        hs = self._pending()
        self.engine.complete(hs[index % len(hs)])
        EVENTS["copies_completed_behind_others" if index % len(hs) else "copies_completed"] += 1

    @precondition(lambda self: self.rt is not None and self._pending(CopyStatus.PENDING))
    @rule(index=st.integers(0, 2**16), written=st.integers(0, 64))
    def fail_copy(self, index, written):
        hs = self._pending(CopyStatus.PENDING)
        h = hs[index % len(hs)]
        self.engine.fail(h, written % (len(self.engine.moves_of(h)) + 1))
        EVENTS["copies_failed"] += 1

    @precondition(lambda self: self.rt is not None and self._pending(CopyStatus.PENDING))
    @rule(index=st.integers(0, 2**16))
    def order_copy(self, index):
        """A GPU-side wait_event: later compute and copies run after this copy."""
        hs = self._pending(CopyStatus.PENDING)
        self.engine.order_before_compute(hs[index % len(hs)])
        EVENTS["copies_ordered"] += 1

    # ---- schedules and inputs uniform rule choice rarely reaches --------------------------------------
    def _movable(self, req: int) -> tuple[list[int], list[int]]:
        """``req``'s live tokens outside shared blocks, and the free slots of its unshared blocks before the
        cursor (holes a direct move may fill)."""
        S, t = self.S, self.table
        blocks = t.block_ids(req)
        mine = [i for i, b in enumerate(blocks) if self.pool.ref_count(b) == 1]
        tokens = [x for x in self._live(req) if self.pool.ref_count(t.slot_of(req, x) // S) == 1]
        w = t.write_pos(req)
        holes = [blocks[i] * S + o for i in mine for o in range(S)
                 if i * S + o < w and not t.occupancy.holders(blocks[i] * S + o)]
        return tokens, holes

    @precondition(lambda self: self.rt is not None and self.profile.read_path is ReadPath.GATHER)
    @rule(req=requests, index=st.integers(0, 2**16))
    def chained_moves(self, req, index):
        """A valid chained batch, copied on the relocation stream and applied directly: x moves into a hole
        and y into the slot x vacates (or, with no hole, x and y swap). Planners never chain moves, so
        only this rule exercises apply_moves' "all sources vacate before any destination is claimed"."""
        if not self._running(req) or req in self.manager.inflight:
            return
        tokens, holes = self._movable(req)
        if len(tokens) < 2:
            return
        S, t = self.S, self.table
        x, y = tokens[index % len(tokens)], tokens[(index // len(tokens) + 1 + index) % len(tokens)]
        if x == y:
            y = tokens[(tokens.index(x) + 1) % len(tokens)]
        sx, sy = t.slot_of(req, x), t.slot_of(req, y)
        into = holes[index % len(holes)] if holes else sy
        moves = [Move(x, sx // S, sx % S, into // S, into % S), Move(y, sy // S, sy % S, sx // S, sx % S)]
        h = self.engine.submit(moves, req_id=req)
        self.engine.wait(h)
        self.engine.release(h)
        t.apply_moves(req, moves)
        EVENTS["chained_batches" if holes else "swapped_batches"] += 1

    @precondition(lambda self: self.rt is not None and self.profile.planner is not None)
    @rule(req=requests, rounds=st.integers(2, 4), evict=st.integers(0, 2**16), order=st.booleans(),
          newest_first=st.booleans())
    def relocation_burst(self, req, rounds, evict, order, newest_first):
        """Several plans of one request between two steps: settle (commit), evict, re-plan, launch, and so
        on; then (``newest_first``) the newest copy completes first, and a step runs. A newer plan's copy reads what the older
        one writes, so one stream's order is what keeps I1 (this schedule is 4 rules per round, which
        uniform rule choice almost never strings together)."""
        if not self._running(req):
            return
        for k in range(rounds):
            self.manager.settle()
            if not self._running(req):
                return
            if self.profile.read_path is ReadPath.GATHER and len(self.shadow[req]) > 1:
                live = self._live(req)
                victim = live[(evict + k) % len(live)]
                self.table.evict_token(req, victim)
                del self.shadow[req][victim]
                EVENTS["evictions"] += 1
            if req in self.manager.inflight:
                break
            rec = self.manager.plan_request(req)
            EVENTS["plans_made" if rec else "no_plan"] += 1
            self.manager.launch()
            if order and rec and rec.handle is not None and self.engine.poll(rec.handle) is CopyStatus.PENDING:
                self.engine.order_before_compute(rec.handle)
        pending = self._pending()
        if newest_first and pending and hasattr(self.engine, "complete"):
            self.engine.complete(pending[-1])
            EVENTS["bursts_completed_newest_first"] += 1
        self.step()

    @precondition(lambda self: self.rt is not None)
    @rule(now=st.integers(0, 31))
    def quiesce(self, now):
        """Every request finishes, every copy settles: the pool must be whole again (quiescence oracle).
        Only one draw in 32 (``now == 0``) quiesces: as often as other rules, it would empty the system
        before anything interesting builds up."""
        if now:
            return
        for r in list(self.table.request_ids()):
            self.rt.finish(r)
        pending = self._pending()
        if pending and hasattr(self.engine, "complete"):
            self.engine.complete(pending[-1])  # one stream: the last one's completion drains the rest
        for h in self._pending():
            self.engine.wait(h)
        self.manager.settle()
        self.oracles.check_quiescent()
        for d in (self.content, self.shadow, self.prefill, self.policy.queued):
            d.clear()
        self.waiting.clear()
        EVENTS["quiesced"] += 1

    # ---- invalid calls: each raises its specific error and changes nothing ----------------------------
    @precondition(lambda self: self.rt is not None)
    @rule(req=requests, kind=st.sampled_from(BAD_CALLS), index=st.integers(0, 2**16))
    def bad_call(self, req, kind, index):
        """An invalid call; it must raise its specific error and change nothing."""
        group, _, what = kind.partition(":")
        getattr(self, "_bad_" + group)(req, what, index)

    @precondition(lambda self: self.rt is not None)
    @rule(req=requests, kind=st.sampled_from(BAD_ARGUMENTS), index=st.integers(0, 2**16))
    def bad_argument(self, req, kind, index):
        """An invalid argument, configuration or policy answer; refused like a bad call."""
        self.bad_call(req, kind, index)

    # ---- invariants ---------------------------------------------------------------------------------
    @invariant()
    def core_invariants_hold(self):
        if self.rt is None:
            return
        EVENTS["invariant_checks"] += check_all(
            self.rt, lambda r, t: self.content[r][t],
            dense=self.profile.read_path is ReadPath.DENSE and self.profile.planner is not None,
        )
        EVENTS["machine_steps"] += 1

    @invariant()
    def shadow_model_agrees(self):
        """I1 end to end: the next read through each attention slot list yields the shadow's live tokens."""
        if self.rt is None:
            return
        read = next_read_view(self.rt)
        for r in self.table.request_ids():
            live = self._live(r)
            assert self.table.live_token_ids(r) == live, f"request {r}: table lives {self.table.live_token_ids(r)}, shadow {live}"
            got = [read(s) for s in self.table.attention_slots(r)]
            want = [self.shadow[r][t] for t in live]
            assert got == want, f"request {r}: attention slots read {got}, shadow has {want} (I1)"
        assert set(self.table.request_ids()) == set(self.shadow) - set(self.waiting)
        EVENTS["invariant_checks"] += 1

    @invariant()
    def function_and_progress_hold(self):
        """The functional and progress oracles (fuzz/oracles.py): Eq. 1, block arithmetic, headroom, stream."""
        if self.rt is None:
            return
        self.oracles.check_state()
        if "key_norm" in self.rt.scores.recorded:  # every live token's key norm, decision or not (Knorm)
            for r in self.table.request_ids():
                view = self.rt.policy_view(r)
                self.oracles.scores.check_view(r, view, ("key_norm",), self.policy.key_norm_of(r))
        EVENTS["oracle_checks"] += 1

    def check_all_invariants(self) -> None:
        """Every invariant at once: what replay files call after every rule."""
        self.core_invariants_hold()
        self.shadow_model_agrees()
        self.function_and_progress_hold()

    def teardown(self):
        if self.rt is not None:
            stats = self.manager.stats
            EVENTS["plans_committed"] += stats.plans_committed
            EVENTS["plans_aborted"] += sum(stats.plans_aborted.values())
            EVENTS["moves_committed"] += stats.moves_committed
            EVENTS["bursts_detected"] += stats.bursts
            EVENTS["burst_rounds"] += stats.burst_rounds


class TensorMachine(VTokenMachine):
    """The same machine over the torch device layer: ``vtoken fuzz --target tensors``.

    Copies move real K/V tensors (four layers: fp32 in vLLM's GPU layout, bf16 stacked with one KV
    head, fp16 in the CPU layout with GQA heads, and a layer sharing the first one's buffers), with
    strict verify raising on any digest mismatch. Content tags live in every byte of every plane
    (``TensorTagStore``), so the I1 checks read the tensors themselves. An odd pool moves tokens with the
    compiled mover, an even one with torch (``tensor_engine``). CPU copies finish at submit, so the rules
    that complete, fail or reorder in-memory copies are not part of this machine.
    """

    def make_engine(self, num_blocks: int, block_size: int):
        from vtoken.fuzz.tensor_target import tensor_engine
        return tensor_engine(num_blocks, block_size)

    complete_copy = fail_copy = order_copy = None
