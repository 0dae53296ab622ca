# One command to set up and run the demo, one to set up and run the tests (README quick start).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-keep test lint typecheck worker broker bench chaos clean system-packages

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[pipeline,dev]'
	touch $(STAMP)

install: $(STAMP)

# The browser test drives Debian's chromium through chromedriver; the alert rules are checked with promtool (Debian's
# prometheus package). Installed when missing, as root or through sudo; CI runs as root on a clean machine.
system-packages:
	@missing=""; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null 2>&1 || missing="$$missing chromium-driver"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
		echo "installing system packages:$$missing"; \
		if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

demo: $(STAMP)
	$(BIN)/python -m demo

demo-keep: $(STAMP)
	$(BIN)/python -m demo --keep-running

test: $(STAMP) system-packages
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
