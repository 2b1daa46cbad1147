# Every target that needs the environment creates it first, so any target works as the
# first command on a fresh machine.
PY      := .venv/bin/python
STAMP   := .venv/.installed
EXTRAS  := train,tensorboard,data,bench,dev
DATA    := data
ARGS    ?=
CONFIG  ?= configs/default.py
WORKDIR ?= runs/$(basename $(notdir $(CONFIG)))
SOURCES := pipeline bench train configs tests examples setup.py

.PHONY: _venv setup data convert train tensorboard bench bench-report test test-slow format lint clean

# Two targets started at once in a fresh clone (two `make train`): the second waits on the
# lock (flock, util-linux), then finds the environment installed instead of running pip
# beside the first.
$(STAMP): pyproject.toml setup.py pipeline/image/_jpeg.c
	@mkdir -p .venv
	@flock .venv/.lock $(MAKE) --no-print-directory _venv

_venv:
	@if [ -f $(STAMP) ] && [ -z "$$(find pyproject.toml setup.py pipeline/image/_jpeg.c -newer $(STAMP))" ]; \
	then echo "$(STAMP): installed by another make meanwhile"; else \
	set -e; python3 -m venv .venv; \
	.venv/bin/pip install --quiet --upgrade pip; \
	.venv/bin/pip install --quiet -e '.[$(EXTRAS)]'; \
	touch $(STAMP); fi

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

bench-report: data  ## the same, rewriting the committed bench/REPORT.md, docs/bench and docs/study
	$(PY) -m bench all $(DATA)/photos --out runs/bench --refresh $(ARGS)

test: $(STAMP)  ## the test suite (fast tests; `make test-slow` for the slow ones too)
	$(PY) -m pytest $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m '' $(ARGS)

format: $(STAMP)  ## rewrite the sources in the project's format
	$(PY) -m ruff format $(SOURCES)
	$(PY) -m ruff check --fix --select I $(SOURCES)

lint: $(STAMP)  ## format and lint checks; pylint is not run, so no pylint comments either
	$(PY) -m ruff format --check --output-format concise $(SOURCES)
	$(PY) -m ruff check $(SOURCES)
	@! grep -rn --include='*.py' 'pylint:' $(SOURCES) || (echo "pylint comments: pylint is not run"; false)

clean:
	rm -rf .venv runs build *.egg-info
