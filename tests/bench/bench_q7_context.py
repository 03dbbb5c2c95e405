"""Q7 with its context axis in full and its concurrency axis cut to C = 16 and 64 (the full question runs C up
to 1,024, over an hour here), written as q7.json / q7.png / tables to OUT.

    python tests/bench/bench_q7_context.py OUT

The settings are ``vtoken bench vllm``'s (5 seeds, pinned to one core) with ``q7_concurrency = (16, 64)``; the
context axis is 128, 512, 1,536 and 2,000 prompt tokens at C = 8 and 64, for indirection only, Naive-Evict,
compact, densify and H2O + densify (``q7_vllm_bookkeeping``). Results: docs/results.md, "Q7 Host bookkeeping
inside vLLM".
"""
import sys
from dataclasses import replace
from pathlib import Path

from vtoken.integration.bench import q7_vllm_bookkeeping as q7
from vtoken.integration.bench.runner import run_questions
from vtoken.integration.bench.settings import vllm_bench_settings

out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench-q7-context")
out.mkdir(parents=True, exist_ok=True)
settings = replace(vllm_bench_settings(quick=False), q7_concurrency=(16, 64))
with open(out / "tables.md", "w") as tables:
    run_questions([q7], settings, out, "python tests/bench/bench_q7_context.py " + str(out), tables=tables)
print((out / "tables.md").read_text())
