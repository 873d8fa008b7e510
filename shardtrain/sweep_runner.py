"""The sweep's trials: each trial's directory (``output.path/trials/NNNN``, the same on every run of
the sweep), and ``TrialRunner``, which runs the study's remaining trials, ``sweep.parallel_trials``
at a time. Before it draws new ones, a trial left RUNNING by a sweep that died goes back to the
study's queue as itself (same number, directory and checkpoints), and a failed trial whose failure
may pass runs again as a new trial with its values. Each trial is one training run through the
public API (``training.api.train``); its epochs report the objective to Optuna, whose pruner may
end the run at an epoch boundary; its outcome (finished, pruned, failed with its error and exit
class) goes into the study, and the sweep goes on.

Driver-only; it reaches training through its public API only (tests/test_import_graph.py), and
publishes nothing (shardtrain.sweep_publish).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time

from common.errors import EXIT_RUNTIME, ShardtrainError, first_line
from common.faults import fault_point
from shardtrain.sweep_config import SweepConfig
from shardtrain.sweep_space import suggest, trial_config
from shardtrain.sweep_study import retryable, standing_trials, superseded_trials
from shardtrain.sweep_tracking import SweepTracker
from training.config import TrainConfig

log = logging.getLogger("shardtrain.sweep")


def trial_dir(cfg: SweepConfig, number: int) -> str:
    return f"{cfg.output.path.rstrip('/')}/trials/{number:04d}"


def trial_output(cfg: SweepConfig, number: int) -> dict:
    # The same directory on every run of the sweep: a resumed trial's training finds its checkpoints there.
    return {"model_path": f"{trial_dir(cfg, number)}/model", "mode": "overwrite", "run_dir": None}


class TrialRunner:
    """Runs the study's remaining trials, ``parallel_trials`` at a time (threads of the driver,
    each one training launch at a time)."""

    def __init__(self, cfg: SweepConfig, train_cfg: TrainConfig, study, storage, spark, tracker: SweepTracker):
        self.cfg, self.train_cfg, self.study, self.storage = cfg, train_cfg, study, storage
        self.spark, self.tracker = spark, tracker
        self.lock = threading.Lock()
        self.to_ask = 0  # new trials still to draw
        self.ran: list[int] = []
        self.errors: list[BaseException] = []

    def run(self) -> None:
        self._requeue_interrupted(self.study.get_trials(deepcopy=False))
        self._retry_failed(self.study.get_trials(deepcopy=False))
        finished = sum(t.state.is_finished() for t in standing_trials(self.study.get_trials(deepcopy=False)))
        self.to_ask = max(0, self.cfg.sweep.trials - finished)
        if finished:
            log.info("study %s: %d trial(s) finished before; %d to run", self.study.study_name, finished,
                     self.to_ask)
        workers = self.cfg.sweep.parallel_trials
        if workers == 1:
            self._work()  # the main thread: Horovod-on-Spark needs it
        else:
            threads = [threading.Thread(target=self._work, name=f"shardtrain-trial-{i}") for i in range(workers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        if self.errors:
            raise self.errors[0]

    def _requeue_interrupted(self, trials) -> None:
        """RUNNING now means its sweep died (this one holds output.path's lock): it goes back to the
        study's queue of waiting trials (the storage's public state update; enqueue_trial's queue), and
        ask() hands it out again as itself: same number, so the same trial directory and checkpoints,
        and the params it already drew. A retry as a new trial (Optuna's RetryFailedTrialCallback) would
        leave a FAIL trial behind and train in a new directory from scratch."""
        from optuna.trial import TrialState

        study_id = self.storage.get_study_id_from_name(self.study.study_name)
        for t in trials:
            if t.state == TrialState.RUNNING:
                trial_id = self.storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
                self.storage.set_trial_state_values(trial_id, TrialState.WAITING)
                log.info("trial %d was interrupted (its sweep stopped); it resumes from its newest checkpoint",
                         t.number)

    def _retry_failed(self, trials) -> None:
        """A failed trial whose failure may pass (a full disk, a lost worker: exit-1 class) runs again,
        at most sweep.retries times, as a new trial with its values (enqueue_trial), linked to it by
        its ``retry_of``. Not as itself, as an interrupted trial is: Optuna refuses to change a
        finished trial. The new trial trains from scratch in its own directory; the failed one keeps
        its run directory and error as the record of what happened."""
        retried = superseded_trials(trials)
        for t in trials:
            if t.number in retried or not retryable(t, self.cfg.sweep.retries):
                continue
            attempt = t.user_attrs.get("attempt", 1) + 1
            self.study.enqueue_trial(t.params, user_attrs={"retry_of": t.number, "attempt": attempt})
            log.info("trial %d failed (%s); it runs again as a new trial with its values (attempt %d of %d, "
                     "sweep.retries=%d)", t.number, t.user_attrs.get("error", "no error recorded"), attempt,
                     self.cfg.sweep.retries + 1, self.cfg.sweep.retries)

    def _next(self):
        with self.lock:
            if self.to_ask <= 0:
                return None
            self.to_ask -= 1
            return self.study.ask()

    def _work(self) -> None:
        try:
            while (trial := self._next()) is not None:
                with self.lock:
                    self.ran.append(trial.number)
                self._run_trial(trial)
                fault_point("sweep", "after-trial")  # the trial's outcome is in the study; the next is not drawn
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread by run()
            self.errors.append(exc)

    def _run_trial(self, trial) -> None:
        from optuna.trial import TrialState
        from training.api import train

        cfg = self.cfg
        metric = cfg.sweep.objective.metric
        params = suggest(trial, cfg.sweep.space)
        # The trial's own epochs (train.epochs may be a key of the space), not the base config's.
        epochs = int(params.get("train.epochs", self.train_cfg.train.epochs))
        trial.set_user_attr("run_dir", f"{trial_dir(cfg, trial.number)}/model.run")
        log.info("trial %d: %s", trial.number, json.dumps(params))

        def on_epoch(record: dict) -> bool:
            value = record.get(metric)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                return False
            trial.report(float(value), int(record["epoch"]))
            prune = int(record["epoch"]) < epochs and trial.should_prune()
            if prune:
                log.info("trial %d: pruned after epoch %d (%s %.6g)", trial.number, record["epoch"], metric, value)
            return prune

        started = time.perf_counter()
        try:
            train_cfg = trial_config(self.train_cfg, params, output=trial_output(cfg, trial.number),
                                     tracking=self.tracker.trial_tracking(self.train_cfg, trial.number))
            result = train(train_cfg, self.spark, on_epoch=on_epoch)
        except Exception as exc:  # noqa: BLE001 - a trial's failure is recorded; the sweep goes on
            error = f"{type(exc).__name__}: {first_line(exc)}"
            trial.set_user_attr("error", error)
            # Its class decides whether a rerun tries it again (retryable), as for a command's exit status.
            trial.set_user_attr("exit_code", exc.exit_code if isinstance(exc, ShardtrainError) else EXIT_RUNTIME)
            self.study.tell(trial, state=TrialState.FAIL)
            self.tracker.failed_trial(trial.number, params, error)
            log.warning("trial %d failed, the sweep goes on: %s", trial.number, error)
            return
        trial.set_user_attr("epochs", len(result.metrics))
        trial.set_user_attr("seconds", round(time.perf_counter() - started, 3))
        trial.set_user_attr("model_uri", result.model_uri)
        if result.stopped_early:
            self.study.tell(trial, state=TrialState.PRUNED)
            return
        value = result.final.get(metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            trial.set_user_attr("error", f"the run reported no finite {metric} ({value!r})")
            trial.set_user_attr("exit_code", EXIT_RUNTIME)
            self.study.tell(trial, state=TrialState.FAIL)
            return
        self.study.tell(trial, float(value))
        log.info("trial %d: %s %.6g", trial.number, metric, value)


__all__ = ["TrialRunner", "trial_dir", "trial_output"]
