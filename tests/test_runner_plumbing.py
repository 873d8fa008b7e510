"""The suite's runner plumbing in tests/conftest.py, run by a real pytest with two real xdist
workers over a small suite of its own: every test file stays on one worker (module-scoped
datasets and rank launches are not run twice), the files of a group (``spark-connect``: those
that start a ``ConnectProcess``) share one worker, under either profile's pytest, the heaviest unit goes out
first, and the controller prints the seconds per file and their total at the end, serial or parallel.

Marked ``stack``: the hooks run under each profile's own pytest (8.x pinned, 9.x current).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.stack

TESTS = os.path.dirname(os.path.abspath(__file__))

# The suite's conftest, loaded under another name (the small suite's own conftest is "conftest").
CONFTEST = f"""
import importlib.util, sys
sys.path.insert(0, {TESTS!r})
spec = importlib.util.spec_from_file_location("suite_conftest", {os.path.join(TESTS, "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_xdist_make_scheduler = suite.pytest_xdist_make_scheduler
pytest_runtest_logreport = suite.pytest_runtest_logreport
pytest_terminal_summary = suite.pytest_terminal_summary
"""

# Each test records which worker ran it, and when; a file of six, so a per-test split would show.
TEST_FILE = """
import json, os, time, pytest
{extra}
@pytest.mark.parametrize("i", range(6))
def test_records_its_worker(i):
    with open(os.path.join(os.environ["RECORD_DIR"], f"{{__name__}}-{{i}}.json"), "w") as f:
        json.dump({{"file": __name__, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "at": time.time()}}, f)
"""


def _small_suite(root: Path) -> Path:
    (root / "conftest.py").write_text(CONFTEST)
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    for name in ("test_alpha", "test_beta"):
        (root / f"{name}.py").write_text(TEST_FILE.format(extra=""))
    # The heaviest unit by the scheduler's guess (conftest.unit_weight: the size of its source), last
    # in xdist's own order (fewest tests, last collected).
    (root / "test_gamma.py").write_text(TEST_FILE.format(extra="# " + "x" * 4000))
    for name in ("test_connect_one", "test_connect_two"):  # what the group is found by: a ConnectProcess started
        (root / f"{name}.py").write_text(TEST_FILE.format(extra="def _session():\n    return ConnectProcess()\n"))
    records = root / "records"
    records.mkdir()
    return records


def _run(root: Path, records: Path, *args: str) -> tuple[str, dict[str, set[str]], set[str]]:
    env = {**os.environ, "RECORD_DIR": str(records)}
    env.pop("PYTEST_XDIST_WORKER", None)  # this suite may itself run on a worker
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--rootdir", str(root), *args, str(root)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers: dict[str, set[str]] = {}
    first: dict[str, tuple[float, str]] = {}  # each worker's first test: the unit it was handed first
    for record in records.iterdir():
        entry = json.loads(record.read_text())
        workers.setdefault(entry["file"], set()).add(entry["worker"])
        seen = (entry["at"], entry["file"])
        first[entry["worker"]] = min(first.get(entry["worker"], seen), seen)
        record.unlink()
    return proc.stdout, workers, {file for _, file in first.values()}


def _time_by_file(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "time by test file" in line)
    return lines[start + 1:start + 7]


@pytest.mark.parametrize("workers", [0, 2])
def test_files_stay_on_one_worker_and_the_time_by_file_is_printed(tmp_path, workers):
    records = _small_suite(tmp_path)
    out, ran_on, firsts = _run(tmp_path, records, "-n", str(workers), "--dist", "loadfile")

    assert sorted(ran_on) == ["test_alpha", "test_beta", "test_connect_one", "test_connect_two", "test_gamma"]
    assert all(len(w) == 1 for w in ran_on.values()), f"a file's tests ran on several workers: {ran_on}"
    if workers:
        assert ran_on["test_connect_one"] == ran_on["test_connect_two"], ran_on  # the spark-connect group
        assert set().union(*ran_on.values()) == {"gw0", "gw1"}, ran_on  # and both workers had work
        # The two heaviest units went out first, one to each worker: gamma (which xdist's own order,
        # most tests first, hands out last) and the group; alpha and beta after them.
        assert firsts == {"test_gamma", "test_connect_one"}, firsts
        assert "30 passed" in out
    else:
        assert set().union(*ran_on.values()) == {"main"}

    table = _time_by_file(out)
    files = [line.split()[-1] for line in table[:5]]
    assert sorted(files) == sorted(f"{name}.py" for name in ran_on), table
    seconds = [float(line.split()[0]) for line in table[:5]]
    assert seconds == sorted(seconds, reverse=True), table
    assert "s  in all test files" in table[5] and float(table[5].split()[0]) == pytest.approx(sum(seconds), abs=0.3)
    assert ("on 2 xdist workers" in table[5]) == bool(workers), table[5]
