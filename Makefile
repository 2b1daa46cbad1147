# Every target that needs the environment creates it first, so any target works as the
# first command on a fresh machine.
PY      := .venv/bin/python
STAMP   := .venv/.installed
EXTRAS  := train,tensorboard,data,bench,dev,gpu
# The Beam tests run in their own environment: apache-beam caps pillow, protobuf and pyarrow
# below the main environment's versions (docs/ARCHITECTURE.md).
BEAM_PY    := .venv-beam/bin/python
BEAM_STAMP := .venv-beam/.installed
BEAM_TESTS := tests/convert/test_beam.py
DATA    := data
ARGS    ?=
CONFIG  ?= configs/default.py
WORKDIR ?= runs/$(basename $(notdir $(CONFIG)))
SOURCES := pipeline bench train configs tests examples setup.py

.PHONY: _venv setup data convert train tensorboard bench bench-report device-wheels device-check test test-beam test-slow format lint clean

# Two targets started at once in a fresh clone (two `make train`): the second waits on the
# lock (flock, util-linux), then finds the environment installed instead of running pip
# beside the first.
$(STAMP): pyproject.toml setup.py pipeline/image/_jpeg.c
	@mkdir -p .venv
	@flock .venv/.lock $(MAKE) --no-print-directory _venv

$(BEAM_STAMP): pyproject.toml setup.py pipeline/image/_jpeg.c
	@mkdir -p .venv-beam
	@flock .venv-beam/.lock $(MAKE) --no-print-directory _venv VENV=.venv-beam EXTRAS=data,dev,beam

VENV ?= .venv
_venv:
	@if [ -f $(VENV)/.installed ] && [ -z "$$(find pyproject.toml setup.py pipeline/image/_jpeg.c -newer $(VENV)/.installed)" ]; \
	then echo "$(VENV)/.installed: installed by another make meanwhile"; else \
	set -e; python3 -m venv $(VENV); \
	$(VENV)/bin/pip install --quiet --upgrade pip; \
	$(VENV)/bin/pip install --quiet -e '.[$(EXTRAS)]'; \
	touch $(VENV)/.installed; fi

setup: $(STAMP)  ## create .venv: the library plus the extras $(EXTRAS)

data: $(STAMP)  ## build the built-in datasets (digits, photos) from images installed packages ship
	$(PY) -m pipeline.convert builtin $(DATA)

convert: $(STAMP)  ## convert a dataset: make convert ARGS="images SRC OUT"; no ARGS: the built-in set
	$(if $(ARGS),$(PY) -m pipeline.convert $(ARGS),$(PY) -m pipeline.convert builtin $(DATA))

train: data  ## train CONFIG (default: MobileNet on the built-in digits); re-run resumes
	$(PY) -m train --config $(CONFIG) --workdir $(WORKDIR) $(ARGS)

tensorboard: $(STAMP)  ## view a run's curves: make tensorboard WORKDIR=runs/default (port 6006)
	$(PY) -m tensorboard.main --logdir $(WORKDIR)/tensorboard --port $${PORT:-6006}

bench: data  ## benchmarks on the built-in photos; report, figures and logs in runs/bench
	$(PY) -m bench all $(DATA)/photos --out runs/bench $(ARGS)

bench-report: data  ## the same, rewriting the committed bench/REPORT.md and docs/bench
	$(PY) -m bench all $(DATA)/photos --out runs/bench --refresh $(ARGS)

device-wheels:  ## download into .whl/ the wheels bench/device_check.sh installs on a GPU host (PYVER=3.12)
	bench/device_wheels.sh

device-check:  ## on a GPU host: install .whl/, build the C decoder, write runs/device_check/device_check.json
	bench/device_check.sh $(ARGS)

# pytest-xdist processes for the tests: one a core, at most 4 (each loads JAX, and the tests
# that start processes need cores beside them); JOBS=0 runs them in this process.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
PYTEST := $(PY) -m pytest -n $(JOBS) --dist loadfile

test: $(STAMP) $(BEAM_STAMP)  ## the fast tier (~8 min on 2 cores quiet); `make test-slow`: the slow tier
	@$(if $(ARGS),true,echo "make test: the fast tier, about 8 minutes on 2 cores quiet, 20-27 at \
	load 6-9 (a dot a test); make test-slow runs the slow tier (about 30 minutes quiet, over 48 at \
	load 6-9: trainer runs, bucket conversions, benchmarks' end to end runs, multi-host faults that \
	wait out heartbeats); CI runs the fast tier")
	$(PYTEST) $(ARGS); main=$$?; \
	$(if $(ARGS),exit $$main,$(BEAM_PY) -m pytest $(BEAM_TESTS); beam=$$?; [ $$main$$beam = 00 ])

test-beam: $(BEAM_STAMP)  ## the Beam tests alone, in .venv-beam (DaskRunner, 2 worker processes)
	$(BEAM_PY) -m pytest $(BEAM_TESTS) $(ARGS)

test-slow: $(STAMP)  ## the slow tier (tests marked slow; ~30 min on 2 cores quiet, 48+ loaded)
	$(PYTEST) -m slow $(ARGS)

format: $(STAMP)  ## rewrite the sources in the project's format
	$(PY) -m ruff format $(SOURCES)
	$(PY) -m ruff check --fix --select I $(SOURCES)

lint: $(STAMP)  ## format and lint checks; pylint is not run, so no pylint comments either
	$(PY) -m ruff format --check --output-format concise $(SOURCES)
	$(PY) -m ruff check $(SOURCES)
	@! grep -rn --include='*.py' 'pylint:' $(SOURCES) || (echo "pylint comments: pylint is not run"; false)

clean:
	rm -rf .venv .venv-beam runs build *.egg-info
