# distdl: `make demo` and `make test` are all a new machine needs (plus Python 3.10+).

PYTHON ?= python3
VENV ?= .venv
# Pinned to the version CI tests. PyPI's Linux torch is the CUDA build; for the CPU one, set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu. Override the version with TORCH_SPEC="torch==<version>".
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

# Benchmarks (see benchmarks/README.md): primitives against raw mpi4py and gloo at 2 and 4 ranks, the
# allocator settings, the MPI thread level, a CNN training step and a data-parallel step; reports in
# benchmarks/results/.
# The recommended run-time settings on the CPU: MPI_THREAD_SERIALIZED (MPI_THREAD_MULTIPLE locks every call;
# GPUs staged through the host need it: docs/gpu.md),
# and a glibc heap that keeps freed memory (no mmap, no trimming), so large outputs are not page-faulted anew each call.
BENCH_MPI := MPI4PY_RC_THREAD_LEVEL=serialized
BENCH_MALLOC := MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=17179869184
BENCH_RUN = $(MPIEXEC) -n $(1) env $(2) $(PY) benchmarks/$(3)
# With more ranks than cores, MPICH's blocking shared-memory Allreduce, Bcast, Reduce and Barrier ("release-gather")
# spin while the rank they wait for cannot run (raw 8 B Allreduce ~7 ms on 4 ranks over 2 cores); its generic
# algorithms wait in its progress engine (~40 us). The 4-rank run takes them, for raw mpi4py and the harness's barriers.
CROWDED_MPI := $(foreach c,ALLREDUCE BCAST REDUCE BARRIER,MPIR_CVAR_$(c)_POSIX_INTRA_ALGORITHM=mpir)
bench: install
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q matplotlib
	rm -f benchmarks/results/*.json
	$(call BENCH_RUN,2,$(BENCH_MPI) $(BENCH_MALLOC),bench_primitives.py)
	@echo "== 4 ranks on $$(getconf _NPROCESSORS_ONLN) cores: oversubscribed when there are fewer than 4 =="
	$(call BENCH_RUN,4,$(BENCH_MPI) $(BENCH_MALLOC) $(CROWDED_MPI),bench_primitives.py --sizes 8 4096 262144 --budget 1.5)
	for run in 1 2; do for level in multiple serialized; do \
		$(MPIEXEC) -n 2 env MPI4PY_RC_THREAD_LEVEL=$$level $(BENCH_MALLOC) $(PY) benchmarks/bench_primitives.py \
			--sizes 8 --primitives all_sum_reduce broadcast --output benchmarks/results/threads-$$run-$$level.json \
			|| exit 1; done; done
	$(call BENCH_RUN,2,$(BENCH_MPI),bench_memory.py --label default)
	$(call BENCH_RUN,2,$(BENCH_MPI) $(BENCH_MALLOC),bench_memory.py --label retained)
	$(call BENCH_RUN,2,$(BENCH_MPI) THP_MEM_ALLOC_ENABLE=1,bench_memory.py --label thp)
	$(call BENCH_RUN,2,$(BENCH_MPI) $(BENCH_MALLOC),bench_layers.py)
	$(call BENCH_RUN,2,$(BENCH_MPI) $(BENCH_MALLOC),bench_data_parallel.py)
	$(PY) benchmarks/bench_primitives.py --report

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
