"""Supervising a launch, on the driver: the ranks' reports are collected, a launch that has
stopped making progress is stopped, a failure is explained rank by rank, and the ranks are
relaunched when the failure policy (``training.launchers.failure_policy``) says a retry can fix it.

Backend-agnostic: ``run_supervised`` wraps any ``launch_fn(plan, spark, launch_cfg) -> list[dict]``
(Horovod-on-Spark, torch.distributed) and only adds three environment variables to
``launch_cfg.env``, which the ranks' ``Reporter`` (``training.launchers.progress``, the rank side
and the protocol) reads. This module is driver-only: no rank imports it.

What counts as progress: inside an epoch, a rank must advance its step; inside a validation pass,
the number of validation batches it has done (the loop reports both; a rank that finished its
batches and waits in the pass's allreduce for a stuck peer makes no progress either). Before its
first step (start-up, restoring a checkpoint, opening readers) and between the passes (checkpoint
writes, publishing the model) there is nothing to count, so a rank's heartbeat is enough there.
After rank 0 has published the model, what is left (the run report, MLflow tracking) has no steps
either, but it is bounded: a rank still in that phase after the timeout is stalled too. A
process that sends nothing at all (stopped, hung in a call that holds the GIL, host gone) is
stalled in any phase. The heartbeat runs on its own thread, so it proves the process is alive,
not that the training thread moves: that is why the step and batch rules apply inside epochs and
validation passes, and the message lists every other rank's step beside the stalled ones.

Ranks that cannot reach the progress server (Databricks Connect from an IDE or a scheduler: the
server listens in the client process, apart from the cluster) are not called stalled while Spark
says the launch's tasks run: the launch says so once and watches Spark's own task state instead
(``common.spark.LaunchJobs``), which sees a rank process end but not a rank that hangs.

With ``launch.elastic`` a rank whose process died is logged (``rank N left ...``) and not waited
for: the others go on without it (training.elastic).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import signal
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from typing import Callable

from common.errors import LaunchError, RankStalledError, ShardtrainError
from common.spark import LaunchJobs, driver_address
from training.launchers.failure_policy import RAISE, FailurePolicy
from training.launchers.progress import (ADDRESS_ENV, AFTER_PUBLISH, EPOCHS_ENV, INTERVAL_ENV, STARTING, TOKEN_ENV,
                                         TRAINING, VALIDATING)
from training.launchers.rank_entry import check_results

log = logging.getLogger("shardtrain.train")

def beat_interval(stall_timeout_s: float) -> float:
    """How often a rank reports: often enough that a report is never stale by much of the timeout."""
    return min(1.0, max(0.2, stall_timeout_s / 20))


@dataclass
class RankState:
    rank: int
    pid: int | None = None
    host: str | None = None
    created: float | None = None
    step: int | None = None
    phase: str = STARTING
    batches: int | None = None  # validation batches done, while phase is VALIDATING
    last_seen: float = 0.0
    last_progress: float = 0.0
    done: bool = False
    error: str | None = None
    secondary: bool = False  # the error only says that another rank went away
    lost_at: float | None = None  # connection dropped without a final report: the process died

    def describe(self) -> str:
        at = "before its first step" if self.step is None else f"at step {self.step}"
        if self.done:
            return f"rank {self.rank} {at}, finished" + (f" with {self.error}" if self.error else "")
        if self.lost_at is not None:
            return f"rank {self.rank} {at}, its process died (no final report)"
        return f"rank {self.rank} {at}"


class ProgressServer(socketserver.ThreadingTCPServer):
    """Collects the ranks' reports; one thread per rank connection."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, token: str, on_epoch: Callable[[dict], bool] | None = None):
        super().__init__(("0.0.0.0", 0), _ReportHandler)
        self.token = token
        self.on_epoch = on_epoch  # rank 0's epoch records -> stop (True) or go on
        self.ranks: dict[int, RankState] = {}
        self.connections: list[socket.socket] = []
        self.lock = threading.Lock()

    def record(self, message: dict, now: float) -> RankState:
        with self.lock:
            rank = int(message["rank"])
            state = self.ranks.setdefault(rank, RankState(rank, last_progress=now))
            if message.get("event") == "hello":
                state.pid, state.host, state.created = message.get("pid"), message.get("host"), message.get("created")
            if (message.get("step"), message.get("phase"), message.get("batches")) != (state.step, state.phase,
                                                                                         state.batches):
                state.last_progress = now
            state.step, state.phase, state.last_seen = message.get("step"), message.get("phase", STARTING), now
            state.batches = message.get("batches")
            if message.get("event") == "done":
                state.done, state.error, state.secondary = True, message.get("error"), bool(message.get("secondary"))
            return state

    def answer_epoch(self, record: dict) -> bool:
        """Whether the run stops after the epoch of ``record``; a failing callback only warns."""
        if self.on_epoch is None:
            return False
        try:
            return bool(self.on_epoch(record))
        except Exception as exc:  # noqa: BLE001 - deciding to stop early must never fail the run
            log.warning("deciding whether to stop after epoch %s failed (%s: %s); training goes on",
                        record.get("epoch"), type(exc).__name__, exc)
            return False

    def lost(self, rank: int, now: float) -> None:
        with self.lock:
            state = self.ranks.get(rank)
            if state and not state.done:
                state.lost_at = now

    def snapshot(self) -> dict[int, RankState]:
        with self.lock:
            return {r: dataclasses.replace(s) for r, s in self.ranks.items()}

    def stop(self) -> None:
        """Stop serving and close the socket without waiting out the serve loop's poll: socketserver's
        ``shutdown()`` returns only when the loop's ``select`` next times out (0.5 s, paid by every
        launch), so connections of our own wake the loop until it has seen the request. Such a
        connection says nothing and is not a rank (``_ReportHandler``: no token, no record)."""
        stopping = threading.Thread(target=self.shutdown, name="shardtrain-progress-stop", daemon=True)
        stopping.start()
        while stopping.is_alive():
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.server_address[1]),
                                                                        timeout=1):
                pass
            stopping.join(0.01)
        self.server_close()

    def abort_all(self) -> None:
        for conn in list(self.connections):
            try:
                conn.sendall(b"abort\n")
            except OSError:
                pass


class _ReportHandler(socketserver.StreamRequestHandler):
    def handle(self):
        server: ProgressServer = self.server
        rank = None
        try:
            for line in self.rfile:
                message = json.loads(line)
                if rank is None and message.get("token") != server.token:
                    return  # not one of this launch's ranks
                if rank is None:
                    server.connections.append(self.connection)
                rank = server.record(message, time.monotonic()).rank
                if message.get("event") == "epoch":
                    self.connection.sendall(b"stop\n" if server.answer_epoch(message.get("record") or {}) else b"go\n")
        except (OSError, ValueError):
            pass  # a reset connection is a rank that went away, as below
        if rank is not None:
            server.lost(rank, time.monotonic())


def find_stalled(ranks: dict[int, RankState], world: int, started: float, now: float, timeout: float,
                 start_timeout: float = 0, elastic: bool = False,
                 tasks_running: bool = False) -> list[tuple[int, str]]:
    """(rank, why) for each stalled rank; empty while every rank moves, has finished, or is within the
    timeout. A rank that has not reported yet gets ``start_timeout`` more: the launcher's own wait
    for task slots comes first; while Spark says the launch's tasks run (``tasks_running``), a rank
    that never reported is one that cannot reach the driver, not a stalled one. ``elastic``: a rank whose process died is not waited for (the
    others go on without it; Horovod's elastic_timeout bounds a wait for too few ranks)."""
    reasons = []
    for rank in range(world):
        state = ranks.get(rank)
        if state is None:
            if now - started > timeout + start_timeout and not tasks_running:
                reasons.append((rank, f"rank {rank} never reported in {now - started:.0f} s (it did not start, or "
                                       "cannot reach the driver)"))
            continue
        at = "before its first step" if state.step is None else f"at step {state.step}"
        if state.done:
            continue
        if state.lost_at is not None:
            if not elastic and now - state.lost_at > timeout:
                reasons.append((rank, f"rank {rank}'s process died {at} and the launch did not end"))
        elif now - state.last_seen > timeout:
            reasons.append((rank, f"rank {rank} sent nothing for {now - state.last_seen:.0f} s, {at} (its process "
                                   "is stopped or hung, or its host is unreachable)"))
        elif state.phase == TRAINING and now - state.last_progress > timeout:
            reasons.append((rank, f"rank {rank} is alive but made no step for {now - state.last_progress:.0f} s, "
                                   f"{at} (stuck, or waiting for a rank that is)"))
        elif state.phase == VALIDATING and now - state.last_progress > timeout:
            reasons.append((rank, f"rank {rank} is alive but made no progress in validation for "
                                   f"{now - state.last_progress:.0f} s, after {state.batches} validation batch(es) "
                                   f"{at} (stuck, or waiting for a rank that is)"))
        elif state.phase == AFTER_PUBLISH and now - state.last_progress > timeout:
            reasons.append((rank, f"rank {rank} published the model {now - state.last_progress:.0f} s ago and has not "
                                   "finished (stuck writing the run report or in MLflow tracking)"))
    return _after_going_silent(reasons, ranks, now, timeout)


def _after_going_silent(reasons: list[tuple[int, str]], ranks: dict[int, RankState], now: float,
                        timeout: float) -> list[tuple[int, str]]:
    """A live rank that waits (no step, no validation batch) is usually waiting for a peer that went
    silent: a peer stopped just after the waiter's last step reaches its own verdict a little later.
    While such a peer has been silent for over half the timeout, the waiters' verdicts wait for it
    (at most half a timeout more), so the stall names the silent rank, the cause, not its victims."""
    named = {rank for rank, _ in reasons}
    waiting = {rank for rank, why in reasons if "(stuck, or waiting for a rank that is)" in why}
    if not waiting or waiting != named:
        return reasons
    going_silent = [state for rank, state in ranks.items() if rank not in named and not state.done
                    and state.lost_at is None and now - state.last_seen > timeout / 2]
    return [] if going_silent else reasons


class Supervision:
    """One launch under watch: the progress server, the watcher thread, and how to stop the launch."""

    def __init__(self, spark, world: int, stall_timeout_s: float, start_timeout: float = 0, elastic: bool = False,
                 on_epoch: Callable[[dict], bool] | None = None, stages: int = 1):
        self.spark, self.world, self.timeout, self.start_timeout = spark, world, stall_timeout_s, start_timeout
        self.elastic = elastic
        self.stages = stages  # train.pipeline.stages: rank r holds stage r % stages (pipeline inner)
        self._announced: set[int] = set()  # lost ranks already logged (launch.elastic)
        self.token = secrets.token_hex(16)
        self.server = ProgressServer(self.token, on_epoch)
        self.stall: str | None = None
        self._done = threading.Event()
        self._started = time.monotonic()
        self.jobs = LaunchJobs(spark)
        self.address = f"{driver_address(spark)}:{self.server.server_address[1]}"
        self.unreachable_said = False
        self._said_lock = threading.Lock()

    def launch_env(self) -> dict[str, str]:
        env = {ADDRESS_ENV: self.address, TOKEN_ENV: self.token, INTERVAL_ENV: str(beat_interval(self.timeout))}
        if self.server.on_epoch is not None:
            env[EPOCHS_ENV] = "1"
        return env

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, name="shardtrain-progress", daemon=True).start()
        threading.Thread(target=self._watch, name="shardtrain-watch", daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self.server.stop()
        self.jobs.close()
        ranks = self.ranks()
        if self.elastic:  # a rank lost after the watcher's last beat (the launch ended first) is said too
            self._announce_lost(ranks)
        silent = sorted(set(range(self.world)) - set(ranks))
        if silent and exc[0] is None:  # a launch shorter than the stall timeout says it too
            self._say_unreachable(silent)

    def ranks(self) -> dict[int, RankState]:
        return self.server.snapshot()

    def _watch(self) -> None:
        while not self._done.wait(beat_interval(self.timeout)):
            ranks = self.ranks()
            if self.elastic:
                self._announce_lost(ranks)
            now = time.monotonic()
            silent = sorted(set(range(self.world)) - set(ranks))
            # When the old rule would call a rank that never reported stalled (after the stall and
            # start timeouts), Spark running the launch's tasks says that it runs but cannot reach us.
            running = bool(silent) and now - self._started > self.timeout + self.start_timeout and \
                bool(self.jobs.running_tasks())
            if running:
                self._say_unreachable(silent)
            reasons = find_stalled(ranks, self.world, self._started, now, self.timeout, self.start_timeout,
                                   self.elastic, tasks_running=running)
            if reasons:
                self.stall = self._stall_message(reasons, ranks)
                log.error("%s; stopping the launch", self.stall)
                self._stop(ranks)
                return

    def _say_unreachable(self, silent: list[int]) -> None:
        with self._said_lock:  # the watcher and __exit__ may both get here
            if self.unreachable_said:
                return
            self.unreachable_said = True
        log.warning("rank(s) %s never reached the driver's progress server at %s (the cluster cannot connect to "
                    "this process: Spark Connect from outside the cluster, or a firewall): the launch is "
                    "supervised by Spark's task state instead, which sees a rank process end but "
                    "not a rank that hangs (set SHARDTRAIN_PROGRESS_HOST to an address of this machine that the "
                    "executors reach, and launch.stall_timeout_s applies again)", ", ".join(map(str, silent)),
                    self.address)

    def _announce_lost(self, ranks: dict[int, RankState]) -> None:
        for state in ranks.values():
            with self._said_lock:  # the watcher and __exit__ may both get here
                if state.lost_at is None or state.rank in self._announced:
                    continue
                self._announced.add(state.rank)
                alive = sum(1 for s in ranks.values() if s.lost_at is None)
                log.warning("rank %d left: its process died %s without reporting an error; launch.elastic: the %d "
                            "other rank(s) go on without it at world size %d", state.rank,
                            "before its first step" if state.step is None else f"at step {state.step}", alive, alive)

    def _stall_message(self, reasons: list[tuple[int, str]], ranks: dict[int, RankState]) -> str:
        # Silent ranks first, then the one stuck longest: a rank blocked in a collective is usually
        # waiting for one of them.
        reasons = sorted(reasons, key=lambda item: ("sent nothing" not in item[1],
                                                    getattr(ranks.get(item[0]), "last_progress", 0.0), item[0]))
        named = {rank for rank, _ in reasons}
        others = [ranks[r].describe() for r in sorted(ranks) if r not in named]
        first = reasons[0][0]
        # A stopped pipeline stage leaves its neighbours blocked in a point-to-point receive, not a
        # collective: the stage index says which part of the model stopped.
        stage = (f" (pipeline stage {first % self.stages} of train.pipeline.stages={self.stages}, replica "
                 f"{first // self.stages})" if self.stages > 1 else "")
        text = (f"rank {first}{stage} stalled: no progress for launch.stall_timeout_s={self.timeout:g} s: "
                + "; ".join(why for _, why in reasons))
        if others:
            text += "; the other ranks: " + ", ".join(others)
        return text + ". Raise launch.stall_timeout_s if a step or a validation pass legitimately takes longer"

    def _stop(self, ranks: dict[int, RankState]) -> None:
        """Make every rank process of this launch go away, then end its Spark jobs: those running
        when the stop began, noted first (a killed rank fails its task, and local mode's job with it,
        before the cancel comes), and any the launch has since."""
        running = self.jobs.running_jobs()
        self.server.abort_all()  # live ranks exit themselves
        here = socket.gethostname()
        for state in ranks.values():
            if state.host == here and state.pid and not state.done:
                _kill(state.pid, state.created)  # a stopped process cannot read "abort"; SIGKILL still works
        self._cancel_spark_jobs(running)

    def _cancel_spark_jobs(self, running: list[int] = ()) -> None:
        # The jobs this launch started (Horovod runs its job on its own thread, under its own group).
        for what in self.jobs.cancel(running):
            log.info("cancelled %s", what)


def _kill(pid: int, created: float | None) -> None:
    try:
        import psutil

        proc = psutil.Process(pid)
        if created is not None and abs(proc.create_time() - created) > 1:
            return  # the pid was reused by an unrelated process
        proc.send_signal(signal.SIGKILL)
    except Exception:  # noqa: BLE001 - already gone
        pass


# --- one launch, then relaunches ------------------------------------------------------------------

def supervise(launch_fn: Callable, plan, spark, launch_cfg,
              on_epoch: Callable[[dict], bool] | None = None) -> list[dict]:
    """``launch_fn`` in this thread (Horovod installs signal handlers, so it needs the main one)
    while a watcher thread stops it if a rank stalls; failures are explained rank by rank.
    ``on_epoch(record)``: rank 0's epoch records, answered stop (True) or go on."""
    with Supervision(spark, plan.world_size, launch_cfg.stall_timeout_s, launch_cfg.start_timeout,
                     launch_cfg.elastic, on_epoch, plan.pipeline_stages) as sup:
        cfg = dataclasses.replace(launch_cfg, env={**launch_cfg.env, **sup.launch_env()})
        try:
            results = launch_fn(plan, spark, cfg)
        except Exception as exc:  # noqa: BLE001 - re-raised as one typed error below
            if sup.stall:
                raise RankStalledError(sup.stall) from exc
            explained = explain(exc, sup.ranks())
            if explained is exc:
                raise
            raise explained from exc
        if sup.stall:
            raise RankStalledError(sup.stall)
        return check_results(results)


def explain(exc: Exception, ranks: dict[int, RankState]) -> Exception:
    """Add what the ranks reported (the dead rank's last step, a rank's own error) to a launch error."""
    if not isinstance(exc, LaunchError):
        return exc
    lost = sorted((s for s in ranks.values() if s.lost_at is not None), key=lambda s: s.lost_at)
    errors = [s for s in ranks.values() if s.done and s.error and not s.secondary]
    notes = []
    if lost:
        notes.append(f"rank {lost[0].rank} died " + ("before its first step" if lost[0].step is None
                                                   else f"at step {lost[0].step}") + " without reporting an error")
    notes += [f"rank {s.rank} reported {s.error}" for s in sorted(errors, key=lambda s: s.rank)]
    if not notes:
        return exc
    # A rank whose connection dropped without a final report died, whatever the launcher made of it.
    return LaunchError(f"{exc} ({'; '.join(notes)})", rank_lost=exc.rank_lost or bool(lost))


def run_supervised(launch_fn: Callable, plan, spark, launch_cfg, resume: str,
                   on_restart: Callable[[int, str], None] | None = None,
                   on_epoch: Callable[[dict], bool] | None = None) -> list[dict]:
    """Launch, and relaunch up to ``launch_cfg.max_restarts`` times after a retryable failure; the
    ranks resume from the newest complete checkpoint (``resume`` must be ``auto`` for that).
    ``on_restart(restart, reason)`` runs before each relaunch (the run directory's restart log)."""
    policy = FailurePolicy(launch_cfg.max_restarts, resume)
    restarts = 0
    while True:
        try:
            results = supervise(launch_fn, plan, spark, launch_cfg, on_epoch)
        except ShardtrainError as exc:
            decision = policy.decide(exc, restarts)
            if decision.action == RAISE:
                if decision.announce:
                    log.error("%s", decision.reason)
                raise
            restarts += 1
            log.warning("ranks failed: %s", decision.reason)
            log.warning("restarting the ranks (restart %d of launch.max_restarts=%d); they resume from the newest "
                        "complete checkpoint", restarts, launch_cfg.max_restarts)
            if on_restart:
                on_restart(restarts, decision.reason)
            continue
        if restarts:
            main = results[0]
            log.warning("finished after %d restart(s); the last one resumed from %s (step %d)%s", restarts,
                        main.get("resumed_from") or "the start (no checkpoint yet)", main.get("resumed_step") or 0,
                        "; the model was already published by this run before the ranks failed, so it was not "
                        "published again" if main.get("published") is False else "")
        return results


__all__ = ["ProgressServer", "RankState", "Supervision", "beat_interval", "explain", "find_stalled", "run_supervised",
           "supervise"]
