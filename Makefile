# kvstore: `make demo` sets up and runs the demo; `make test` sets up and runs the tests.
PY := .venv/bin/python
STAMP := .venv/.setup-stamp

.PHONY: soak setup demo test test-vllm test-all test-slow lint bench bench-throughput simulate proto clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

demo: setup
	$(PY) -m benchmarks.demo

test: setup
	$(PY) -m pytest -q

test-vllm:
	bash scripts/test_vllm.sh

soak: setup
	$(PY) scripts/soak.py --seconds $${SOAK_SECONDS:-300}

test-slow: setup
	$(PY) -m pytest -q -m slow

test-all: setup
	$(PY) -m pytest -q -m "not gpu"

lint: setup
	.venv/bin/ruff check .

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
	rm -rf .data .pytest_cache .ruff_cache
