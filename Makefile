# kidx: set-up, the main job on embedded defaults, and the tests.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu on a machine whose PyPI would serve CUDA torch.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1

.PHONY: setup run demo stack-stop test test-quick lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: a bare requirement would pull a CUDA build of several GB.
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[local,dev]'
	touch $@

setup: $(VENV)/.installed

# The main job on embedded defaults: a local SQLite file (./data/kidx.db), the local model.
run: setup
	$(VENV)/bin/kidx init
	$(PY) ops/scripts/load_corpus.py ../shared/corpus/rustbook
	$(VENV)/bin/kidx index --all --inline
	$(VENV)/bin/kidx status --summary
	$(VENV)/bin/kidx search "how does ownership move a String" -k 3

# The worker system on this machine: Redis (started only if none answers), a worker, beat and
# Flower (generated credentials, loopback only); the corpus indexed through the queue; a search.
# `make stack-stop` ends what it started.
DEMO_CORPUS := ../shared/corpus/rustbook
demo: setup
	$(PY) -m ops.stack start --demo
	$(VENV)/bin/kidx init
	if [ -d $(DEMO_CORPUS) ]; then $(PY) ops/scripts/load_corpus.py $(DEMO_CORPUS); \
	else $(PY) ops/scripts/sample_notes.py; fi
	$(VENV)/bin/kidx reindex --all --wait --timeout 900
	$(VENV)/bin/kidx search "how does ownership move a String" -k 3
	$(PY) -m ops.stack status
	@echo "Tasks page: the Flower address and credentials above; stop with: make stack-stop"

stack-stop:
	$(PY) -m ops.stack stop

# Everything (the fault suite included), in four processes (two cores: the stack modules mostly
# wait on their workers; 258 s against 300 s with three), a module that starts workers whole in
# one of them (its stack starts once), each process on Redis databases of its own (1-8).
test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -n 4 --dist loadfile

# The engine, the CLI and the stores: no worker process, fewer hypothesis examples (~1 min).
test-quick: setup
	HYPOTHESIS_PROFILE=quick $(PY) -m pytest -q -m "not stack and not model" -n 3 --dist load

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Every benchmark, each printing its table (bench/README.md); the peers are installed first.
bench: setup
	$(PY) -m pip install -q -e '.[local,dev,bench]'
	$(PY) bench/chunking.py
	$(PY) bench/throughput.py
	$(PY) bench/incremental.py
	$(PY) bench/memory.py
	$(PY) bench/search.py

# Not ./data: the default database lives there (and the demo's pid files, which stack-stop
# needs); remove it yourself when you mean to, after `make stack-stop`.
clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

# The fault suite (tests/test_faults_*.py) at soak scale, not run by CI: 3000 items and 50 kills,
# 1000 items under provider chaos, an outage of 1000, 2000 edits of 100 notes in a minute. Any
# figure can be set alone, e.g. `make soak KIDX_FAULT_CRASH_KILLS=200` (see `scale` there).
.PHONY: soak
soak: setup
	KIDX_SOAK=1 $(PY) -m pytest -q -m fault tests/test_faults_*.py -p no:cacheprovider --timeout=3600
