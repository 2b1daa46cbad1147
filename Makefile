# Every target that needs the environment creates it first, so any target works as the
# first command on a fresh machine.
PY      := .venv/bin/python
STAMP   := .venv/.installed
DATA    := data
ARGS    ?=
CONFIG  ?= configs/default.py
WORKDIR ?= runs/$(basename $(notdir $(CONFIG)))

.PHONY: setup data convert train bench test test-slow lint clean

$(STAMP): pyproject.toml setup.py
	python3 -m venv .venv
	.venv/bin/pip install --quiet --upgrade pip
	.venv/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)  ## create .venv from pyproject.toml

data: $(STAMP)  ## build the built-in datasets (digits, photos) from images installed packages ship
	$(PY) -m pipeline.convert builtin $(DATA)

convert: $(STAMP)  ## convert a dataset: make convert ARGS="images SRC OUT"; no ARGS: the built-in set
	$(if $(ARGS),$(PY) -m pipeline.convert $(ARGS),$(PY) -m pipeline.convert builtin $(DATA))

train: data  ## train CONFIG (default: MobileNet on the built-in digits); re-run resumes
	$(PY) -m train --config $(CONFIG) --workdir $(WORKDIR) $(ARGS)

bench: data  ## benchmarks on the built-in photos; writes bench/REPORT.md
	$(PY) -m pipeline.bench all $(DATA)/photos --out bench $(ARGS)

test: $(STAMP)  ## the test suite (fast tests; `make test-slow` for the slow ones too)
	$(PY) -m pytest $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m '' $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check pipeline train configs tests

clean:
	rm -rf .venv runs bench/*.json build *.egg-info
