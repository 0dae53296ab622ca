# One command to set up and run the demo, one to set up and run the tests (README quick start).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-keep test lint typecheck worker broker bench chaos clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[pipeline,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m demo

demo-keep: $(STAMP)
	$(BIN)/python -m demo --keep-running

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

worker: $(STAMP)
	$(BIN)/faust -A app worker -l info

broker: $(STAMP)
	$(BIN)/python -m rebound.embedded_broker

bench: $(STAMP)
	$(BIN)/python -m bench

chaos: $(STAMP)
	$(BIN)/python -m chaos --out out/chaos

clean:
	rm -rf $(VENV) data .pytest_cache .mypy_cache .ruff_cache
