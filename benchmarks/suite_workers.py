"""The suite on N pytest-xdist workers against the serial run (``-n 0``), same tests, same machine,
interleaved: for each round, every worker count in turn, back to back. Prints one JSON line per
run (wall seconds, pass/fail counts, peak RSS of the whole process tree: pytest, its workers,
their Spark JVMs and ranks, sampled every 0.5 s) and, at the end, each count's best and median
wall time as a ratio to the serial run's (below 1: the parallel run finished sooner).

    .venv/bin/python benchmarks/suite_workers.py --rounds 2 --workers 0 2 -- tests/common
    .venv/bin/python benchmarks/suite_workers.py --rounds 2 --workers 0 2 -- tests/training -m ranks

Everything after ``--`` goes to pytest as it is. Read the ratios with the load average it prints:
on a shared machine the absolute seconds swing from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree_rss(root: psutil.Process) -> int:
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def run_once(workers: int, pytest_args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=900",
           "-n", str(workers), "--dist", "loadfile", *pytest_args]
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]
    done = threading.Event()

    def sample():
        root = psutil.Process(proc.pid)
        while not done.wait(0.5):
            try:
                peak[0] = max(peak[0], tree_rss(root))
            except psutil.NoSuchProcess:
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    wall = time.monotonic() - start
    done.set()
    sampler.join()
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped)", out.splitlines()[-1])}
    if proc.returncode != 0:  # which tests failed, and how: a parallel run must be as clean as the serial one
        counts["failures"] = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        sys.stderr.write(out[-20000:])
    return {"workers": workers, "wall_s": round(wall, 1), "rc": proc.returncode, **counts,
            "peak_rss_gib": round(peak[0] / 2**30, 2), "load_before": round(load_before, 1),
            "load_after": round(os.getloadavg()[0], 1), "last_line": out.splitlines()[-1][-200:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("pytest_args", nargs="+")
    args = parser.parse_args()
    walls: dict[int, list[float]] = {n: [] for n in args.workers}
    for round_ in range(args.rounds):
        for n in args.workers:
            result = run_once(n, args.pytest_args)
            walls[n].append(result["wall_s"])
            print(json.dumps({"round": round_ + 1, **result}), flush=True)
    base = args.workers[0]
    for n in args.workers:
        print(json.dumps({"workers": n, "walls_s": walls[n],
                          f"best_ratio_to_n{base}": round(min(walls[n]) / min(walls[base]), 2),
                          f"median_ratio_to_n{base}": round(statistics.median(walls[n]) / statistics.median(walls[base]), 2),
                          "pytest_args": args.pytest_args}), flush=True)


if __name__ == "__main__":
    main()
