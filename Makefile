# The two commands a new user needs (both set up .venv first, and are safe to re-run):
#   make demo   generate data, shard it on local Spark, train 2 Horovod ranks, print a summary
#   make test   the whole test suite (real Spark, real Horovod ranks, S3 on loopback) on the pinned
#               profile, then the backend-independent tests on the current-stack profile
VENV ?= .venv
PY := $(VENV)/bin/python
# The current-stack profile: pyspark 4.x, pyarrow 26, numpy 2, no Horovod or petastorm.
VENV_CURRENT ?= .venv-current
# What runs there too: the tests marked `stack`, each one whose outcome can differ between the profiles
# (pyspark 3.5/4.x APIs: TorchDistributor, job tags, Spark's task state, Connect, SQL and DataFrame
# behaviour, Arrow hand-over to Python UDFs; pyarrow's Parquet bytes, compute and errors; numpy 1/2;
# pandas 2/3): the shard job, the arrow reader, scoring's Spark path, load_model's predict, doctor.
# A test whose property is torch's or our own Python (same versions on both) is not marked, even when
# it passes through one of those paths; per path one or two cheap tests carry it on the current profile.
STACK_TESTS ?= stack and not cluster and not horovod
# pytest-xdist workers for test, test-current and test-fast; 0 runs the tests serially in one process.
# A file's tests stay on one worker, and files that share a fixed resource stay together (tests/conftest.py).
# Two: the serial suite keeps about one of this machine's two cores busy (rank rendezvous, JVM and
# process start-ups, stall and timeout waits), and two workers took 0.75-0.8x its wall time
# (benchmarks/RESULTS.md, "Two xdist workers by default").
PYTEST_WORKERS ?= 2
XDIST = -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: setup setup-current demo test test-current pytest-pinned pytest-current test-fast doctor bench wheel docs clean

setup:
	@.ci/bootstrap

setup-current:
	@SHARDTRAIN_PROFILE=current SHARDTRAIN_VENV=$(abspath $(VENV_CURRENT)) .ci/bootstrap

demo: setup
	$(VENV)/bin/shardtrain demo

# Both profiles: their setups (the pinned one also with the Airflow venv the DAG test runs, which make
# setup and make demo leave out), then the two pytest runs one after the other; ends with the wall time of
# the whole, setup included. PROFILES_AT_ONCE=1 runs the two pytest runs at the same time: for machines
# with more cores; on this 2-core one it took as long (1411 s against 1410-1469 s one after the other,
# benchmarks/RESULTS.md "The two profiles at once").
PROFILES_AT_ONCE ?= 0
PYTEST := -m pytest tests -q -p no:cacheprovider --timeout=900 --durations=40 $(XDIST)

test:
	@PROFILES_AT_ONCE=$(PROFILES_AT_ONCE) .ci/test-profiles "$(MAKE)"

# Tests that need Horovod or the standalone cluster are left to the pinned run; those needing
# petastorm skip themselves (importorskip) where it is not installed.
test-current: setup-current
	@$(MAKE) --no-print-directory pytest-current

# The two pytest runs without their setup (make test and test-current set up first).
pytest-pinned:
	$(PY) $(PYTEST) $(PYTEST_ARGS)

pytest-current:
	$(VENV_CURRENT)/bin/python $(PYTEST) -m "$(STACK_TESTS)" $(PYTEST_ARGS)

# The inner loop: unit tests and local Spark in the test's own process: no rank launches, no worker
# JVMs, no tests whose point is a process boundary (no `ranks`/`horovod`/`cluster`/`process` marks).
test-fast: setup
	@start=$$(date +%s); \
	$(PY) -m pytest tests -q -p no:cacheprovider --timeout=900 $(XDIST) -m "not cluster and not horovod and not ranks and not process" $(PYTEST_ARGS) && \
	echo "make test-fast: $$(( $$(date +%s) - start )) s wall"

doctor: setup
	$(VENV)/bin/shardtrain doctor

bench: setup  # each prints JSON lines; results and machines in benchmarks/RESULTS.md
	$(PY) benchmarks/loader_throughput.py
	$(PY) benchmarks/train_step_breakdown.py
	$(PY) benchmarks/shard_throughput.py --rows 1000000
	$(PY) benchmarks/shard_decode.py

# dist/shardtrain-<version>-py3-none-any.whl: what a cluster installs (README: Databricks notebooks).
# No dependencies inside: the cluster's runtime or the install command brings them.
wheel: setup
	rm -rf build dist/shardtrain-*.whl
	$(PY) -m pip wheel --disable-pip-version-check -q --no-deps --no-build-isolation -w dist .
	@ls dist/shardtrain-*.whl

# The docs site, into docs/_build/html: open index.html, from file:// (nothing is fetched from elsewhere).
# Warnings are errors, as in the suite's build of it (tests/test_docs.py).
docs: setup
	$(VENV)/bin/sphinx-build -q -W --keep-going -b html docs docs/_build/html
	@echo "docs/_build/html/index.html"

clean:
	rm -rf artifacts spark-warehouse metastore_db derby.log .pytest_cache
