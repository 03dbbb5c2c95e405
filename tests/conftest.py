"""Hypothesis profiles. `make test` uses "ci" (quick); HYPOTHESIS_PROFILE=thorough runs longer.

No example database in the repo: campaigns keep theirs under their output directory.
"""

import contextlib
import os

import pytest
from hypothesis import HealthCheck, settings

from vtoken.fuzz.campaign import seed_only_generation

settings.register_profile("ci", max_examples=40, stateful_step_count=50, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck), print_blob=True)
settings.register_profile("thorough", max_examples=1000, stateful_step_count=150, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck), print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Hypothesis also draws literals from every local module imported so far, so what a derandomized test generates
# would depend on which test files were collected and run before it (CI's whole suite against a developer's one
# file): pinned for the session, as campaigns pin it per batch (docs/fuzzing.md, "Determinism").
_pinned = contextlib.ExitStack()


def pytest_configure(config):
    _pinned.enter_context(seed_only_generation())
    if not hasattr(config, "workerinput"):  # the controller, before xdist's workers start
        _warm_compiled_kernels()


def _warm_compiled_kernels() -> None:
    """NOTE: numba compiles the fast path's kernels into its cache (``integration/fastpath/__pycache__``) the first
    time any process needs them: about 20 s on a clean clone (CI's every run), paid at once by every test process,
    engine core and server that starts before the cache is written, on two cores. Compiled here once, before the
    workers start; 0.5 s once the cache is there."""
    from vtoken.integration import fastpath
    if fastpath.unavailable() is None:
        from vtoken.integration.fastpath import relocate
        relocate.warm_up()


def pytest_unconfigure(config):
    _pinned.close()
    import gc
    gc.unfreeze()  # the interpreter's last collections see everything (pytest_runtest_setup froze the heap)


def _young_collections_for_vllm() -> None:
    """NOTE: vLLM collects the whole heap seven times per engine it starts and stops (``load_model`` twice,
    ``freeze_gc_heap`` three times, the profiling cache's and the distributed state's cleanups), and it unfreezes
    the heap when an engine shuts down. In a test process, which holds torch, vLLM, Hypothesis and every collected
    test module, each full collection takes 0.3 s or more: 33 of the 57 s of tests/test_vllm_fastpath.py were
    spent in them. Here a full collection asked for from inside vLLM collects the young generations only. Ours are
    kept whole: ``vllm_engine.start_llm`` collects everything before each engine (the previous engine's KV connector
    agent must be gone), so no engine's garbage outlives the next engine's start. Engine processes of their own
    (multiprocess engines, tensor-parallel workers, servers) keep vLLM's behaviour."""
    import gc
    import sys

    collect = gc.collect

    def collect_young_for_vllm(generation: int = 2) -> int:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if generation > 1 and (caller == "vllm" or caller.startswith("vllm.")):
            generation = 1
        return collect(generation)

    gc.collect = collect_young_for_vllm


_young_collections_for_vllm()


def _register_kernel_overrides_once() -> None:
    """NOTE: every engine vLLM's CPU platform starts registers its C++ stand-ins for Triton kernels again
    (``CpuPlatform.register_triton_kernel_overrides``): it wraps the wrapper the previous engine installed and scans
    every attribute of every loaded module for holders of the old one, 0.7 s or more per engine in a test process.
    Here it runs for the first engine of a process only; every later engine finds the same overrides in place
    (an engine process of its own registers them as vLLM does). Installed once vLLM's platform module is loaded."""
    import sys

    cpu = sys.modules.get("vllm.platforms.cpu")
    if cpu is None or getattr(cpu.CpuPlatform, "_vtoken_tests_once", False):
        return
    register = cpu.CpuPlatform.register_triton_kernel_overrides.__func__
    done: list = []

    def register_once(cls) -> None:
        if not done:
            register(cls)
            done.append(True)

    cpu.CpuPlatform.register_triton_kernel_overrides = classmethod(register_once)
    cpu.CpuPlatform._vtoken_tests_once = True


_FULL_COLLECTION_EVERY = 100  # tests
_tests_run = 0


def pytest_runtest_setup(item):
    """NOTE: once vLLM and torch are imported a worker's heap holds ~800,000 objects, and Python's automatic full
    collections scan all of them: the simulator's reports (tests/test_bench_sim.py) took 76 s after an engine had
    run in the process, 58 of them in 140 automatic full collections, against 24 s in a fresh one. Before each test
    the heap is frozen (``gc.freeze``): the collector then scans what the test itself allocates. What was alive, or
    garbage, at that point stays until an engine starts (``vllm_engine.start_llm`` unfreezes and collects
    everything, so no old engine survives it) or, at the latest, for ``_FULL_COLLECTION_EVERY`` tests: the frozen
    garbage stays bounded in the runs without engines."""
    import gc
    global _tests_run
    _register_kernel_overrides_once()
    _tests_run += 1
    if _tests_run % _FULL_COLLECTION_EVERY == 0:
        gc.unfreeze()
        gc.collect()
    gc.freeze()


_SHARED_SCOPES = ("module", "package", "session")

# The files with the most work, most first (``--durations``, 2026-12-06): on two workers the longest groups start
# first and the short tests fill in beside them, so no long group is left alone at the end. The two that run
# processes of their own (test_vllm_tp.py's ranks, test_vllm_serve.py's server) are kept apart: side by side they
# oversubscribe the two cores (a run with them first and second took a minute longer). Order within a file, and
# of every other file, is the collection's.
_HEAVIEST_FIRST = ("tests/test_vllm_tp.py", "tests/test_bench_vllm.py", "tests/test_vllm_gather.py",
                   "tests/test_bench_sim.py", "tests/test_vllm_serve.py", "tests/test_fuzz_vllm.py",
                   "tests/test_vllm_policy_zoo.py", "tests/test_spec_crosshair.py", "tests/test_vllm_e2e.py",
                   "tests/test_byte_model.py", "tests/test_vllm_prefix_preemption.py", "tests/test_vllm_eviction.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """``make test`` runs on two workers (pytest-xdist, ``--dist loadgroup``): tests go one by one to whichever
    worker is free, except that the tests of a file that share a fixture of module (or wider) scope, an engine
    or a benchmark run, form one group and run in one worker, so that fixture is built once, as in a serial
    run. Without xdist the marks do nothing; the order (heaviest files first) holds in any run."""
    rank = {f: i for i, f in enumerate(_HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep order
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        # baseid: pytest's own fixtures (tmp_path_factory is session-scoped) have none; ours name their file
        if any(d.scope in _SHARED_SCOPES and d.baseid for ds in defs.values() for d in ds):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    # ``@pytest.mark.slow``: a wider sample of what faster tests check already (another block size, more policies
    # through the same tensor-parallel path, a second server configuration), kept out of `make test`'s 20 minutes;
    # VTOKEN_SLOW_TESTS=1 runs it too
    if not os.environ.get("VTOKEN_SLOW_TESTS"):
        skip = pytest.mark.skip(reason="slow sample: VTOKEN_SLOW_TESTS=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
