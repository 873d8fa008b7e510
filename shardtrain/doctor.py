"""``shardtrain doctor``: is this machine able to run shardtrain? One line per check, with the fix.

Each check returns a Check(name, ok, detail, fix). The checks import what they test lazily, so a
broken package fails its own line instead of the whole command. The last two start Spark work
(``--no-launch`` leaves them out), on the active session, else one the doctor starts (local[2], or
the Spark Connect server SPARK_REMOTE names) and stops at its end: ``executors`` runs a one-task job
whose Python worker imports shardtrain, as every job's tasks must (a worker without it fails them
all); ``horovod-on-spark`` launches two real Horovod ranks and allreduces a tensor: if that
completes, training can run.

Horovod and petastorm are optional (the current-stack profile has neither): one that is not
installed passes its line with what is used instead (``launch.backend`` and ``data.reader``
default to what is installed); one that is installed but broken fails, because the defaults pick
it. The ``backends`` and ``readers`` lines say which of each this environment can use, and why not.
The ``spark`` line says whether sessions here are classic Spark or Spark Connect (an active session,
else ``SPARK_REMOTE``), which decides the backends: Horovod needs classic Spark.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass
from typing import Callable

from common.errors import EXIT_OK, EXIT_RUNTIME, first_line



@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def check_python() -> Check:
    v = sys.version_info
    ok = (3, 10) <= (v.major, v.minor) < (3, 13)
    return Check("python", ok, f"{v.major}.{v.minor}.{v.micro} at {sys.executable}",
                 "" if ok else "use Python 3.10-3.12 (the pinned torch/pyarrow wheels exist for those)")


def check_java() -> Check:
    java = shutil.which("java", path=(os.environ.get("JAVA_HOME", "") + "/bin:" + os.environ.get("PATH", "")))
    fix = "apt-get update && apt-get install -y openjdk-17-jre-headless (or set JAVA_HOME)"
    if not java:
        return Check("java", False, "not found", fix)
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    major = int(match.group(1)) if match else 0
    if major == 1 and match and match.group(2):
        major = int(match.group(2))
    ok = major in (11, 17)
    return Check("java", ok, f"Java {major} at {java}", "" if ok else f"Spark 3.5 needs Java 17 or 11: {fix}")


def check_pyspark() -> Check:
    try:
        import pyspark
    except ImportError as exc:
        return Check("pyspark", False, f"not importable ({exc})", "run .ci/bootstrap")
    ok = (3, 5) <= _version_tuple(pyspark.__version__)[:2] < (5, 0)
    return Check("pyspark", ok, pyspark.__version__,
                 "" if ok else "pip install -c .ci/constraints.txt pyspark  (3.5; or 4.x in the current profile)")


def check_pyarrow_petastorm() -> Check:
    """petastorm 0.12 uses pyarrow APIs removed in 15; prove it by reading a real Parquet file."""
    fix = "pip install -c .ci/constraints.txt pyarrow petastorm  (pyarrow==14.0.2, petastorm==0.12.1)"
    if not _installed("petastorm"):
        return Check("pyarrow+petastorm", True, "petastorm not installed: data.reader defaults to arrow")
    try:
        import pyarrow
    except ImportError as exc:
        return Check("pyarrow+petastorm", False, f"pyarrow not importable ({exc})", fix)
    if _version_tuple(pyarrow.__version__) >= (15,):
        return Check("pyarrow+petastorm", False,
                     f"pyarrow {pyarrow.__version__} is installed; petastorm needs pyarrow < 15", fix)
    try:
        import numpy as np
        import pyarrow.parquet as pq
        from petastorm import make_batch_reader

        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # petastorm 0.12 uses deprecated pyarrow APIs, by design
            pq.write_table(pyarrow.table({"x": np.arange(10, dtype=np.float32)}), os.path.join(tmp, "p.parquet"))
            with make_batch_reader(f"file://{tmp}", reader_pool_type="dummy", num_epochs=1) as reader:
                rows = sum(len(batch.x) for batch in reader)
        import petastorm
    except Exception as exc:  # noqa: BLE001 - any failure here is the finding
        return Check("pyarrow+petastorm", False, f"reading Parquet through petastorm failed: {exc!r}", fix)
    ok = rows == 10
    return Check("pyarrow+petastorm", ok, f"pyarrow {pyarrow.__version__}, petastorm {petastorm.__version__}, "
                 f"read {rows}/10 rows", "" if ok else fix)


def check_torch() -> Check:
    try:
        import torch
    except ImportError as exc:
        return Check("torch", False, f"not importable ({exc})", "run .ci/bootstrap")
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        detail = f"{torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {', '.join(names)}"
    else:
        detail = f"{torch.__version__}, no CUDA GPU (training runs on CPU)"
    return Check("torch", True, detail)


def check_horovod() -> Check:
    fix = "run .ci/bootstrap (it builds Horovod 0.28.1 from source with Gloo)"
    if not _installed("horovod"):
        return Check("horovod", True, "not installed: launch.backend defaults to torch")
    try:
        import horovod
        import horovod.torch as hvd
    except Exception as exc:  # noqa: BLE001 - an ImportError or a broken native library
        return Check("horovod", False, f"horovod.torch not importable ({exc})", fix)
    built = {"gloo": hvd.gloo_built(), "nccl": bool(hvd.nccl_built()), "mpi": hvd.mpi_built()}
    detail = f"{horovod.__version__}, " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in built.items())
    try:
        import torch

        if torch.cuda.is_available() and not built["nccl"]:
            return Check("horovod", False, detail + " (GPUs present but no NCCL)",
                         "install a CUDA toolkit (nvcc) and a CUDA build of torch, then re-run .ci/bootstrap: it builds "
                         "the NCCL variant")
    except ImportError:
        pass
    return Check("horovod", built["gloo"], detail, "" if built["gloo"] else fix)


def _allreduce_rank():
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    result = (hvd.rank(), hvd.size(), float(total.item()))
    hvd.shutdown()
    return result


def spark_mode() -> tuple[str, str]:
    """("connect" or "classic", why): the active session's kind, else SPARK_REMOTE's."""
    from pyspark.sql import SparkSession

    from common.spark import is_connect

    active = SparkSession.getActiveSession()
    if active is not None:
        return ("connect" if is_connect(active) else "classic"), "the active session"
    if os.environ.get("SPARK_REMOTE"):
        return "connect", f"SPARK_REMOTE={os.environ['SPARK_REMOTE']}"
    return "classic", "no active session and no SPARK_REMOTE"


def check_spark_mode() -> Check:
    fix = ("pip install -c .ci/constraints-current.txt grpcio grpcio-status googleapis-common-protos zstandard "
           "(pyspark's connect extra)")
    import pyspark

    needed = {"grpc": "grpcio", "grpc_status": "grpcio-status", "google.rpc": "googleapis-common-protos"}
    if _version_tuple(pyspark.__version__) >= (4,):
        needed["zstandard"] = "zstandard"
    missing = [package for module, package in needed.items() if not _installed(module)]
    client = "Spark Connect client installed" if not missing else \
        f"no Spark Connect client (missing {', '.join(missing)})"
    mode, why = spark_mode()
    if mode == "connect":
        ok = client.startswith("Spark Connect client installed")
        return Check("spark", ok, f"Spark Connect ({why}): launch.backend=torch runs, horovod does not; {client}",
                     "" if ok else fix)
    return Check("spark", True, f"classic Spark ({why}; spark.remote in spark.conf or SPARK_REMOTE picks Spark "
                 f"Connect): every launch.backend runs; {client}")


# The session the doctor started for its Spark checks (none while it has not): stopped when they end.
_started_sessions: list = []


def _doctor_session():
    """The active session, else one the doctor starts (local[2], or SPARK_REMOTE's server)."""
    from pyspark.sql import SparkSession

    from common.config import SparkConfig
    from common.spark import get_or_create_session

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    spark = get_or_create_session(SparkConfig(master="local[2]", app_name="shardtrain-doctor",
                                              conf={"spark.ui.enabled": False}), log_level="ERROR")
    _started_sessions.append(spark)
    return spark


def _stop_started_session() -> None:
    while _started_sessions:
        _started_sessions.pop().stop()


def _shardtrain_on_executor(batches):
    """Runs in an executor's Python worker, which imports this module (shardtrain.doctor) to get it."""
    import sys

    import pandas as pd

    from common import __version__

    for _ in batches:
        pass
    yield pd.DataFrame({"version": [__version__], "python": [sys.executable]})


def check_executors() -> Check:
    """One task of a Spark job, whose Python worker imports shardtrain and says which, and where."""
    from common import __version__
    from common.spark import EXECUTOR_SHARDTRAIN_FIX, executors_without_shardtrain

    try:
        rows = _doctor_session().range(0, 1, 1, 1).mapInPandas(_shardtrain_on_executor,
                                                               "version string, python string").collect()
    except Exception as exc:  # noqa: BLE001 - the failure is the finding
        missing = executors_without_shardtrain(str(exc))
        if missing:
            return Check("executors", False, missing, EXECUTOR_SHARDTRAIN_FIX)
        return Check("executors", False, f"a one-task Spark job failed: {first_line(exc)}",
                     "run with -v for Spark's own log")
    version, python = rows[0]["version"], rows[0]["python"]
    ok = version == __version__
    return Check("executors", ok, f"shardtrain {version} imports in the executors' Python ({python})"
                 + ("" if ok else f", but this driver runs shardtrain {__version__}"),
                 "" if ok else f"install shardtrain {__version__} on the executors (the jobs' tasks run its code)")


def check_horovod_on_spark(num_proc: int = 2) -> Check:
    fix = "see docs/troubleshooting.md; run with -v for Spark and Horovod logs"
    if not _installed("horovod"):
        return Check("horovod-on-spark", True, "skipped: Horovod not installed")
    if spark_mode()[0] == "connect":
        return Check("horovod-on-spark", True, "skipped: Spark Connect cannot run Horovod (launch.backend=torch does)")
    if not check_executors().ok:  # the ranks run shardtrain's code there too (one more tiny job: ~1 s)
        return Check("horovod-on-spark", True, "skipped: the executors cannot run shardtrain (see executors)")
    try:
        import horovod.spark
    except Exception as exc:  # noqa: BLE001
        return Check("horovod-on-spark", False, f"cannot import ({exc})", fix)
    _doctor_session()
    try:
        with open(os.devnull, "w") as quiet:  # the ranks' own output; the verdict is printed below
            results = horovod.spark.run(_allreduce_rank, num_proc=num_proc, start_timeout=120, verbose=0,
                                        stdout=quiet, stderr=quiet)
    except Exception as exc:  # noqa: BLE001
        return Check("horovod-on-spark", False, f"{num_proc}-rank allreduce failed: {exc}", fix)
    expected = float(sum(range(1, num_proc + 1)))
    ok = sorted(r[0] for r in results) == list(range(num_proc)) and all(r[2] == expected for r in results)
    return Check("horovod-on-spark", ok, f"{num_proc} ranks on local Spark, allreduce sum = "
                 f"{[r[2] for r in results]} (expected {expected:g})", "" if ok else fix)


def _installed(module: str) -> bool:
    from training.config import installed

    return installed(module)


def backend_status() -> dict[str, str]:
    """launch.backend -> "" where this environment can use it, else why not."""
    status = {}
    horovod = check_horovod()
    status["horovod"] = "" if horovod.ok and _installed("horovod") else (
        "not installed" if horovod.ok else f"{horovod.detail}; fix: {horovod.fix}")
    if spark_mode()[0] == "connect":
        status["horovod"] = "needs classic Spark, and sessions here are Spark Connect"
    try:
        import torch.distributed as dist
        from pyspark.ml.torch.distributor import TorchDistributor  # noqa: F401 - pyspark >= 3.4

        status["torch"] = "" if dist.is_available() and dist.is_gloo_available() else \
            "this torch build has no torch.distributed with Gloo"
    except Exception as exc:  # noqa: BLE001 - the reason is the finding
        status["torch"] = f"cannot import torch.distributed / pyspark's TorchDistributor ({exc})"
    try:  # the ranks inside barrier tasks: a barrier mapInPandas (pyspark >= 3.5), classic and Connect alike
        import inspect

        import torch.distributed as dist
        from pyspark.sql import DataFrame

        status["torch_tasks"] = (
            "this torch build has no torch.distributed with Gloo" if not (dist.is_available() and dist.is_gloo_available())
            else "" if "barrier" in inspect.signature(DataFrame.mapInPandas).parameters
            else "this pyspark has no barrier mapInPandas (pyspark >= 3.5 has)")
    except Exception as exc:  # noqa: BLE001 - the reason is the finding
        status["torch_tasks"] = f"cannot import torch.distributed / pyspark's DataFrame ({exc})"
    try:  # no Spark: ranks started by torchrun (or Kubernetes, ...); Classic and Connect alike
        import torch.distributed.run  # noqa: F401 - what `torchrun` runs

        status["torchrun"] = ""
    except Exception as exc:  # noqa: BLE001 - the reason is the finding
        status["torchrun"] = f"cannot import torch.distributed.run, what torchrun runs ({exc})"
    return status


def reader_status() -> dict[str, str]:
    """data.reader -> "" where this environment can use it, else why not."""
    petastorm = check_pyarrow_petastorm()
    status = {"petastorm": "" if petastorm.ok and _installed("petastorm") else (
        "not installed" if petastorm.ok else f"{petastorm.detail}; fix: {petastorm.fix}")}
    try:
        import numpy as np
        import pyarrow
        import pyarrow.parquet as pq

        from training.arrow_reader import ArrowRowGroupReader

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "p.parquet")
            pq.write_table(pyarrow.table({"x": np.arange(10, dtype=np.float32)}), path, row_group_size=4)
            reader = ArrowRowGroupReader([path], ["x"], shuffle=True, seed=0)
            rows = sum(t.num_rows for t in reader)
            reader.join()
        status["arrow"] = "" if rows == 10 else f"read {rows}/10 rows of a test file"
    except Exception as exc:  # noqa: BLE001
        status["arrow"] = f"reading Parquet with pyarrow failed: {exc!r}"
    return status


def _choices(kind: str, key: str, status: dict[str, str], default: str) -> Check:
    usable = [name for name, why in status.items() if not why]
    parts = [f"{name}: {'yes' if not why else 'no (' + why + ')'}" for name, why in status.items()]
    ok = default in usable
    return Check(kind, ok, f"{'; '.join(parts)}; default {key}={default}",
                 "" if ok else f"fix {default} as said, or set {key}={usable[0]}" if usable else "run .ci/bootstrap")


def check_backends() -> Check:
    from training.config import LaunchConfig
    from training.launchers import launcher_named

    default = LaunchConfig().backend
    if spark_mode()[0] == "connect" and launcher_named(default).classic_only:
        default = "torch"  # an unset launch.backend runs on torch over Connect (training.launchers.backend_for)
    return _choices("backends", "launch.backend", backend_status(), default)


def check_readers() -> Check:
    from training.config import DataConfig

    return _choices("readers", "data.reader", reader_status(), DataConfig().reader)


CHECKS: list[Callable[[], Check]] = [check_python, check_java, check_pyspark, check_spark_mode,
                                     check_pyarrow_petastorm, check_torch, check_horovod, check_backends, check_readers,
                                     check_executors, check_horovod_on_spark]
# The checks that start Spark work (--no-launch leaves them out).
LAUNCHES = (check_executors, check_horovod_on_spark)


def run_doctor(as_json: bool = False, skip_launch: bool = False) -> int:
    checks = [c for c in CHECKS if not (skip_launch and c in LAUNCHES)]
    results = []
    try:
        for check in checks:
            try:
                result = check()
            except Exception as exc:  # noqa: BLE001 - a crashing check is a failed check, not a crash
                result = Check(check.__name__.removeprefix("check_"), False, f"check crashed: {exc!r}")
            results.append(result)
            if not as_json:
                line = f"{'OK  ' if result.ok else 'FAIL'} {result.name:<18} {result.detail}"
                if not result.ok and result.fix:
                    line += f"\n     fix: {result.fix}"
                print(line, flush=True)
    finally:
        _stop_started_session()
    ok = all(r.ok for r in results)
    if as_json:
        print(json.dumps({"ok": ok, "checks": [asdict(r) for r in results]}, indent=2))
    return EXIT_OK if ok else EXIT_RUNTIME
