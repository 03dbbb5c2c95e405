"""vtoken.core.sim: what drives the runtime without an engine (standard library only).

``simulator`` (a deterministic serving loop over the runtime: admission, steps, eviction, reclamation),
``workloads`` (synthetic and trace-shaped request mixes), ``inmemory`` (a copy engine over tags instead of
tensors, with test controls for late, failed and torn copies) and ``demo`` (``vtoken demo``).
NOTE: imports flow one way: this package imports ``vtoken.core``; nothing in ``vtoken.core`` imports it.
"""

from .inmemory import InMemoryCopyEngine, TagStore

__all__ = ["InMemoryCopyEngine", "TagStore"]
