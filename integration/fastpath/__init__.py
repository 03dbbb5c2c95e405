"""vtoken.integration.fastpath: the token tables of every request as fixed arrays, changed by compiled kernels.

The core (``vtoken.core``) is the specification and the reference implementation: one Python object per request,
every mutation validated, every view derivable. Inside vLLM it costs 60-150 us per request and step, where an H100
decode step leaves vtoken about 5. This package is a second implementation of the same behaviour: one structure of
arrays for all requests (``layout.FastLayout``), numba-compiled kernels with a plain array ABI that validate before they mutate
(``kernels``; the gather path's compaction, its commit, Naive-Evict's release and the pressure pack in
``gather_kernels``), a table with the core's interface and errors over them (``table.FastTable``), the gather path's
planner and commits as the manager's (``gather.FastGather``), and the runtimes: the dense path with densify
(``runtime.FastRuntime``) and the gather path with compact or Naive-Evict alone (``gather_runtime.GatherRuntime``),
whose plans' moves travel packed (``moves.MoveArray``) and whose read-list changes travel as one flat record per
step (``reads.StepReads``, taken in ``read_kernels``); on the workers' side, a compiled mover for CPU KV caches
(``relocate.HostMover``) and the table of read lists those records patch (``reads.ReadTable``). The two
implementations are proved equal operation by operation
(tests/test_fastpath_table.py, tests/test_fastpath_gather.py: the same random operations into the core and the fast path, every request's state
compared after each one) and step by step (``shadow.ShadowedRuntime``: the core's runtime beside the fast one,
compared after every call; ``vtoken fuzz --target fast``; inside vLLM under strict verify).

numba is optional: without it (or when a kernel fails to compile) ``available()`` says why, and the caller runs the
core. Imported by ``vtoken.integration.vllm`` and the tests, never by ``vtoken.core``.
"""

from __future__ import annotations

from functools import cache


@cache
def unavailable() -> str | None:
    """Why the compiled kernels cannot run here (numba missing, or a kernel failed to compile), or None."""
    try:
        import numba  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        return f"the fast path needs numba and numpy ({e})"
    try:
        from . import gather_kernels, kernels, read_kernels
        # NOTE: every kernel, the gather path's too: one that compiled lazily would compile (about 10 s) inside a
        # serving step, and one that failed to would fail it rather than leave the core path to run
        kernels.warm_up()
        read_kernels.warm_up()
        gather_kernels.warm_up()
    except Exception as e:  # a compile error of any kind: the core runs instead
        return f"the fast path's kernels failed to compile: {type(e).__name__}: {e}"
    return None


def available() -> bool:
    return unavailable() is None
