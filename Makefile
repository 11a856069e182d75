# The two set-up commands of the README: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The compiled hot path (gatewayd/hotpath.py): rebuilt, every module, when a source or a .pxd changes.
HOTPATH := $(VENV)/.hotpath-stamp
# The RDP proxy's man-in-the-middle, installed without its dependency pins (cryptography<42): the rdp
# extra in pyproject.toml lists what it really needs. docs/rdp-proxy.md says why.
PYRDP := pyrdp-mitm==2.1.0
CONSOLE := control/console_static/vendor/.built-stamp
# The suite must stay under 10 minutes on 2 cores: it runs in PYTEST_WORKERS processes (pytest-xdist), each
# test module whole in one of them (its module fixtures started once), and names the slowest tests at the end.
# Three on two cores: most tests wait on real clients, peers and timeouts, and with two processes a core was
# idle for much of the run (28 Nov: 633 s with 2, 440 s with 3; the tests' own times summed the same).
PYTEST_WORKERS ?= 3
PYTEST_ARGS ?= -n $(PYTEST_WORKERS) --dist loadfile --durations=15

.PHONY: run test test-matrix peers bench clean console proto hotpath

$(STAMP): pyproject.toml
	@scripts/ensure-python.sh "$(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,rdp,hotpath]'
	$(BIN)/pip install --quiet --no-deps '$(PYRDP)'
	@touch $@

## The hot path compiled with Cython beside its sources; without a C compiler everything runs from the
## Python source (a warning says so, and the next make tries again).
$(HOTPATH): $(STAMP) $(wildcard gatewayd/*.py gatewayd/*.pxd gatewayd/*/*.py gatewayd/*/*.pxd proxies/*/*.py proxies/*/*.pxd)
	@if $(BIN)/python -m launcher.hotpath build; then \
		touch $@; else echo "warning: the hot path was not compiled (see above); it runs from the Python source" >&2; fi

hotpath: $(HOTPATH)

## The web console's terminal player from the npm registry (npm ci), beside the console's sources.
## Without npm (and not root to install it) the daemon still runs; `/` then says how to build it.
$(CONSOLE): console/package.json console/package-lock.json scripts/build-console.sh
	@if scripts/build-console.sh; then touch $@; else echo "warning: web console not built (see above)" >&2; fi

console: $(CONSOLE)

## Start the daemon on its embedded defaults (or CONFIG=file.toml).
run: $(STAMP) $(CONSOLE) $(HOTPATH)
	$(BIN)/gatewayd run $(if $(CONFIG),--config $(CONFIG))

## Install the real peers the suite needs (when root), then run the whole suite.
## (Bytecode is cached: with PYTHONDONTWRITEBYTECODE set, every daemon and command a test starts would
## compile the project's modules again, about a second each.)
test: $(STAMP) $(CONSOLE) peers $(HOTPATH)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest $(PYTEST_ARGS)

## The whole suite once per supported Python (3.11, 3.12, 3.13: pyenv builds or python3.X on PATH),
## each in its own .venv-3.X; says which versions ran and which are missing (REQUIRE_ALL=1: a failure).
test-matrix:
	@MAKE="$(MAKE)" scripts/test-matrix.sh

## The gRPC stubs of the agents' and proxy managers' channel, from gatewayd/agent/agent.proto (committed;
## tests/test_agents.py checks they match the .proto).
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. gatewayd/agent/agent.proto

peers:
	@scripts/install-peers.sh

## Benchmarks print figures side by side; they are not tests.
bench: $(STAMP)
	$(BIN)/python bench/api/bench_api.py
	$(BIN)/python bench/postgres/bench_postgres.py
	$(BIN)/python bench/ssh/bench_ssh.py
	$(BIN)/python bench/http/bench_http.py
	$(BIN)/python bench/rdp/bench_rdp.py

clean:
	rm -rf $(VENV) .venv-3.* build *.egg-info .pytest_cache console/node_modules control/console_static/vendor
	find gatewayd proxies -name '*.so' -delete
