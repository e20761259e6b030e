# Meridian: `make up` runs the whole system on this machine; `make test` runs every test.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The edge's request path compiled with mypyc; `edge.native` ignores a build whose sources
# have changed, so this only decides when to rebuild. A failed or removed build leaves a
# stamp too, so neither is retried until a source changes (or `make edge-native`).
EDGE_BUILD := edge/_build/stamp.json

.PHONY: setup engine up test test-fast lint bench clean edge-native edge-pure
# `make up ENGINE=vllm` runs real vLLM engines (CPU build) instead of enginesim.
ENGINE ?= enginesim
# pytest-xdist workers for `make test`: more than the cores, as much of the suite waits on the
# processes it starts (engines, edges, labs); tests/conftest.py keeps together what must be.
TEST_WORKERS ?= 3
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadgroup
# The lab and the tests run in lab mode (lab-only secrets, plain HTTP); production is the default.
up test test-fast bench lint: export MERIDIAN_LAB = 1

setup: $(STAMP) $(EDGE_BUILD)
	@sh tools/ensure_prometheus.sh
	@sh tools/ensure_iproute2.sh

# Reinstalls only when pyproject.toml changes, so a second `make setup` takes a moment.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip wheel setuptools
	PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 $(BIN)/python -m pip install -q -e '.[dev]'
	@touch $@

$(EDGE_BUILD): $(STAMP) $(wildcard edge/*.py) tools/build_edge.py
	@if grep -qs '"disabled": true' $@; then touch $@; \
	else $(BIN)/python tools/build_edge.py || \
	  echo "[build_edge] could not compile the edge; it runs from source (slower)"; fi

edge-native: $(STAMP)
	$(BIN)/python tools/build_edge.py

edge-pure: $(STAMP)
	$(BIN)/python tools/build_edge.py --clean

# vLLM's CPU build in .venv-engine and SmolLM2-135M-Instruct in var/models, built once per
# machine and linked here; says in one line where this machine cannot run it.
engine:
	@$(PYTHON) tools/build_engine.py

up: setup $(if $(filter vllm,$(ENGINE)),engine)
	$(BIN)/python -m controlplane.lab --engine $(ENGINE)

test: setup engine
	bash tools/ensure_chromium.sh
	$(BIN)/python -m controlplane.lab.prepare_tests
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) --durations=25
	@# The edge once more from its sources: what runs where it could not be compiled.
	MERIDIAN_EDGE_PURE=1 MERIDIAN_CONTRACT_ENGINES=enginesim $(BIN)/python -m pytest $(PYTEST_PARALLEL) tests/edge tests/contract

test-fast: setup
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not e2e and not browser and not real_engine and not skypilot_server"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: setup
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) .venv-engine var build *.egg-info edge/*.so edge/_build edge/_build.*
