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
    assert ("horovod: yes" if horovod else "horovod: no (not installed)") in backends["detail"]
    assert backends["detail"].endswith(f"default launch.backend={'horovod' if horovod else 'torch'}")

    readers = checks["readers"]
    assert readers["ok"] and "arrow: yes" in readers["detail"]
    assert ("petastorm: yes" if petastorm else "petastorm: no (not installed)") in readers["detail"]
    assert readers["detail"].endswith(f"default data.reader={'petastorm' if petastorm else 'arrow'}")

    if not horovod:  # absent, not broken: its lines pass and say what is used instead
        assert checks["horovod"]["ok"] and "launch.backend defaults to torch" in checks["horovod"]["detail"]
    assert proc.returncode == 0, [c for c in checks.values() if not c["ok"]]
