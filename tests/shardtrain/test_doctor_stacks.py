"""`shardtrain doctor` on either profile: it says which launch backends and data readers this
environment can use, why not, and which the defaults pick; a profile without Horovod and
petastorm (the current stack) passes, because the defaults then pick torch and arrow."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.stack]


def test_doctor_reports_the_backends_and_readers_this_environment_can_use():
    proc = subprocess.run([sys.executable, "-m", "shardtrain.cli", "doctor", "--json", "--no-launch"],
                          capture_output=True, text=True, timeout=300)
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    horovod = importlib.util.find_spec("horovod") is not None
    petastorm = importlib.util.find_spec("petastorm") is not None

    backends = checks["backends"]
    assert backends["ok"] and "torch: yes" in backends["detail"]
    assert "torchrun: yes" in backends["detail"]  # torch.distributed.run imports on both profiles
    assert "torch_tasks: yes" in backends["detail"]  # a barrier mapInPandas: pyspark 3.5 and 4
    assert ("horovod: yes" if horovod else "horovod: no (not installed)") in backends["detail"]
    assert backends["detail"].endswith(f"default launch.backend={'horovod' if horovod else 'torch'}")

    readers = checks["readers"]
    assert readers["ok"] and "arrow: yes" in readers["detail"]
    assert ("petastorm: yes" if petastorm else "petastorm: no (not installed)") in readers["detail"]
    assert readers["detail"].endswith(f"default data.reader={'petastorm' if petastorm else 'arrow'}")

    # No session and no SPARK_REMOTE: classic; whether the Spark Connect client is there, either way.
    spark = checks["spark"]
    connect_client = all(importlib.util.find_spec(m) for m in ("grpc", "grpc_status"))
    assert spark["ok"] and spark["detail"].startswith("classic Spark (no active session and no SPARK_REMOTE")
    assert ("Spark Connect client installed" if connect_client else "no Spark Connect client") in spark["detail"]

    if not horovod:  # absent, not broken: its lines pass and say what is used instead
        assert checks["horovod"]["ok"] and "launch.backend defaults to torch" in checks["horovod"]["detail"]
    assert proc.returncode == 0, [c for c in checks.values() if not c["ok"]]
