"""Proof obligations: one named, machine-checked claim each, and how to run them all.

Every module in spec/ exposes ``obligations() -> list[Obligation]``. ``vtoken spec
check`` runs them all and prints invariant / transition / result / seconds.

An obligation's ``check`` returns an ``Outcome``:
  proved          the solver showed the negated claim unsatisfiable for every
                  state (an inductive step, an unbounded CHC proof);
  bounded         no counterexample exists within the stated bound, which the
                  outcome carries (``bound``) and ``spec check`` prints as
                  ``bounded (…)``; nothing is claimed beyond it;
  counterexample  a concrete state/trace violating the claim, printed in the
                  project's own terms (requests, tokens, blocks);
  unknown         the solver gave up (timeout, incompleteness).

``spec check`` passes when every obligation is proved or bounded: a bounded
claim is an honest, stated result, but it is never printed as proved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import z3

PROVED, BOUNDED, COUNTEREXAMPLE, UNKNOWN = "proved", "bounded", "counterexample", "unknown"
PASSING = (PROVED, BOUNDED)


@dataclass(frozen=True)
class Outcome:
    status: str
    detail: str = ""  # the counterexample, or why unknown, or what was covered
    bound: str = ""  # BOUNDED only: the bound, short (e.g. "12 steps", "S<=16, 8 blocks")

    def __post_init__(self) -> None:
        assert self.status in (PROVED, BOUNDED, COUNTEREXAMPLE, UNKNOWN), self.status
        assert bool(self.bound) == (self.status == BOUNDED), "a bounded outcome states its bound, and only it"

    @property
    def passed(self) -> bool:
        return self.status in PASSING

    @property
    def label(self) -> str:
        """What ``spec check`` prints: ``proved``, ``bounded (…)``, ``counterexample`` or ``unknown``."""
        return f"bounded ({self.bound})" if self.status == BOUNDED else self.status


@dataclass(frozen=True)
class Obligation:
    id: str  # e.g. "I2/evict_token"
    invariant: str  # e.g. "I2"
    transition: str  # e.g. "T3 evict_token", or "planner compact", "protocol commit-at-launch"
    claim: str  # one sentence
    check: Callable[[], Outcome]


@dataclass(frozen=True)
class Result:
    obligation: Obligation
    outcome: Outcome
    seconds: float


def run(ob: Obligation) -> Result:
    t0 = time.perf_counter()
    try:
        out = ob.check()
    except z3.Z3Exception as e:
        out = Outcome(UNKNOWN, f"z3 error: {e}")
    return Result(ob, out, time.perf_counter() - t0)


def prove(claim: z3.BoolRef, timeout_ms: int = 60_000,
          explain: Callable[[z3.ModelRef], str] | None = None) -> Outcome:
    """Prove ``claim`` valid by showing ``Not(claim)`` unsatisfiable."""
    s = z3.Solver()
    s.set("timeout", timeout_ms)
    s.add(z3.Not(claim))
    r = s.check()
    if r == z3.unsat:
        return Outcome(PROVED)
    if r == z3.sat:
        m = s.model()
        return Outcome(COUNTEREXAMPLE, explain(m) if explain else str(m))
    return Outcome(UNKNOWN, s.reason_unknown())
