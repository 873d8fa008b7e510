#!/usr/bin/env bash
# Prepares the GPU check (benchmarks/gpu_check.py) for a device machine: Python 3.12, PyTorch
# preinstalled, no Java/Spark, no network. Run here, once:
#   benchmarks/gpu_prepare.sh
# It writes (both git-ignored, both carried by the device tool):
#   .whl/            wheels for what the device lacks or has in a version petastorm cannot use:
#                    pyarrow 14.0.2 (petastorm needs < 15), numpy 1.26.4 (pyarrow 14 needs numpy 1.x),
#                    petastorm 0.12.1 and its pure-Python needs. pyarrow's Flight/Substrait/Gandiva
#                    libraries are dropped from its wheel: nothing here uses them, and the device
#                    tool carries at most 64 MiB.
#   .device/shards   a wide tabular dataset sharded here by the real shard job (local Spark).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
.ci/bootstrap
py=.venv/bin/python
rows=${ROWS:-40000}

mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
for spec in pyarrow==14.0.2 numpy==1.26.4 petastorm==0.12.1 dill==0.4.1 diskcache==5.6.3 future==1.0.0; do
  name=${spec%%==*}
  ls .whl/"$name"-*.whl >/dev/null 2>&1 && continue
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec" 2> >(grep -v "^WARNING: Location 'file://" >&2)
done
wheel=$(ls .whl/pyarrow-14.0.2-*.whl)
if unzip -Z1 "$wheel" 'pyarrow/libarrow_flight*' >/dev/null 2>&1; then
  zip -q -d "$wheel" 'pyarrow/libarrow_flight.so*' 'pyarrow/_flight*.so' 'pyarrow/libarrow_substrait.so*' \
    'pyarrow/_substrait*.so' 'pyarrow/include/*' 'pyarrow/tests/*' 'pyarrow/src/*' >/dev/null || true
fi

if [ ! -f .device/shards/_COMMITTED ]; then
  rm -rf .device && mkdir -p .device
  "$py" - "$rows" <<'PY'
import sys
from pipelines import generate_dataset, shard_dataset
rows = int(sys.argv[1])
data = generate_dataset(".device/raw", rows, numeric=48, categorical=6, vocab_size=100, mode="overwrite")
shard_dataset(data.shard_config(".device/shards", output={"num_shards": 2, "rows_per_row_group": 8192},
                                split={"fractions": {"train": 0.9, "val": 0.05, "test": 0.05}},
                                quality={"max_bad_fraction": 1.0}))
PY
  rm -rf .device/raw
fi
du -sh .whl .device
total=$(du -scm .whl .device | tail -1 | cut -f1)
[ "$total" -lt 60 ] || { echo "carried files are ${total} MiB; the device tool takes 64 MiB with the repo" >&2; exit 1; }
echo "ready: carry [.whl, .device] and run the command in benchmarks/gpu_check.py's docstring"
