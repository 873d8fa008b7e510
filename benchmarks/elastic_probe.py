"""Horovod elastic on 3 ranks (``launch.elastic: true``), beyond what the test suite's 2-rank test
covers: ``train()`` on ``local[3,4]`` (Spark may re-run the killed rank's task, so it can rejoin),
rank 1 killed with SIGKILL by its pid once the first checkpoint is committed.

    .venv/bin/python benchmarks/elastic_probe.py [--timeout 300]

Prints one JSON line: the outcome (ok, the error, or timeout: a hang past ``--timeout``
seconds), the final world size, steps per rank, the steps a plan for that world size gives
(every rank must have run exactly twice that: 2 epochs), and the driver's elastic log lines.
Upstream deadlocks to look for (horovod#3494, #2652) show up as a timeout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "training"))

MARKER = "ELASTIC_PROBE"


def rank_processes(token: str) -> dict[int, "object"]:
    import psutil

    found = {}
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get(MARKER) == token and "gloo_exec_fn" in " ".join(proc.cmdline()):
                found[int(env.get("HOROVOD_RANK", "-1"))] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_rank_1(token: str, checkpoints: str, done: dict) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        committed = os.path.isdir(checkpoints) and any(
            os.path.exists(os.path.join(checkpoints, d, "_COMMITTED")) for d in os.listdir(checkpoints))
        victim = rank_processes(token).get(1) if committed else None
        if victim:
            victim.send_signal(signal.SIGKILL)
            done.update(pid=victim.pid, at=time.time())
            return
        time.sleep(0.05)


def stop_ranks(token: str) -> None:
    for proc in rank_processes(token).values():
        try:
            proc.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        message = record.getMessage()
        if "elastic" in message or " left:" in message or "restart" in message:
            self.lines.append(message)


def probe(timeout: float) -> dict:
    from tabular_data import write_dataset
    from training import load_train_config, train
    from training.epoch_steps import steps_per_epoch

    work = tempfile.mkdtemp(prefix="elastic-probe-")
    layout = {"train": [[4000], [4000], [4000]], "val": [[300]]}
    ds = write_dataset(os.path.join(work, "ds"), layout)
    token = uuid.uuid4().hex
    cfg = load_train_config(None, [
        f"data.path={ds.uri}", f"output.model_path={work}/model", "launch.num_proc=3", "launch.elastic=true",
        "launch.min_num_proc=2", "launch.max_restarts=0", f"launch.env.{MARKER}={token}",
        "spark.master=local[3,4]", "train.batch_size=32", "train.epochs=2", "model.hidden=[16]",
        "checkpoint.every_steps=20"])
    handler = Lines()
    logging.getLogger("shardtrain").addHandler(handler)
    killed: dict = {}
    threading.Thread(target=kill_rank_1, args=(token, f"{work}/model.run/checkpoints", killed), daemon=True).start()
    outcome: dict = {}
    started = time.monotonic()

    def watchdog():
        report = {**outcome, "outcome": "timeout", "after_seconds": timeout, "killed": killed, "log": handler.lines}
        print(json.dumps(report), flush=True)
        stop_ranks(token)
        os._exit(1)  # a hung launch must not keep this process alive

    timer = threading.Timer(timeout, watchdog)
    timer.daemon = True
    timer.start()
    try:
        result = train(cfg)  # on the main thread: Horovod installs signal handlers
        rows = sum(map(sum, layout["train"]))
        outcome.update(outcome="ok", world_size=result.world_size, steps_per_rank=result.steps_per_rank,
                       plan_steps_per_epoch=steps_per_epoch(rows, result.world_size, 32))
    except Exception as exc:  # noqa: BLE001 - the outcome is what this script reports
        outcome.update(outcome="error", error=f"{type(exc).__name__}: {str(exc)[:1500]}")
    timer.cancel()
    outcome.update(seconds=round(time.monotonic() - started, 1), killed=killed, log=handler.lines)
    stop_ranks(token)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    print(json.dumps(probe(args.timeout), default=str), flush=True)


if __name__ == "__main__":
    main()
