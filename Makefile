# `make test` and `make demo` work on a fresh machine: both install what they need first.
PYTHON ?= python3

.PHONY: setup test demo

setup:
	bash scripts/setup.sh

test: setup
	$(PYTHON) -m pytest -q

demo: setup
	$(PYTHON) -m gradzip demo
