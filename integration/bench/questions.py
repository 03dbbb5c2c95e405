"""The questions ``vtoken bench sim`` answers, in order. Each is a module with
KEY, TITLE, PAPER, run(ctx) -> report, table(report) -> markdown lines, plot(report, path).

Q4 (overhead and overlap) and Q6 (prefix caching, quality) need a serving
engine, and Q8 (bursty eviction) is its own issue: each will be one more
module here, and the vLLM half a second registry beside this one.
"""

from __future__ import annotations

from types import ModuleType

from vtoken.core.errors import ConfigError

from . import q1_trapped_capacity, q2_paired_frontier, q3_capacity_frontier, q5_sensitivity, q7_bookkeeping_cost

QUESTIONS: dict[str, ModuleType] = {m.KEY: m for m in (q1_trapped_capacity, q2_paired_frontier,
                                                         q3_capacity_frontier, q5_sensitivity, q7_bookkeeping_cost)}


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
