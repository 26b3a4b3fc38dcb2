# The two quick-start commands of the README. Both set up a virtualenv in .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench

$(BIN)/genq: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# Runs the example dataset end to end: private Redis, the simulated SGLang server, 2 workers.
demo: $(BIN)/genq
	$(BIN)/genq run examples/prompts.jsonl --out out --simulate

# Lint, then the whole test suite against a real redis-server.
test: $(BIN)/genq
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q

bench: $(BIN)/genq
	$(BIN)/python bench/throughput.py
