# ggmoe: the two commands a fresh machine needs are `make run` and `make test`.
PY ?= python3
PROMPT ?= The quick brown fox
export PIP_DISABLE_PIP_VERSION_CHECK = 1

PORT ?= 8080
.PHONY: setup engine run generate test test-unit lint gpu-smoke

# Build (or reuse the cached) patched llama-cpp-python wheel, then install ggmoe with its extras; then the
# engine once more, which puts the patched build back if an extra's dependencies replaced it (else a no-op).
setup: engine
	$(PY) -m pip install -q -e '.[dev,train]'
	$(PY) tools/build_engine.py --install

engine:
	$(PY) tools/build_engine.py --install

# The main job: the OpenAI-compatible server on the embedded default model (Ctrl-C stops it).
run: setup
	ggmoe serve --port $(PORT)

# Generate once with the embedded default model (a fixture model when none ships).
generate: setup
	@if $(PY) -c "from ggmoe.models import default_model_path as d; raise SystemExit(d() is None)"; then \
		ggmoe run -p "$(PROMPT)" -n 32; \
	else \
		ggmoe run "$$($(PY) -c "from tools.fixtures.make_fixtures import fixture_path; print(fixture_path('qwen3moe'))")" -p "$(PROMPT)" -n 32; \
	fi

test: setup
	$(PY) -m pytest -q

test-unit:
	$(PY) -m pytest -q -m unit

lint:
	$(PY) -m ruff check ggmoe predictors tools tests

# The GPU benchmark harness end to end at toy size on this machine (docs/benchmarks.md, "GPU harness").
gpu-smoke: setup
	$(PY) tools/gpu/smoke.py
