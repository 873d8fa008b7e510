"""The rank side of a supervised launch: ``Reporter``, one rank's link to the driver's progress
server (``training.launchers.supervisor``), and the protocol both sides speak.

Every rank entry (``training.launchers.rank_entry``) builds one with
``Reporter.from_env(rank, steps_per_epoch)`` from the three environment variables the supervisor
adds to the launch, passes ``reporter.on_step`` / ``on_validation`` / ``on_published`` to the rank
loop and calls ``reporter.finished(error_line)`` last. Without those variables (in-process, or a
driver that cannot be reached) it is silent and training goes on unsupervised.

Protocol: each rank holds one TCP connection to the driver and sends a JSON line after each step
(at most ten a second) and every ``interval`` seconds: its step, phase, validation batches, pid and
host. The first line carries a per-launch token. The driver may answer ``abort``: a live rank then
exits at once. What counts as progress in each phase is the driver's rule (see the supervisor).
When the driver decides where a run ends (``EPOCHS_ENV``: a sweep's pruner), rank 0 sends each
epoch's record (``event: epoch``) and waits for ``stop`` or ``go``.

This module imports only the standard library and ``common`` (psutil lazily): it runs on executors.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading

from common.errors import EXIT_RUNTIME

log = logging.getLogger("shardtrain.train")

ADDRESS_ENV = "SHARDTRAIN_SUPERVISOR"  # host:port of the driver's ProgressServer
TOKEN_ENV = "SHARDTRAIN_SUPERVISOR_TOKEN"
INTERVAL_ENV = "SHARDTRAIN_SUPERVISOR_INTERVAL"  # seconds between a rank's reports
EPOCHS_ENV = "SHARDTRAIN_SUPERVISOR_EPOCHS"  # "1": the driver answers each epoch's record with stop or go
EPOCH_ANSWER_TIMEOUT_S = 300  # a driver that does not answer by then: the run goes on, with a warning

STARTING, TRAINING, VALIDATING, BETWEEN_EPOCHS = "starting", "training", "validating", "between_epochs"
AFTER_PUBLISH = "after_publish"  # rank 0, model published: the run report and MLflow tracking remain


class Reporter:
    """One rank's link to the driver. Never raises into training and never blocks it: the main
    thread only stores the step; a daemon thread sends it."""

    def __init__(self, address: str | None, token: str, rank: int, steps_per_epoch: int, interval: float,
                 asks_epochs: bool = False):
        self.rank, self.steps_per_epoch, self.interval = rank, steps_per_epoch, interval
        self.token = token
        self.asks_epochs = asks_epochs
        self._answer: bool | None = None  # the driver's word on the last epoch record sent
        self._answered = threading.Event()
        self.step: int | None = None  # None until this process finishes its first step
        self.validation_batches: int | None = None  # batches done in the current validation pass, if in one
        self.published = False
        self._sock = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        if address:
            self._connect(address)
        if self._sock:
            threading.Thread(target=self._beat, name="shardtrain-reporter", daemon=True).start()
            threading.Thread(target=self._listen, name="shardtrain-abort", daemon=True).start()

    @classmethod
    def from_env(cls, rank: int, steps_per_epoch: int) -> "Reporter":
        """The reporter ``run_supervised`` asked for through the environment, or a silent one."""
        address = os.environ.get(ADDRESS_ENV)
        interval = float(os.environ.get(INTERVAL_ENV, "1"))
        return cls(address, os.environ.get(TOKEN_ENV, ""), rank, steps_per_epoch, interval,
                   asks_epochs=os.environ.get(EPOCHS_ENV) == "1")

    def on_step(self, step: int) -> None:
        self.step = step
        self._wake.set()  # report soon: a rank that dies next should be known at this step

    def on_validation(self, batches: int | None) -> None:
        """``batches`` done in the current validation pass; ``None`` when the pass is over."""
        self.validation_batches = batches
        self._wake.set()

    def should_stop(self, record: dict) -> bool:
        """Rank 0 at an epoch end: the driver's answer to the epoch's record (False when the driver
        does not decide, cannot be reached, or does not answer in EPOCH_ANSWER_TIMEOUT_S)."""
        if not self.asks_epochs or not self._sock:
            return False
        self._answered.clear()
        self._send({"event": "epoch", "record": record})
        if not self._answered.wait(EPOCH_ANSWER_TIMEOUT_S):
            log.warning("rank %d: the driver did not answer epoch %s's record in %d s; training goes on", self.rank,
                        record.get("epoch"), EPOCH_ANSWER_TIMEOUT_S)
            return False
        return bool(self._answer)

    def on_published(self) -> None:
        """Rank 0 published the model: from now on the stall clock runs (see training.launchers.supervisor)."""
        self.published = True
        self._wake.set()

    def finished(self, error: str | None, secondary: bool = False) -> None:
        """Last report: done, with the rank's own error line if it failed (``secondary``: an error
        that only says another rank went away)."""
        self._send({"event": "done", "error": error, "secondary": secondary})
        self._stop.set()
        if self._sock:
            self._sock.close()

    @property
    def phase(self) -> str:
        if self.published:
            return AFTER_PUBLISH
        if self.validation_batches is not None:
            return VALIDATING
        if self.step is None:
            return STARTING
        return BETWEEN_EPOCHS if self.step % self.steps_per_epoch == 0 else TRAINING

    def _connect(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        try:
            # The timeout also bounds a send to a driver that stopped reading: the rank then goes on
            # unsupervised instead of blocking in its last report.
            self._sock = socket.create_connection((host, int(port)), timeout=30)
        except OSError as exc:
            log.warning("rank %d cannot reach the driver's progress server at %s (%s): it will not be supervised",
                        self.rank, address, exc)
            return
        self._send({"event": "hello", "token": self.token, "pid": os.getpid(), "host": socket.gethostname(),
                    "created": _process_created(os.getpid())})

    def _send(self, message: dict) -> None:
        if not self._sock:
            return
        message = {"rank": self.rank, "step": self.step, "phase": self.phase, "batches": self.validation_batches,
                   **message}
        try:
            with self._lock:
                self._sock.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            self._sock = None  # the driver went away; training goes on unsupervised

    def _beat(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            self._send({"event": "beat"})
            self._stop.wait(0.1)  # at most ten reports a second, however fast the steps

    def _listen(self) -> None:
        sock, received = self._sock, b""
        while sock and not self._stop.is_set():
            try:
                chunk = sock.recv(64)
            except socket.timeout:
                continue  # nothing from the driver, which is the normal case
            except OSError:
                return
            if not chunk:
                return
            received = (received + chunk)[-64:]
            for word, answer in ((b"stop\n", True), (b"go\n", False)):
                if word in received:
                    received = received.replace(word, b"")
                    self._answer = answer
                    self._answered.set()
            if b"abort\n" in received:
                # The driver gave up on this launch (another rank stalled): leave now rather than
                # wait in a collective for a rank that will never answer.
                os._exit(EXIT_RUNTIME)


def _process_created(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 - only used to avoid killing a reused pid
        return None


__all__ = ["ADDRESS_ENV", "AFTER_PUBLISH", "BETWEEN_EPOCHS", "EPOCHS_ENV", "INTERVAL_ENV", "STARTING", "TOKEN_ENV", "TRAINING",
           "VALIDATING", "Reporter"]
