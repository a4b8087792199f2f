# `make test` and `make demo` work on a fresh machine: both install what they need first.
PYTHON ?= python3

.PHONY: setup test demo

setup:
	bash scripts/setup.sh

# Two pytest workers, each taking whole files (files sharing a session-scoped launch go together:
# tests/conftest.py): the tests' processes wait on one another and on their peers' timeouts often
# enough that a second worker fills the idle core (22 minutes against 28 on CI's kind of 2-core machine).
TEST_WORKERS ?= 2

test: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

demo: setup
	$(PYTHON) -m gradzip demo
