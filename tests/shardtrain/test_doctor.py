"""`shardtrain doctor`: passes on the bootstrapped environment, and fails with the fix when the
stack is broken in the most common way (a pyarrow release petastorm cannot run on)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("SHARDTRAIN_CACHE", Path.home() / ".cache" / "shardtrain"))
TEST_WHEELS = CACHE / "test-wheels"  # filled by .ci/bootstrap
PYARROW_15 = "15.0.2"


def _doctor(*args, env=None):
    return subprocess.run([sys.executable, "-m", "shardtrain.cli", "doctor", "--json", *args],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.horovod
@pytest.mark.timeout(300)
def test_doctor_passes_here_including_a_real_two_rank_allreduce():
    proc = _doctor()
    report = json.loads(proc.stdout)
    failed = [c for c in report["checks"] if not c["ok"]]
    assert proc.returncode == 0 and not failed, failed
    names = [c["name"] for c in report["checks"]]
    assert names == ["python", "java", "pyspark", "spark", "pyarrow+petastorm", "torch", "horovod", "backends", "readers",
                     "executors", "horovod-on-spark"]
    executors = report["checks"][-2]
    assert executors["detail"] == f"shardtrain 0.1.0 imports in the executors' Python ({sys.executable})"
    launch = report["checks"][-1]
    assert "allreduce sum = [3.0, 3.0]" in launch["detail"]


@pytest.mark.stack
def test_doctor_says_what_to_install_where_executors_cannot_import_shardtrain(spark, executors_without_shardtrain):
    """Executors whose Python has no shardtrain fail every job's tasks: the doctor's one-task job finds
    it, says what to install or set, and skips the Horovod launch, which would fail the same way."""
    from shardtrain.doctor import check_executors, check_horovod_on_spark

    # The doctor's two Spark checks (run_doctor: the other checks, then these), on this session.
    executors, horovod = check_executors(), check_horovod_on_spark()
    assert not executors.ok
    assert executors.detail == "the executors' Python cannot import shardtrain (No module named 'shardtrain')"
    assert executors.fix == ("install shardtrain on the executors (`make wheel` builds dist/shardtrain-<version>-py3-"
                             "none-any.whl), or point PYSPARK_PYTHON (or spark.pyspark.python) at a Python that has it")
    horovod_installed = importlib.util.find_spec("horovod") is not None
    assert horovod.ok and horovod.detail == ("skipped: the executors cannot run shardtrain (see executors)"
                                             if horovod_installed else "skipped: Horovod not installed"), horovod


@pytest.fixture(scope="module")
def pyarrow15_dir():
    """A real pyarrow 15, installed beside (not into) the venv from the wheel that .ci/bootstrap
    fetched into the cache: tests never touch the network. Installed once per wheel, beside it in
    the cache (pip --target into a directory of this process's own, then renamed into place, so
    xdist workers and later runs use it as it is, and a run cut short leaves no half install)."""
    wheels = sorted(TEST_WHEELS.glob(f"pyarrow-{PYARROW_15}-*.whl"))
    if not wheels:
        pytest.fail(f"no pyarrow {PYARROW_15} wheel in {TEST_WHEELS}; run `make setup` (.ci/bootstrap fetches it)")
    target = TEST_WHEELS / f"{wheels[0].name[:-len('.whl')]}.installed"
    if not (target / "pyarrow" / "__init__.py").is_file():
        partial = TEST_WHEELS / f"{target.name}.{os.getpid()}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                        "--no-deps", "--target", str(partial), str(wheels[0])], check=True, timeout=600)
        try:
            os.replace(partial, target)
        except OSError:  # another process put its own there first: use that one
            shutil.rmtree(partial, ignore_errors=True)
    assert (target / "pyarrow" / "__init__.py").is_file(), f"pyarrow {PYARROW_15} is not installed in {target}"
    return target


@pytest.mark.process  # a fresh interpreter with pyarrow 15 first on its path, and its exit status
@pytest.mark.horovod  # the Connect half: Horovod installed, yet not the default there
@pytest.mark.timeout(600)
def test_doctor_fails_with_the_fix_when_pyarrow_15_shadows_the_pin(pyarrow15_dir):
    # One doctor process for two findings that do not touch each other: pyarrow 15 breaks only the
    # petastorm line, and on Spark Connect the backends line names torch. Horovod is installed here,
    # so an unset launch.backend resolves to horovod; on a Connect session the launch runs torch
    # instead (training.launchers.backend_for), and doctor says so rather than failing the backends
    # line. SPARK_REMOTE makes the session kind Connect; the backends line connects to nothing.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pyarrow15_dir), os.getcwd()]),
           "SPARK_REMOTE": "sc://127.0.0.1:1"}
    proc = _doctor("--no-launch", env=env)
    assert proc.returncode == 1
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    bad = checks["pyarrow+petastorm"]
    assert not bad["ok"]
    assert "pyarrow 15.0.2 is installed; petastorm needs pyarrow < 15" in bad["detail"]
    assert "pyarrow==14.0.2" in bad["fix"]
    assert checks["python"]["ok"] and checks["java"]["ok"]  # one broken package fails only its own line

    assert checks["spark"]["detail"].startswith("Spark Connect (SPARK_REMOTE=sc://127.0.0.1:1)")
    backends = checks["backends"]
    assert backends["ok"], backends
    assert "horovod: no (needs classic Spark" in backends["detail"]
    assert backends["detail"].endswith("default launch.backend=torch")
