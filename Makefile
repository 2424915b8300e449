# Two commands on a fresh clone: `make test` (venv + install + lint + tests).
# The venv is rebuilt only when pyproject.toml or constraints.txt change.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-fast demo lint format install clean

test: lint
	$(BIN)/pytest

# The inner loop: no Ray and no whole-program runs (markers `ray`, `slow`), no coverage; well under a minute.
test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not ray and not slow" --no-cov

# The embedded default: a tiny Qwen3-MoE built locally, fine-tuned on 4 CPU ranks (see README).
demo: $(STAMP)
	$(BIN)/python examples/finetune.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# --no-compile: bytecode is written on first import instead, for the few modules a run imports (saves ~1 min)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt -e '.[test]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage
