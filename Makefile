# Two commands set everything up on a fresh machine:
#   make test   create .venv, install rejax with its test extras, run the tests (CPU)
#   make demo   run the main job on the bundled default model
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rejax-installed

.PHONY: test demo install lint clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU torch wheel goes in first, so no extra can resolve to a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,train]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m rejax.demo $(DEMO_ARGS)

lint: $(STAMP)
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check rejax cuda_ops tests experiments

clean:
	rm -rf $(VENV) .pytest_cache
