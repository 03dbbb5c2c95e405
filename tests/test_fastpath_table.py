"""V6 at the kernel level (issue #45): the fast path's ``FastTable`` is the core's ``TokenTable``, operation by operation.

A Hypothesis state machine drives the same operations into both: admissions, syncs of new tokens and blocks (prefix
blocks shared with another request included), evictions, densify's plan and commit, removals, and calls the core
refuses (a dead or out-of-range token, a token named twice, a block already listed, too few blocks, a total below
the synced length, a shared block not full). After every operation the return values (write slots, evicted
positions, plans, released blocks) or the refusals (class and message) are equal, and so is every request's state
and the pool's occupancy in ``TokenTable.state()``'s shape. numba's bounds checks are on here (``NUMBA_BOUNDSCHECK``
is read when a kernel compiles; the run below compiles in a child with it set).

Replay a failure: the seed Hypothesis prints (``@reproduce_failure``), or rerun this file: the ``ci`` profile is
derandomized.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

pytest.importorskip("numba")

from vtoken.core.densify import plan_densify  # noqa: E402
from vtoken.core.plan import NoPlanReason  # noqa: E402
from vtoken.core.policies import RandomPolicy, RequestView, StreamingLLM  # noqa: E402
from vtoken.core.policies.random_policy import request_state  # noqa: E402
from vtoken.core.errors import BlockNotOwnedError, ConfigError, UnknownRequestError, VTokenError  # noqa: E402
from vtoken.core.token_table import TokenTable  # noqa: E402
from vtoken.integration.fastpath import kernels as K  # noqa: E402
from vtoken.integration.fastpath.table import FastTable  # noqa: E402

NUM_BLOCKS, S, ROWS, TOKENS = 40, 4, 5, 48


def both(core_call, fast_call):
    """Run one operation on each side: equal answers, or the same refusal (class and message)."""
    try:
        want = core_call()
    except VTokenError as e:
        with pytest.raises(type(e)) as got:
            fast_call()
        assert type(got.value) is type(e) and str(got.value) == str(e)
        return None
    got = fast_call()
    assert got == want
    return want


class Lockstep(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core = TokenTable(NUM_BLOCKS, S)
        self.fast = FastTable(NUM_BLOCKS, S, ROWS, TOKENS)
        self.refs = [0] * NUM_BLOCKS  # how many requests list each block (the test's allocator)
        self.next_id = 0
        self.evicted: dict[int, list[int]] = {}  # each request's evicted positions since its last densify

    # ---- the test's allocator and request choice ------------------------------------------------
    def take(self, n: int) -> list[int] | None:
        free = [b for b in range(NUM_BLOCKS) if self.refs[b] == 0]
        return free[:n] if len(free) >= n else None

    def held(self, blocks) -> None:
        for b in blocks:
            self.refs[b] += 1

    def dropped(self, blocks) -> None:
        for b in blocks:
            self.refs[b] -= 1

    def pick(self, data, among=None) -> int:
        ids = self.core.request_ids() if among is None else among
        return data.draw(st.sampled_from(sorted(ids)), label="request")

    def has_requests(self) -> bool:
        return bool(self.core.request_ids())

    # ---- rules -------------------------------------------------------------------------------
    @initialize()
    def first(self):
        self.admit()

    @precondition(lambda self: len(self.core.request_ids()) < ROWS)
    @rule()
    def admit(self):
        r = self.next_id
        self.next_id += 1
        self.core.add_request(r)
        self.fast.add_request(r)
        self.evicted[r] = []

    @precondition(has_requests)
    @rule(data=st.data(), n=st.integers(0, 2 * S + 3), ahead=st.integers(0, 1))
    def sync(self, data, n, ahead):
        r = self.pick(data)
        total = self.core.total_len(r) + n
        need = max(-(-(self.core.write_pos(r) + n) // S) - len(self.core.block_ids(r)), 0) + ahead
        if total > TOKENS or len(self.core.block_ids(r)) + need > -(-TOKENS // S) + 1:
            return
        new = self.take(need)
        if new is None:
            return
        slots = both(lambda: self.core.sync_new_tokens(r, new, total), lambda: self.fast.sync_new_tokens(r, new, total))
        assert slots is not None and len(slots) == n
        self.held(new)

    @precondition(lambda self: len(self.core.request_ids()) < ROWS)
    @rule(data=st.data(), extra=st.integers(0, S + 1))
    def share_a_prefix(self, data, extra):
        """A new request whose first blocks are full blocks of another's list (a prefix-cache hit), filled by its
        first sync (the holder may have evicted tokens in them: its mask of them stays its own)."""
        holders = [h for h in self.core.request_ids() if self.core.write_pos(h) >= S]
        if not holders:
            return
        holder = self.pick(data, holders)
        k = data.draw(st.integers(1, min(3, self.core.write_pos(holder) // S)), label="shared blocks")
        blocks = self.core.block_ids(holder)[:k] + (self.take(-(-extra // S)) or [])
        total = k * S + extra
        if len(blocks) * S < total or total > TOKENS:
            return
        r = self.next_id
        self.admit()
        assert both(lambda: self.core.sync_new_tokens(r, blocks, total),
                    lambda: self.fast.sync_new_tokens(r, blocks, total)) is not None
        event("shared a prefix")
        self.held(blocks)

    @precondition(has_requests)
    @rule(data=st.data(), then_densify=st.booleans())
    def evict(self, data, then_densify):
        """A policy's victims; with ``then_densify``, densify right after with this step's positions, as the dense
        path runs every step."""
        live = [r for r in self.core.request_ids() if self.core.num_live(r)]
        if not live:
            return
        r = self.pick(data, live)
        ids = data.draw(st.lists(st.sampled_from(self.core.live_token_ids(r)), min_size=1, max_size=4, unique=True))
        self.evicted[r] += both(lambda: self.core.evict_tokens(r, ids), lambda: self.fast.evict_tokens(r, ids))
        if then_densify:
            self.densify_and_compare(r, True)

    def core_choice(self, r, policy, budget, seed):
        """The core's policy over the core's table (the dense path's protected tokens: those of blocks another
        request lists)."""
        shared = [b for b in self.core.block_ids(r) if len(self.core.owners(b)) > 1]
        protected = frozenset(t for t, _ in self.core.live_in_blocks(r, shared)) if shared else frozenset()
        view = RequestView(r, self.core.live_tokens(r), self.core.total_len(r), budget, seed=seed, protected=protected)
        return policy.select_victims(view), shared, bool(protected)

    @precondition(has_requests)
    @rule(data=st.data(), random=st.booleans(), param=st.integers(0, 5), seed=st.sampled_from([0, 7, -3, 2**70]))
    def built_in_choice(self, data, random, param, seed):
        """StreamingLLM's (``param`` sinks) or Random's (``param`` newest kept, draws of ``seed``) victims at a
        budget, chosen in the kernel and by the core's policy, then evicted and densified."""
        live = [r for r in self.core.request_ids() if self.core.num_live(r) > 1]
        if not live:
            return
        r = self.pick(data, live)
        budget = data.draw(st.integers(1, self.core.num_live(r)), label="budget")
        policy = RandomPolicy(keep_recent=param) if random else StreamingLLM(sinks=param)
        want, _, protected = self.core_choice(r, policy, budget, seed)
        got = self.fast.random_victims(r, param, budget, request_state(seed, r)) if random \
            else self.fast.streaming_victims(r, param, budget)
        assert got == want
        event(f"{policy.name}: {'no victim' if not want else 'victims'}{', protected' if protected else ''}")
        if want:
            self.evicted[r] += both(lambda: self.core.evict_tokens(r, want), lambda: self.fast.evict_tokens(r, want))
            self.densify_and_compare(r, True)

    @precondition(has_requests)
    @rule(data=st.data(), random=st.booleans(), param=st.integers(0, 5), seed=st.sampled_from([0, 7]))
    def eviction_step(self, data, random, param, seed):
        """The dense path's eviction step for StreamingLLM or Random in one fused kernel call for several requests
        (choice, eviction, densify); the core chooses with its policy, evicts and densifies each request in turn."""
        ids = data.draw(st.lists(st.sampled_from(self.core.request_ids()), unique=True, min_size=1), label="requests")
        items = [(r, data.draw(st.integers(1, max(1, self.core.num_live(r) + 1)), label="budget")) for r in ids]
        policy = RandomPolicy(keep_recent=param) if random else StreamingLLM(sinks=param)
        states = np.zeros(ROWS, np.uint64)
        for r in ids:
            states[self.fast._rows[r]] = request_state(seed, r)
        got = self.fast.evict_densify_many(items, policy, states)
        for (r, budget), (victims, plan) in zip(items, got):
            want, shared, _ = self.core_choice(r, policy, budget, seed)
            assert victims == want
            self.evicted[r] += self.core.evict_tokens(r, want)
            if self.core.write_pos(r) == self.core.num_live(r):
                assert not plan and plan.reason is NoPlanReason.ALREADY_DENSE
                continue
            wanted = plan_densify(self.core.snapshot(r, shared))
            assert (plan == wanted) if wanted else (not plan and plan.reason is wanted.reason)
            if wanted:
                self.commit_densify(r, wanted)
        event(f"{policy.name} step: {sum(bool(v) for v, _ in got)} evicting of {len(got)}")

    @precondition(has_requests)
    @rule(data=st.data(), use_evicted=st.booleans())
    def densify(self, data, use_evicted):
        holey = [r for r in self.core.request_ids() if self.core.write_pos(r) != self.core.num_live(r)]
        self.densify_and_compare(self.pick(data, holey or None), use_evicted)

    def densify_and_compare(self, r, use_evicted):
        shared = [b for b in self.core.block_ids(r) if len(self.core.owners(b)) > 1]
        want = plan_densify(self.core.snapshot(r, shared))
        got = self.fast.densify(r, self.evicted[r] if use_evicted else None)
        event(f"densify: {want.reason.name if not want else 'planned'}")
        if not want:
            assert not got and got.reason is want.reason
            return
        assert got == want
        self.commit_densify(r, want)

    def commit_densify(self, r, plan):
        n = plan.dense_write_pos
        self.core.apply_moves(r, plan.moves)
        self.core.splice(r, -(-n // S), len(plan.src_blocks), (), n)
        self.dropped(plan.src_blocks)
        self.evicted[r] = []

    @precondition(has_requests)
    @rule(data=st.data())
    def step(self, data):
        """A decode step as the dense path runs it, one call per phase on the fast side: some requests each sync a
        few tokens (one call), some of them lose victims (one call), then every request not dense is densified with
        its step's positions, in admission order (one call); the core does each request in turn."""
        ids = data.draw(st.lists(st.sampled_from(self.core.request_ids()), unique=True, min_size=1), label="synced")
        syncs = []
        for r in ids:
            n = data.draw(st.integers(0, 2), label="tokens")
            total = self.core.total_len(r) + n
            need = max(-(-(self.core.write_pos(r) + n) // S) - len(self.core.block_ids(r)), 0)
            new = self.take(need + sum(len(b) for _, b, _ in syncs))
            if new is None or total > TOKENS:
                continue
            syncs.append((r, new[len(new) - need:], total))
        want = [self.core.sync_new_tokens(r, new, total) for r, new, total in syncs]
        assert self.fast.sync_many(syncs) == want
        for _, new, _ in syncs:
            self.held(new)
        evictions = []
        for r, _, _ in syncs:
            live = self.core.live_token_ids(r)
            if live and data.draw(st.booleans(), label="evicts"):
                evictions.append((r, data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=2, unique=True))))
        want = [self.core.evict_tokens(r, victims) for r, victims in evictions]
        assert self.fast.evict_many(evictions) == want
        for (r, _), positions in zip(evictions, want):
            self.evicted[r] += positions
        holey = [r for r in self.core.request_ids() if self.core.write_pos(r) != self.core.num_live(r)]
        got = self.fast.densify_many([(r, self.evicted[r]) for r in holey])
        for r, plan in zip(holey, got):
            want = plan_densify(self.core.snapshot(r, [b for b in self.core.block_ids(r) if len(self.core.owners(b)) > 1]))
            assert (plan == want) if want else (not plan and plan.reason is want.reason)
            if want:
                self.commit_densify(r, want)
        event(f"step: {len(syncs)} synced, {len(evictions)} evicting, {sum(map(bool, got))} densified")

    @precondition(lambda self: len(self.core.request_ids()) > 1)
    @rule(data=st.data(), fill=st.booleans())
    def share_within_one_call(self, data, fill):
        """vLLM hands a request a prefix-cache hit on a block an earlier request of the same step fills: in one call
        request a appends a fresh block, then b lists it too. Accepted when a's sync fills the block (the core's loop
        checks b against what a's sync left); refused with the core's error otherwise, and then the call undoes a's
        sync as well (all or none; the core's loop would have kept it: its answer is taken from a copy)."""
        a, b = data.draw(st.lists(st.sampled_from(self.core.request_ids()), min_size=2, max_size=2, unique=True))
        pos_a, pos_b = self.core.write_pos(a), self.core.write_pos(b)
        if pos_a % S or pos_b % S or pos_a // S != len(self.core.block_ids(a)) \
                or pos_b // S != len(self.core.block_ids(b)):
            return  # both cursors at the end of their lists: the next block is fresh for each
        new = self.take(1)
        if new is None or self.core.total_len(a) + S > TOKENS or self.core.total_len(b) + S > TOKENS:
            return
        calls = [(a, new, self.core.total_len(a) + (S if fill else S - 1)), (b, new, self.core.total_len(b) + S)]
        if fill:
            want = [self.core.sync_new_tokens(r, blocks, total) for r, blocks, total in calls]
            assert self.fast.sync_many(calls) == want
            self.held(new + new)
            event("a block shared within one call")
            return
        trial = copy.deepcopy(self.core)
        trial.sync_new_tokens(*calls[0])
        with pytest.raises(BlockNotOwnedError) as want:
            trial.sync_new_tokens(*calls[1])
        with pytest.raises(BlockNotOwnedError) as got:
            self.fast.sync_many(calls)
        assert str(got.value) == str(want.value) and "has not passed it" in str(got.value)

    @precondition(lambda self: len(self.core.request_ids()) > 2)
    @rule(data=st.data())
    def remove(self, data):
        r = self.pick(data)
        self.dropped(both(lambda: self.core.remove_request(r), lambda: self.fast.remove_request(r)))

    # ---- calls the core refuses: the same error, nothing changed (the invariant below) ------------
    @precondition(has_requests)
    @rule(data=st.data())
    def refused_eviction(self, data):
        r = self.pick(data)
        total, live = self.core.total_len(r), self.core.live_token_ids(r)
        dead = sorted(set(range(total)) - set(live))
        choices = [[total], [-1], [True], ["0"]] + ([[dead[0]]] if dead else []) + ([[live[0], live[0]]] if live else [])
        ids = data.draw(st.sampled_from(choices))
        assert both(lambda: self.core.evict_tokens(r, ids), lambda: self.fast.evict_tokens(r, ids)) is None

    @precondition(has_requests)
    @rule(data=st.data(), kind=st.sampled_from(["listed", "too_short", "below", "out_of_range", "bool", "twice",
                                                "not_an_int"]))
    def refused_sync(self, data, kind):
        r = self.pick(data)
        total, blocks, free = self.core.total_len(r), self.core.block_ids(r), self.take(1)
        if free is None or kind == "listed" and not blocks or kind == "below" and not total:
            return
        call = {"listed": (blocks[:1], total + 1), "too_short": ([], (len(blocks) + 1) * S + total),
                "below": ([], total - 1), "out_of_range": ([NUM_BLOCKS], total), "bool": ([True], total),
                "twice": (free + free, total + S), "not_an_int": (free, "8")}[kind]
        event(f"refused sync: {kind}")
        assert both(lambda: self.core.sync_new_tokens(r, *call), lambda: self.fast.sync_new_tokens(r, *call)) is None

    @precondition(has_requests)
    @rule(data=st.data())
    def refused_share_of_an_unfilled_block(self, data):
        """The holder's block at its cursor is not full: no one may share it."""
        fresh = [r for r in self.core.request_ids() if self.core.total_len(r) == 0]
        holders = [h for h in self.core.request_ids() if self.core.write_pos(h) % S
                   and self.core.write_pos(h) // S < len(self.core.block_ids(h))]
        if not fresh or not holders:
            return
        r, holder = self.pick(data, fresh), self.pick(data, holders)
        prefix = self.core.block_ids(holder)[:self.core.write_pos(holder) // S + 1]
        total = len(prefix) * S
        event("refused share")
        assert both(lambda: self.core.sync_new_tokens(r, prefix, total),
                    lambda: self.fast.sync_new_tokens(r, prefix, total)) is None

    @invariant()
    def same_state(self):
        assert self.fast.state() == self.core.state()
        for r in self.core.request_ids():
            assert self.fast.block_live_counts(r) == self.core.block_live_counts(r)


Lockstep.TestCase.settings = settings(max_examples=80, stateful_step_count=60, deadline=None)
TestLockstep = Lockstep.TestCase


def test_the_lockstep_holds_with_numbas_bounds_checks_on(tmp_path):
    """The same machine in a child whose kernels compile with bounds checking: an index past an array's end
    raises there instead of reading a neighbour's memory."""
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
                           f"{__file__}::TestLockstep"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout


# ---- planted kernel bugs: the lockstep catches each ---------------------------------------------------------
def _kept_live_on_eviction(real):
    """evict: the last victim's slot keeps its holder (a live bit kept on eviction)."""
    def evict(*args):
        code, a, b = real(*args)
        blocks, holders, block_live, (row, _, out) = args[2], args[5], args[6], args[13:]  # FastLayout.arrays() order
        if code == K.OK and a:
            S = holders.shape[0] // block_live.shape[0]
            holders[blocks[row, out[a - 1] // S] * S + out[a - 1] % S] += 1
        return code, a, b
    return evict


def _counts_miss_a_move(real):
    """densify: the last move's destination block is not counted (counts that miss a move)."""
    def densify(*args):
        code, a, b = real(*args)
        tok_pos, counts, holders, block_live, (row, _, moves, _) = args[0], args[3], args[5], args[6], args[13:]
        if code == K.PLANNED and a:
            S = holders.shape[0] // block_live.shape[0]
            counts[row, tok_pos[row, moves[a - 1, 0]] // S] -= 1
        return code, a, b
    return densify


def _shared_block_densified(real):
    """densify: a block another request lists is taken for private (a shared block densified)."""
    def densify(*args):
        listed = args[7]
        before = listed.copy()
        listed[before > 1] = 1
        clipped = listed.copy()
        try:
            return real(*args)
        finally:
            listed[:] = before - (clipped - listed)  # what the kernel unlisted stays unlisted
    return densify


def _slot_off_by_one(real):
    """sync: the first write slot is reported one past the one written (the caller would write a neighbour's)."""
    def sync(*args):
        code, a, b = real(*args)
        if code == K.OK and a:
            args[-1][0] += 1
        return code, a, b
    return sync


def _rank_off_by_one(real):
    """StreamingLLM's kernel: the first victim's rank is one past the sinks' end (a rank off by one)."""
    def streaming_victims_batch(*args):
        args = list(args)
        args[14] += 1  # sinks
        return real(*args)
    return streaming_victims_batch


def _draw_of_another_state(real):
    """Random's kernel: the draws come from another request's state (one bit of it flipped)."""
    def random_victims(*args):
        args = list(args)
        args[16] = args[16] ^ np.uint64(1)  # state
        return real(*args)
    return random_victims


PLANTED = {"rank_off_by_one": ("streaming_victims_batch", _rank_off_by_one),
           "draw_of_another_state": ("random_victims", _draw_of_another_state),
           "kept_live_on_eviction": ("evict", _kept_live_on_eviction), "counts_miss_a_move": ("densify", _counts_miss_a_move),
           "shared_block_densified": ("densify", _shared_block_densified), "slot_off_by_one": ("sync", _slot_off_by_one)}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_a_planted_kernel_bug_is_caught(monkeypatch, bug):
    kernel, plant = PLANTED[bug]
    monkeypatch.setattr(K, kernel, plant(getattr(K, kernel)))
    with pytest.raises(AssertionError):
        # no shrinking: finding the bug is the claim, and the first failing example says where
        run_state_machine_as_test(Lockstep, settings=settings(max_examples=200, stateful_step_count=60, deadline=None,
                                                               phases=(Phase.generate,)))


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared-prefix"])
def test_randoms_kernel_draws_the_cores_victims_at_every_size(shared):
    """Random in the kernel against the core's policy at sizes the lockstep does not reach: a request of 3,000 tokens
    with a fifth of them evicted, at budgets from one victim to every candidate (few victims are found by rank, many
    by one walk over the ranks), with ``keep_recent`` 0, 1 and 40; with a shared prefix, the tokens of the two
    blocks another request lists are protected (the candidates are listed first)."""
    import random as pyrandom
    core, fast = TokenTable(400, 16), FastTable(400, 16, 2, 4096)
    for t in (core, fast):
        t.add_request("a")
        t.sync_new_tokens("a", list(range(188)), 3000)
    if shared:
        for t in (core, fast):
            t.add_request("b")
            t.sync_new_tokens("b", [0, 1], 32)
    dead = sorted(pyrandom.Random(5).sample(range(3000), 600))
    assert core.evict_tokens("a", dead) == fast.evict_tokens("a", dead)
    protected = frozenset(t for t, _ in core.live_in_blocks("a", [0, 1])) if shared else frozenset()
    assert len(protected) == (32 - len([t for t in dead if t < 32]) if shared else 0)
    for keep in (0, 1, 40):
        for budget in (2399, 2398, 2390, 2300, 1800, 600, 41, 1):
            for seed in (0, 9):
                view = RequestView("a", core.live_tokens("a"), 3000, budget, seed=seed, protected=protected)
                want = RandomPolicy(keep_recent=keep).select_victims(view)
                assert fast.random_victims("a", keep, budget, request_state(seed, "a")) == want, (keep, budget, seed)
                assert len(want) == min(2400 - budget, 2400 - keep - len(protected))


def test_without_numba_the_fast_path_says_why_in_one_line():
    """numba missing: ``unavailable()`` names it (the caller runs the core), and importing the package still works."""
    code = ("import sys; sys.modules['numba'] = None\n"
            "from vtoken.integration.fastpath import available, unavailable\n"
            "print(available()); print(unavailable())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ok, why = proc.stdout.splitlines()
    assert ok == "False" and why.startswith("the fast path needs numba and numpy (") and "numba" in why[30:]


def test_a_gather_kernel_that_fails_to_compile_leaves_the_core_path_with_its_reason():
    """``unavailable()`` compiles every kernel file, the gather path's too: a gather kernel numba refuses (here a
    float index, as a typo would make) is named at start-up, where the caller runs the core, not inside a step."""
    code = ("import numpy as np\n"
            "from numba import njit\n"
            "from vtoken.integration.fastpath import available, gather_kernels, unavailable\n"
            "@njit\n"
            "def broken(meta, rows, S, out):\n"
            "    return out[rows[0] / S]\n"
            "gather_kernels.excess_order = broken\n"
            "print(available()); print(unavailable())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ok, why = proc.stdout.splitlines()[:2]
    assert ok == "False" and why.startswith("the fast path's kernels failed to compile: TypingError: "), why


def test_the_layout_reports_its_footprint():
    from vtoken.integration.fastpath.layout import Capacity, FastLayout
    cap = Capacity(rows=64, tokens=2048, num_blocks=8192, block_size=16)
    fp = FastLayout(cap).footprint()
    assert cap.max_blocks == 129 and cap.max_positions == 2064
    assert fp["tok_pos"] == 64 * 2048 * 4 and fp["pos_token"] == 64 * 2064 * 4 and fp["holders"] == 8192 * 16 * 2
    # tok_pos, pos_token, blocks and counts, meta, and the live index: 32 words of bits, their counts, 1 group
    assert fp["per_row"] == 2048 * 4 + 2064 * 4 + 2 * 129 * 4 + 10 * 8 + 32 * 8 + 32 * 4 + 1 * 4
    assert fp["total"] == sum(v for k, v in fp.items() if k not in ("per_row", "total"))
    with pytest.raises(ConfigError, match="rows must be an int >= 1, got True"):
        Capacity(rows=True, tokens=8, num_blocks=4, block_size=4)


def test_vllms_kernel_scan_passes_after_the_fast_path_is_imported():
    """vLLM reads ``vars(x).get("kernel")`` of every module attribute when a worker starts
    (``triton_utils.dispatcher._rebind_kernels``); numba's llvmlite library wrapper broke that scan, and so every
    vLLM engine started after the fast path was imported in the same process. The scan, as vLLM runs it, passes now;
    the wrapper still reaches its C symbols."""
    pytest.importorskip("vllm")
    from llvmlite.binding import ffi
    from vllm.triton_utils.dispatcher import _rebind_kernels

    _rebind_kernels([])  # raises AttributeError('_lib_fn_wrapper' ...) without the fast path's NOTE
    assert not hasattr(ffi.lib, "__dict__") and callable(ffi.lib.LLVMPY_GetVersionInfo)
    with pytest.raises(AttributeError):
        ffi.lib.__wrapped__  # noqa: B018 -- a dunder is not forwarded to the C library
    # teeth: numba alone (no fast path) in a fresh process breaks the same scan
    code = "import numba\nfrom vllm.triton_utils.dispatcher import _rebind_kernels\n_rebind_kernels([])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "'_lib_fn_wrapper' object has no attribute 'get'" in proc.stderr


def test_a_steps_sync_grows_its_record_and_leaves_odd_items_to_the_cores_checks_in_order():
    """``sync_many``'s one kernel call (``K.sync_step``): a step longer than the kept record grows it and answers as
    the core's loop does; a step whose first item goes below its synced length while a later one names a block
    outside the pool gets the core's error for the first item (the kernel's NOT_USUAL hands the items to the core's
    checks one by one), and nothing changes."""
    from vtoken.core.errors import TokenOutOfRangeError

    core, fast = TokenTable(NUM_BLOCKS, S), FastTable(NUM_BLOCKS, S, ROWS, TOKENS)
    for r in ("a", "b"):
        core.add_request(r)
        fast.add_request(r)
    small = fast._sync_out.shape[0]
    items = [("a", list(range(0, 10)), 40), ("b", list(range(10, 20)), 37)]
    assert fast.sync_many(items) == [core.sync_new_tokens(*item) for item in items]
    assert fast._sync_out.shape[0] > small  # 77 slots + 3 starts did not fit the first record
    before = fast.state()
    with pytest.raises(TokenOutOfRangeError) as got:
        fast.sync_many([("a", [], 39), ("b", [NUM_BLOCKS + 3], 40)])
    with pytest.raises(TokenOutOfRangeError) as want:
        core.sync_new_tokens("a", [], 39)
    assert str(got.value) == str(want.value) and "below the synced length 40" in str(got.value)
    assert fast.state() == before == core.state()


# ---- found by the kernels' mutation run (fuzz/mutation_kernels.json) --------------------------------------------------
def test_densify_refuses_to_write_a_shared_new_cursor_block_as_the_core_does():
    """a and b share block 0 (full); a evicts its last two tokens and everything after: densify's new cursor falls
    inside block 0, which its next appends would overwrite. Both refuse with the same NoPlan, detail included (the
    kernel finds the first such block, the table words it as the core does), and nothing changes. Kills
    ``densify__mutmut_109`` (that line was never reached)."""
    core, fast = TokenTable(16, 4), FastTable(16, 4, 4, 64)
    for t in (core, fast):
        t.add_request("a")
        t.sync_new_tokens("a", [0, 1], 6)
        t.add_request("b")
        t.sync_new_tokens("b", [0, 2], 6)
        t.evict_tokens("a", [2, 3, 4, 5])
    before = fast.state()
    want = plan_densify(core.snapshot("a", frozenset(core.shared_blocks("a"))))
    assert want.reason is NoPlanReason.SHARED_BLOCK and want.detail == "request 'a': blocks [0]"
    assert fast.densify("a") == want and fast.state() == before == core.state()


@pytest.mark.parametrize("hint", [[1, 1], [1, 3], [1, 5, 7]], ids=["repeated", "a live position", "too many"])
def test_densify_plans_as_without_a_hint_when_the_evicted_positions_given_are_wrong(hint):
    """``densify``'s evicted positions are a hint for the O(evicted) search of the holes: a list with a repeated or
    live position, or more positions than holes, is not the holes, and the scan below n_live decides, as with no
    hint. Kills ``densify__mutmut_43`` (the repeat check weakened: a wrong plan)."""
    tables = [FastTable(16, 4, 4, 64) for _ in range(2)]
    for t in tables:
        t.add_request("a")
        t.sync_new_tokens("a", [0, 1, 2], 12)
        t.evict_tokens("a", [1, 5])
    got, want = tables[0].densify("a", hint), tables[1].densify("a", None)
    assert got == want and tuple(got.moves) == tuple(want.moves) and tables[0].state() == tables[1].state()


def test_rows_of_answers_again_only_for_the_same_ids_and_rows():
    """``rows_of`` keeps its last two answers by the id objects asked for: a request removed and another admitted
    moves the rows, and the next call must look them up again; a bool never matches a remembered int id."""
    fast = FastTable(NUM_BLOCKS, S, ROWS, TOKENS)
    for r in (1, "b", "c"):
        fast.add_request(r)
    ids, pair = [1, "b", "c"], [1, "c"]
    first = fast.rows_of(ids)
    assert first.tolist() == [0, 1, 2] and fast.rows_of(list(ids)) is first  # the same objects: remembered
    assert fast.rows_of(pair).tolist() == [0, 2]
    fast.remove_request(1)
    fast.add_request("d")  # takes row 0
    fast.add_request(1)  # row 3 now
    assert fast.rows_of(pair).tolist() == [3, 2]
    fast.remove_request("b")
    with pytest.raises(UnknownRequestError, match="unknown request 'b'"):
        fast.rows_of(ids)  # "b" left: no remembered answer
    with pytest.raises(UnknownRequestError, match="unknown request True"):
        fast.rows_of([True, "c"])  # equal to [1, "c"], but not the same objects
