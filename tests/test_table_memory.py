"""The token table stays within 12 bytes of metadata per token (tracemalloc; memory, not time)."""

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location("bench",
                                               pathlib.Path(__file__).parent / "bench" / "bench_table_memory.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_metadata_per_token_is_at_most_12_bytes():
    m = bench.measure(tokens=100_000, requests=4, block_size=16, evict=0.5, seed=0)
    assert m["tokens"] == 100_000
    assert 4.0 <= m["per_request_bytes_per_token"] <= 9.0, m  # 4 B is the slot array alone
    assert m["total_bytes_per_token"] <= 12.0, m
