# turnlog developer entry points. Works from a fresh clone: `make test`.
#
#   make run  [HOST=0.0.0.0] [PORT=9000]   migrate ./turnlog.db to head and serve the API
#   make install-serve                     install what serving needs (the server and ./client)
#   make install                           the same plus the test extras (pytest, linters, ...)
#   make test [PYTEST_ARGS='-k foo -x'] [JOBS=2]  pytest in JOBS processes, then ruff and mypy
#   make lint                              ruff + mypy only
#   make clean                             remove the venv and install stamp (never data)
#   make delete-local-db CONFIRM=yes       delete ./turnlog.db* — the event log itself

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Live inside the venv, so deleting .venv by hand also forces a reinstall.
STAMP  := $(VENV)/.turnlog-installed
SERVE_STAMP := $(VENV)/.turnlog-serve-installed
# The client is a distribution of its own (./client); the server depends on it.
SOURCES := pyproject.toml client/pyproject.toml

PYTEST_ARGS ?=
# pytest-xdist processes for `make test` (each starts its own PostgreSQL and Citus);
# JOBS=0 runs in this process. `--dist worksteal`: a process that runs out of tests
# takes queued ones from the other (with plain `load`, one sat idle ~90 s at the end
# while the other ran the docs' examples it had been handed).
JOBS ?= 2
RUN_ARGS := $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT))

export PIP_DISABLE_PIP_VERSION_CHECK := 1

.DEFAULT_GOAL := test
.PHONY: venv install install-serve run test lint clean delete-local-db

venv: $(BIN)/pip

install: $(STAMP)

install-serve: $(SERVE_STAMP)

# bin/pip is the last thing `venv` creates, so a half-created venv is rebuilt.
$(BIN)/pip:
	$(PYTHON) -m venv $(VENV)

# Reinstall only when a pyproject.toml changes (or the venv was recreated).
# Serving: no test extras (no pytest, playwright, schemathesis, mypy).
$(SERVE_STAMP): $(SOURCES) | $(BIN)/pip
	$(BIN)/pip install -e ./client -e .
	touch $@

# Developing: the test extras of both distributions on top.
$(STAMP): $(SOURCES) | $(BIN)/pip
	$(BIN)/pip install -e './client[test,safetensors]' -e '.[test]'
	touch $@ $(SERVE_STAMP)

run: $(SERVE_STAMP)
	$(BIN)/turnlog serve $(RUN_ARGS)

test: $(STAMP)
	$(BIN)/pytest -q -n $(JOBS) --dist worksteal $(PYTEST_ARGS)
	$(BIN)/ruff check .
	$(BIN)/mypy

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# A clean target never deletes data: turnlog.db is the event log.
clean:
	rm -rf $(VENV) $(STAMP) $(SERVE_STAMP)

delete-local-db:
	@test "$(CONFIRM)" = yes || { echo "this deletes ./turnlog.db (the event log): run 'make delete-local-db CONFIRM=yes'"; exit 2; }
	rm -f turnlog.db turnlog.db-wal turnlog.db-shm
