# Two entry points: `make fuzz` (the main job) and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: fuzz test demo bench-table clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV) || { $(PYTHON) -m pip install --quiet --user virtualenv && $(PYTHON) -m virtualenv $(VENV); }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Until the fuzzer lands (issue: fuzz/), the main job runs the core demo with every invariant checked.
fuzz: $(STAMP)
	$(VENV)/bin/vtoken demo

test: $(STAMP)
	$(PY) -m pytest

demo: $(STAMP)
	$(VENV)/bin/vtoken demo

bench-table: $(STAMP)
	$(PY) tests/bench_table_memory.py

clean:
	rm -rf $(VENV) build *.egg-info
