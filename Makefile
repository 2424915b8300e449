# Two commands on a fresh clone: `make test` (venv + install + lint + tests).
# The venv is rebuilt only when pyproject.toml or constraints.txt change.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
COMPILED := $(VENV)/.compiled
# The installed packages a rank process imports most of (`import actors.rank` loads 773 modules of torch, 419 of sympy,
# 198 of ray, 84 of numpy; 534 more from 39 smaller packages): compiled to bytecode whole, once per install.
RANK_PACKAGES := torch ray sympy numpy

# Recipes write the bytecode of what they import even where PYTHONDONTWRITEBYTECODE is set (an empty value turns it
# off): a module outside RANK_PACKAGES is compiled once, by the first process that imports it (writes are atomic), not
# again by every rank process, and not ahead of time when no process imports it (~2/3 of the environment's files).
export PYTHONDONTWRITEBYTECODE :=

.PHONY: test test-fast coverage compiled demo lint format install clean

# Two pytest sessions side by side: the Ray tests (marker `ray`: one local Ray and its shared worlds, in order; also the
# tests that start a Ray instance of their own, one start at a time and not at niceness 10) and the
# rest of the suite, which alone keeps 2 cores only partly busy (one test process, Python-bound). The rest runs at
# niceness 10: it takes the cores when the Ray tests leave them idle (a rank process starting, a test waiting for a
# timeout) rather than slowing the Ray tests, the longer part. Each session picks its servers' ports from its own
# half (RAYMOE_TEST_PORTS); the rest's report follows the Ray tests' one. Ctrl-C ends both (a shell's background job
# ignores SIGINT, so the trap sends it SIGTERM; nice execs pytest, so $! is pytest's pid). Before them, lint (mypy: one
# core for ~23 s) and the bytecode of RANK_PACKAGES (~20 CPU-seconds) run at once, in about mypy's time.
test:
	@$(MAKE) --no-print-directory --output-sync=target -j 2 lint compiled
	@RAYMOE_TEST_PORTS=1/2 nice -n 10 $(BIN)/pytest -m "not ray" > .pytest-rest.log 2>&1 & rest=$$!; \
	trap 'kill $$rest 2>/dev/null' INT TERM; \
	RAYMOE_TEST_PORTS=0/2 $(BIN)/pytest -m ray; ray_tests=$$?; \
	wait $$rest; rest_tests=$$?; trap - INT TERM; \
	echo "=== the rest of the suite (pytest -m 'not ray', run beside the Ray tests) ==="; cat .pytest-rest.log; \
	test $$ray_tests -eq 0 -a $$rest_tests -eq 0

# Bytecode for this checkout too: every rank process imports raymoe, actors and (the gloo harness) test files.
compiled: $(COMPILED)
	$(BIN)/python -m compileall -qq -j 0 raymoe actors tests > /dev/null

# The inner loop: no Ray and no whole-program runs (markers `ray`, `slow`); under two minutes on 2 cores.
test-fast: $(COMPILED)
	$(BIN)/pytest -q -m "not ray and not slow"

# The whole suite under coverage's tracer, with its summary. Not part of `make test`: tracing every Python call of
# the test process (the driver, the transformers reference, LocalRankGroup's in-process rank) made the suite 1.2x
# as slow on 2 cores (pytest 1545 s against 1283 s on a fresh clone); rank processes are not traced either way.
coverage: $(COMPILED)
	$(BIN)/pytest --cov=raymoe --cov=actors --cov-report=term

# The embedded default: a tiny Qwen3-MoE built locally, fine-tuned on 4 CPU ranks (see README).
demo: $(COMPILED)
	$(BIN)/python examples/finetune.py --overwrite

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

install: $(COMPILED)

# uv installs what pip would (tools/uv_install.py hands it pip's package sources): ~8 s against pip's ~62 s on 2
# cores. uv itself is pinned in constraints.txt and comes from pip.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt uv
	$(BIN)/python tools/uv_install.py --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

# The bytecode of RANK_PACKAGES, on every core, once per install (uv, like pip --no-compile, writes none): a world's
# ranks start at once and would each compile what is not there yet. The rest of the environment is compiled as it is
# imported (PYTHONDONTWRITEBYTECODE above). Some files are meant not to compile (newer-Python test fixtures), as under
# pip, so failures are ignored.
$(COMPILED): $(STAMP)
	$(BIN)/python -m compileall -qq -j 0 $(foreach p,$(RANK_PACKAGES),$(VENV)/lib/python*/site-packages/$(p)) \
		> /dev/null || true
	touch $(COMPILED)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage
