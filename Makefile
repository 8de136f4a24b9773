# kvstore: `make demo` sets up and runs the demo; `make test` sets up and runs the tests.
PY := .venv/bin/python
STAMP := .venv/.setup-stamp

.PHONY: soak setup demo test test-vllm test-sglang test-all test-slow lint typecheck bench bench-throughput simulate proto clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

demo: setup
	$(PY) -m benchmarks.demo $(DEMO_ARGS)

# The tests, the lint and the type check (CI runs this): ruff and mypy first, seconds each.
test: setup
	.venv/bin/ruff check .
	.venv/bin/mypy
	$(PY) -m pytest -q

test-vllm:
	bash scripts/test_vllm.sh

# The SGLang HiCache backend's tests, in their own venv (scripts/setup_sglang.sh, idempotent).
test-sglang:
	bash scripts/setup_sglang.sh
	.venv-sglang/bin/python -m pytest tests/sglang -m sglang -p no:cacheprovider -q

soak: setup
	$(PY) scripts/soak.py --seconds $${SOAK_SECONDS:-300}

test-slow: setup
	$(PY) -m pytest -q -m slow

test-all: setup
	$(PY) -m pytest -q -m "not gpu"

lint: setup
	.venv/bin/ruff check .

# mypy --strict on kvstore/ tiers/ server/ client/ (settings in pyproject.toml); part of `make test`.
typecheck: setup
	.venv/bin/mypy

bench: setup
	$(PY) -m benchmarks.ttft
	$(MAKE) bench-throughput

bench-throughput: setup
	$(PY) -m benchmarks.tier_throughput
	$(PY) -m benchmarks.remote_throughput
	$(PY) -m benchmarks.lookup_scaling
	$(PY) -m benchmarks.alternatives
	$(PY) -m benchmarks.planner

simulate: setup
	$(PY) -m benchmarks.simulate

proto: setup
	PATH=.venv/bin:$$PATH kvstore/proto/generate.sh

clean:
	rm -rf .data .pytest_cache .ruff_cache .mypy_cache
