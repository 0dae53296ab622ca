# One command to set up and run the demo, one to set up and run the tests (README quick start).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-keep test lint typecheck worker broker bench chaos clean system-packages \
	test-pyspark-floor pipeline-zip pipeline-dist pipeline-env

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

# The oldest pyspark the pipeline supports (pyproject's `pipeline` extra, pipeline/_requirements.py): a side venv with
# exactly that version runs the pipeline tests, so the floor is tested, not only declared.
PYSPARK_FLOOR ?= 4.2.0
FLOOR_VENV ?= build/pyspark-$(PYSPARK_FLOOR)-venv

test-pyspark-floor:
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet 'pyspark==$(PYSPARK_FLOOR)' -e '.[pipeline,dev]'
	$(FLOOR_VENV)/bin/python -c 'import pyspark, sys; sys.exit(pyspark.__version__ != "$(PYSPARK_FLOOR)" and "pyspark " + pyspark.__version__ + " is not the floor $(PYSPARK_FLOOR)")'
	PYSPARK_PYTHON=$(abspath $(FLOOR_VENV))/bin/python PYSPARK_DRIVER_PYTHON=$(abspath $(FLOOR_VENV))/bin/python \
		$(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/pipeline

# Artefacts for running the pipeline on a cluster (docs/pipeline.md, "Running on a cluster"):
#   pipeline-zip: $(DIST)/pipeline.zip for --py-files, $(DIST)/run_pipeline.py as spark-submit's main file and
#                 $(DIST)/pipeline-requirements.txt, what the executors' Python needs (any python3 builds these)
#   pipeline-dist: those plus a wheel of the project (its Requires-Dist lists the `pipeline` extra)
#   pipeline-env: $(DIST)/pipeline-env.tar.gz, a venv-pack'ed venv with those requirements, for --archives
DIST ?= dist
PIPELINE_ENV_PYTHON ?= $(PYTHON)
# Spark's own pyspark.zip and py4j, as executors get them, to check the packed env against (from .venv's pyspark)
SPARK_PYTHON_PATH ?= $(shell test -x $(BIN)/python && $(BIN)/python -c 'import glob, os, pyspark; print(":".join(sorted(glob.glob(os.path.join(os.path.dirname(pyspark.__file__), "python", "lib", "*.zip")))))' 2>/dev/null)

pipeline-zip:
	rm -rf $(DIST)/stage $(DIST)/pipeline.zip && mkdir -p $(DIST)/stage
	cp -R pipeline $(DIST)/stage/
	find $(DIST)/stage -name __pycache__ -prune -exec rm -rf {} +
	cd $(DIST)/stage && $(PYTHON) -m zipfile -c ../pipeline.zip pipeline
	rm -rf $(DIST)/stage
	printf '%s\n' '# spark-submit main file: runs a pipeline job from pipeline.zip (--py-files).' 'import sys' '' \
		'from pipeline.__main__ import main' '' 'main()' 'sys.exit(0)' > $(DIST)/run_pipeline.py
	$(PYTHON) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(*[r for r in p["dependencies"] if r.startswith("aiokafka")], *[r for r in p["optional-dependencies"]["pipeline"] if not r.startswith("pyspark")], sep="\n")' > $(DIST)/pipeline-requirements.txt
	@echo "built $(DIST)/pipeline.zip $(DIST)/run_pipeline.py $(DIST)/pipeline-requirements.txt"

pipeline-dist: $(STAMP) pipeline-zip
	$(BIN)/python -m pip wheel --quiet --no-deps --wheel-dir $(DIST) .
	@ls $(DIST)/*.whl

# The packed venv holds the executors' requirements but not pyspark: on a cluster, Spark puts its own
# $$SPARK_HOME/python/lib/pyspark.zip on the workers' path. venv-pack keeps bin/python a link to the interpreter that
# built the venv, so build this on the image (or OS and Python) the executors run.
pipeline-env: pipeline-zip
	rm -rf $(DIST)/pipeline-env $(DIST)/pipeline-env.tar.gz $(DIST)/pipeline-env-check
	$(PIPELINE_ENV_PYTHON) -m venv $(DIST)/pipeline-env
	$(DIST)/pipeline-env/bin/python -m pip install --quiet --upgrade pip
	$(DIST)/pipeline-env/bin/python -m pip install --quiet -r $(DIST)/pipeline-requirements.txt venv-pack
	$(DIST)/pipeline-env/bin/venv-pack --quiet --prefix $(DIST)/pipeline-env --output $(DIST)/pipeline-env.tar.gz
	mkdir -p $(DIST)/pipeline-env-check && tar -xzf $(DIST)/pipeline-env.tar.gz -C $(DIST)/pipeline-env-check
	cd $(DIST)/pipeline-env-check && PYTHONPATH=$(abspath $(DIST))/pipeline.zip:$(SPARK_PYTHON_PATH) ./bin/python -c \
		'import aiokafka, pandas, pyarrow, pipeline, pipeline.kafka_source.client; print("the unpacked env imports pipeline from", pipeline.__file__)'
	test -z "$(SPARK_PYTHON_PATH)" || (cd $(DIST)/pipeline-env-check && \
		PYTHONPATH=$(abspath $(DIST))/pipeline.zip:$(SPARK_PYTHON_PATH) ./bin/python -c \
		'import pyspark, pipeline.__main__, pipeline.kafka_source.datasource; print("with Spark", pyspark.__version__, "from", pyspark.__file__)')
	rm -rf $(DIST)/pipeline-env-check
	@ls -la $(DIST)/pipeline-env.tar.gz

clean:
	rm -rf $(VENV) data .pytest_cache .mypy_cache .ruff_cache
