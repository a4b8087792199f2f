# `make test` and `make demo` work on a fresh machine: both install what they need first.
PYTHON ?= python3

.PHONY: setup test demo

setup:
	bash scripts/setup.sh

# Two pytest workers, each taking whole files (a file's session-scoped launches run once): the tests'
# processes wait on one another and on their peers' timeouts often enough that a second worker fills
# the idle core (22 minutes against 28 on the 2-core machine CI runs on).
TEST_WORKERS ?= 2

test: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

demo: setup
	$(PYTHON) -m gradzip demo
