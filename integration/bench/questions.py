"""The questions ``vtoken bench sim`` answers, in order. Each is a module with
KEY, TITLE, PAPER, run(ctx) -> report, table(report) -> markdown lines, plot(report, path).

Q4 (overhead and overlap) and Q6 (prefix caching, quality) need a serving
engine: the vLLM half is a second registry beside this one. Q8 (bursty
eviction: reclamation lag with a fixed theta_F vs the adaptive trigger) is
``q8_bursty_eviction``.
"""

from __future__ import annotations

from types import ModuleType

from vtoken.core.errors import ConfigError

from . import (q1_trapped_capacity, q2_paired_frontier, q3_capacity_frontier, q5_sensitivity, q7_bookkeeping_cost,
               q8_bursty_eviction)

QUESTIONS: dict[str, ModuleType] = {m.KEY: m for m in (q1_trapped_capacity, q2_paired_frontier,
                                                         q3_capacity_frontier, q5_sensitivity, q7_bookkeeping_cost,
                                                         q8_bursty_eviction)}


def select_questions(keys: list[str] | None, registry: dict[str, ModuleType] = QUESTIONS,
                     half: str = "") -> list[ModuleType]:
    """The modules of ``registry`` for ``keys`` (None: all), in the registry's order; a specific error for an
    unknown key (``half`` names the registry in it)."""
    if not keys:
        return list(registry.values())
    unknown = [k for k in keys if k not in registry]
    if unknown:
        raise ConfigError(f"unknown question(s) {unknown}{half}; choose from {list(registry)}")
    return [m for k, m in registry.items() if k in keys]
