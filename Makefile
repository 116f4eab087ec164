# distdl: `make demo` and `make test` are all a new machine needs (plus Python 3.10+).

PYTHON ?= python3
VENV ?= .venv
# Pinned: an unpinned torch pulls a multi-GB CUDA build. Override, e.g. TORCH_SPEC="torch==2.13.0+cu128".
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?= torch==$(TORCH_VERSION)
# `make install EXTRAS=test,examples MPIEXEC=mpiexec` uses a system MPI instead of the mpich wheel (see README).
EXTRAS ?= mpich,test,examples
MPIEXEC ?= $(VENV)/bin/mpiexec
PY := $(VENV)/bin/python
RANKS ?= 1 2 3 4
PYTEST_ARGS ?= -q

# Oversubscribed runs (more ranks than cores) poll the shared-memory transport less often: several times faster.
export MPIR_CVAR_POSIX_POLL_FREQUENCY ?= 10
export OMP_NUM_THREADS ?= 1

.PHONY: install test test-serial test-mpi demo docs bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

test: test-serial test-mpi

test-serial: install
	$(PY) -m pytest $(PYTEST_ARGS) -m "not mpi" tests

# -m mpi4py: an uncaught exception on one rank aborts every rank instead of leaving them waiting.
test-mpi: install
	@for n in $(RANKS); do \
		echo "== MPI tests on $$n ranks =="; \
		$(MPIEXEC) -n $$n $(PY) -m mpi4py -m pytest $(PYTEST_ARGS) --with-mpi -m mpi tests || exit 1; \
	done

# The end-to-end example: a partitioned CNN on scikit-learn's digits, next to the sequential model.
demo: install
	$(MPIEXEC) -n 4 $(PY) -m mpi4py examples/train_digits.py

# The Sphinx site in docs/_build/html: figures drawn by docs/make_figures.py, warnings are errors.
docs: $(VENV)/.docs-installed
	$(PY) docs/make_figures.py
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[$(EXTRAS),docs]"
	touch $@

bench:
	@echo "bench: the benchmark suite arrives with the performance issue; see benchmarks/README.md"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
