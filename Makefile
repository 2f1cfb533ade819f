# Set-up and entry points. Each target creates the virtual environment if it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

# CPU-only torch: make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

# pytest-xdist processes of `make test` and `make test-quick`, one single-threaded torch
# each (a test module runs whole in one of them): one per core of a two-core machine;
# TEST_WORKERS=auto takes one per core on a larger one, TEST_WORKERS=0 runs in-process
TEST_WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

$(VENV)/.core: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(if $(TORCH_INDEX),$(PIP) torch --index-url $(TORCH_INDEX))
	$(PIP) -e .
	touch $@

$(VENV)/.dev: $(VENV)/.core
	$(PIP) -e ".[dev]"
	touch $@

.PHONY: demo test test-quick lint bench
demo: $(VENV)/.core
	$(VENV)/bin/probfsl demo

# the docs extra too, so that tests/test_docs.py builds the site (mkdocs --strict)
test: $(VENV)/.docs
	$(VENV)/bin/ruff check probfsl tests benchmarks tools
	$(PYTEST)

# every test module but not the slow and GPU tests: about 5 minutes on two cores
test-quick: $(VENV)/.dev
	$(PYTEST) -m "not slow and not gpu"

# Tutorials: execute tutorials/NN_*.py into tutorials/NN_*.ipynb (with outputs).
# Docs: build the site into site/ (mkdocs.yml); broken references fail the build.
.PHONY: notebooks docs
notebooks: $(VENV)/.dev
	OMP_NUM_THREADS=1 $(PY) tools/notebooks.py

$(VENV)/.docs: $(VENV)/.dev
	$(PIP) -e ".[dev,docs]"
	touch $@

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check probfsl tests benchmarks tools
	$(VENV)/bin/ruff format --check probfsl tests benchmarks tools
