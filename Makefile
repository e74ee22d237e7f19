# jaxtool developer tasks. Two set-up commands from a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
SAMPLE := sample_programs/roe_flux_1d.py:roe_flux_1d

.PHONY: install install-test demo test fuzz bench

install:
	$(PIP) install --quiet -e .

install-test:
	$(PIP) install --quiet -e ".[test]"

demo: install
	$(PYTHON) -m jaxtool show $(SAMPLE) --vertices --source
	$(PYTHON) -m jaxtool typecheck $(SAMPLE)
	$(PYTHON) -m jaxtool jac $(SAMPLE) --order markowitz --check

test: install-test
	$(PYTHON) -m pytest -n auto --dist worksteal

fuzz: install-test
	$(PYTHON) scripts/fuzz.py --count 10000

bench: install-test
	$(PYTHON) scripts/bench.py --output BENCHMARKS.md
