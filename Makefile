# The two commands a new user needs (both set up .venv first, and are safe to re-run):
#   make demo   generate data, shard it on local Spark, train 2 Horovod ranks, print a summary
#   make test   the whole test suite (real Spark, real Horovod ranks, S3 on loopback)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast doctor bench clean

setup:
	@.ci/bootstrap

demo: setup
	$(VENV)/bin/shardtrain demo

test: setup
	$(PY) -m pytest tests -q -p no:cacheprovider --timeout=900 $(PYTEST_ARGS)

# Unit tests and local-mode tests only; skips the standalone-cluster tests.
test-fast: setup
	$(PY) -m pytest tests -q -m "not cluster" $(PYTEST_ARGS)

doctor: setup
	$(VENV)/bin/shardtrain doctor

bench: setup  # each prints JSON lines; results and machines in benchmarks/RESULTS.md
	$(PY) benchmarks/loader_throughput.py
	$(PY) benchmarks/train_step_breakdown.py
	$(PY) benchmarks/shard_throughput.py --rows 1000000

clean:
	rm -rf artifacts spark-warehouse metastore_db derby.log .pytest_cache
