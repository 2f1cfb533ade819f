# Set-up and entry points. Each target creates the virtual environment if it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

$(VENV)/.core: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.dev: $(VENV)/.core
	$(PIP) -e ".[dev]"
	touch $@

.PHONY: demo test lint bench
demo: $(VENV)/.core
	$(VENV)/bin/probfsl demo

test: $(VENV)/.dev
	$(VENV)/bin/ruff check probfsl tests benchmarks
	$(PY) -m pytest -q

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check probfsl tests benchmarks
	$(VENV)/bin/ruff format --check probfsl tests benchmarks
