# Trident: `make demo` runs the tiny job on the embedded stack; `make test` runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000
SERVER := http://127.0.0.1:$(PORT)
export TRIDENT_SERVER := $(SERVER)

.PHONY: install demo test test-tiers test-fast lint up stop clean gpu-check bench bench-quick

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first: the CPU build (on this kind of machine a local file) unless a CUDA build is
# already installed; an unpinned torch would pull a multi-GB CUDA build.
install: $(BIN)/python
	@if $(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() or torch.version.cuda else 1)" 2>/dev/null; then \
		echo "keeping the installed CUDA build of torch"; \
	else \
		$(BIN)/pip install -q "torch==2.13.0"; \
	fi
	$(BIN)/pip install -q -e ".[dev]"
	@# Debian's docker-compose: tests/test_compose.py validates docker-compose.yml with it.
	@command -v docker-compose >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get install -y -q docker-compose \
		|| { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q docker-compose; }; }
	@# Debian's chromium: the dashboard's browser tests (Playwright) drive it; Playwright's
	@# own browser download is not used.
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
		|| { $$SUDO apt-get update -q \
		     && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }; }
	@# Debian's iproute2 (ip, tc, ss): the tests on hosts make network namespaces with it
	@# (tests/hosts.py; as root, which CI is).
	@command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 \
		|| { $$SUDO apt-get update -q \
		     && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2; }; }

demo: install
	@bash examples/demo.sh

# Two pytest-xdist workers, one test module each at a time (`--dist loadfile`: a module's
# fixtures, its `trident up` or its driver of the worker's one Ray, stay in one process): the
# multi-process tests mostly wait on their processes, so two of them share two cores well.
# TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
# `.ci/run` passes -v, so that a run cut short still names every test that ended.
TEST_FLAGS ?= -q

# Bytecode is written (PYTHONDONTWRITEBYTECODE unset, where the environment sets it): every
# process the tests start (ranks, stacks, the CLI) would otherwise compile Trident's modules
# again, and each pytest worker would rewrite the assertions of every test module and plugin
# again (about 9 s of CPU per worker): 5 to 10 % of the suite's CPU on this kind of machine.
test: install
	bash .ci/start-postgres.sh
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest $(TEST_FLAGS) -n $(TEST_WORKERS) \
		--dist loadfile --durations=25

# The same tests tier by tier, cheapest first (tests/tiers.py), stopping at the first tier that
# fails: what CI runs (`.ci/run`), so that a broken unit fails in a minute, not after the
# end-to-end tests. Each tier collects only its own modules.
TIERS := unit integration physics system browser
test-tiers: install
	bash .ci/start-postgres.sh
	@for tier in $(TIERS); do \
		echo "=== tier $$tier"; \
		env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest $(TEST_FLAGS) -n $(TEST_WORKERS) \
			--dist loadfile --durations=10 $$($(BIN)/python -m tests.tiers $$tier) \
			|| { echo "=== tier $$tier failed: the tiers after it did not run"; exit 1; }; \
	done

test-fast: install
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
		-m "not slow"

lint: install
	$(BIN)/ruff check service workers api client cli tests bench migrations
	$(BIN)/mypy service api client cli workers

# The benchmarks (bench/run.py): Trident against torchrun and Ray Jobs, the store at scale, the
# planner and the monitor; one report, var/bench/report.json and report.md. Needs the local
# PostgreSQL (started as for the tests). Not part of `make test` (tens of minutes).
bench: install
	bash .ci/start-postgres.sh
	$(BIN)/python -m bench.run

bench-quick: install
	bash .ci/start-postgres.sh
	$(BIN)/python -m bench.run --quick

# The GPU check (bench/gpu_check.py): one JSON report in var/bench/gpu_check.json; on a machine
# without CUDA it runs and skips the GPU steps, saying why.
gpu-check: install
	$(BIN)/python bench/gpu_check.py

up: install
	$(BIN)/trident up --port $(PORT)

stop:
	@if [ -f var/trident.pid ]; then kill $$(cat var/trident.pid) && rm -f var/trident.pid && echo "stopped"; fi

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache .hypothesis
