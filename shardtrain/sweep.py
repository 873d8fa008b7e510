"""``shardtrain sweep``: many training configs over one sharded dataset, drawn and pruned by Optuna.

One Spark application: the dataset is sharded once (the ``shard`` section, as ``shardtrain run``
does) or read as published (``train.data.path``); then ``sweep.trials`` trials, each a training
config drawn from ``sweep.space`` over ``train.*`` / ``model.*`` keys (shardtrain.sweep_space),
``sweep.parallel_trials`` of them at once. Each trial is a normal training run through the public
API (``training.api.train``): its own model, run directory, report.html and checkpoints under
``output.path/trials/NNNN``; its ranks send each epoch's record to the driver, where the trial
reports the objective to Optuna and the pruner decides whether the run ends at that epoch boundary
(``train(on_epoch=...)``; the run then writes its checkpoint and publishes as any run does).

Resumable and idempotent: the study lives in ``sweep.storage`` (an Optuna RDB URL, or a journal
file; by default ``output.path/study.journal``), and the sweep holds the writer lock of
``output.path`` for its whole run, so a trial still RUNNING in the study when a sweep starts was
left by one that died: it runs again in its own directory, where training resumes it from its
newest checkpoint. Complete and pruned trials are never run again. A trial that fails is recorded
in the study with its error and its class (exit 1 or 2) and the sweep goes on; a rerun runs a
trial that failed for a reason that may pass (exit 1: a full disk) again, as a new trial with its
values, at most ``sweep.retries`` times, and never one the training refused (exit 2: bad config).
Each trial's draw is a function of ``sweep.seed`` and its number (shardtrain.sweep_sampler), so a
resumed sweep draws what an uninterrupted one would, never a finished trial's values again. The
sweep fails when no trial finished: exit 1 while a rerun would run a trial, else exit 2.

The result: the best finished trial's model published atomically at ``output.model_path`` (its
files, its marker with the study's fingerprint, and ``sweep.json``: the trial, its parameters,
its objective and the sweep config), ``output.path/sweep.html``, and with ``train.tracking.mlflow``
a parent MLflow run whose children are the trials' own runs.

Driver-only; it reaches training through its public API (``training.api``, ``training.config``).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from common.config import config_fingerprint, dump_yaml, load_config, require, storage_path, to_dict
from common.errors import (EXIT_RUNTIME, ConfigError, OutputExistsError, ShardtrainError, StorageError, StorageIOError,
                           TrainingError, first_line)
from common.faults import fault_point
from pipelines.shard_config import ShardConfig
from shardtrain.sweep_report import REPORT, TrialRecord, write_sweep_report
from shardtrain.sweep_space import (check_fixed, check_space, decode_params, optuna_params, parse_space, suggest,
                                    trial_config)
from training.config import TrainConfig, TrainOutputConfig

log = logging.getLogger("shardtrain.sweep")

METRICS = {"val_loss": "minimize", "val_accuracy": "maximize", "val_mae": "minimize"}
RECORD = "sweep.json"  # in output.path: the study this directory belongs to; in the published model: the trial
JOURNAL = "study.journal"
_RDB_URL = re.compile(r"^(sqlite|postgresql|postgres|mysql|mariadb|oracle|mssql)(\+\w+)?://", re.IGNORECASE)


@dataclass
class ObjectiveConfig:
    metric: str = "val_loss"  # a per-epoch validation metric: val_loss, val_accuracy, val_mae
    direction: Literal["minimize", "maximize"] | None = None  # null: maximize val_accuracy, minimize the others

    def __post_init__(self):
        require(self.metric in METRICS, "metric", f"must be one of {', '.join(METRICS)} (a validation metric every "
                f"epoch reports), got {self.metric!r}")
        if self.direction is None:
            self.direction = METRICS[self.metric]


@dataclass
class PrunerConfig:
    """Which trials end early, from each one's objective at every epoch end (Optuna's pruners)."""

    type: Literal["none", "median", "successive_halving", "hyperband"] = "median"
    startup_trials: int = 2  # median: trials that finish before any is pruned
    warmup_epochs: int = 0  # median: epochs every trial runs before it may be pruned
    min_epochs: int = 1  # successive_halving / hyperband: the first rung (Optuna's min_resource)
    reduction_factor: int = 3  # successive_halving / hyperband: 1 in this many trials goes on at each rung

    def __post_init__(self):
        require(self.startup_trials >= 0, "startup_trials", f"must be >= 0, got {self.startup_trials}")
        require(self.warmup_epochs >= 0, "warmup_epochs", f"must be >= 0, got {self.warmup_epochs}")
        require(self.min_epochs >= 1, "min_epochs", f"must be >= 1, got {self.min_epochs}")
        require(self.reduction_factor >= 2, "reduction_factor", f"must be >= 2, got {self.reduction_factor}")


@dataclass
class SweepSection:
    # train.* / model.* key -> distribution (shardtrain.sweep_space). Any, not ParamSpec: an override
    # `sweep.space.train.lr={...}` nests the key at its dots, which parse_space joins back.
    space: dict[str, Any]
    trials: int = 8  # trials in the study, finished ones of earlier runs of this sweep included
    parallel_trials: int = 1  # trials training at once, each launch.num_proc ranks
    seed: int = 0  # the sampler's (TPE): trial N draws from a stream seeded by (seed, N)
    retries: int = 1  # times a rerun runs again a trial that failed with an exit-1-class error
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    pruner: PrunerConfig = field(default_factory=PrunerConfig)
    enqueue: list[dict[str, Any]] = field(default_factory=list)  # trials to run first, before drawn ones
    storage: str | None = storage_path(default=None)  # Optuna RDB URL or journal file; null: output.path/study.journal
    study_name: str | None = None  # null: shardtrain-sweep-<study fingerprint>

    def __post_init__(self):
        self.space = parse_space(self.space)
        require(1 <= self.trials <= 100_000, "trials", f"must be in [1, 100000], got {self.trials}")
        require(0 <= self.retries <= 100, "retries", f"must be in [0, 100], got {self.retries}")
        require(1 <= self.parallel_trials <= 1024, "parallel_trials",
                f"must be in [1, 1024], got {self.parallel_trials}")
        require(self.storage is None or bool(self.storage.strip()), "storage", "must not be empty (null: a journal "
                "file beside the sweep)")
        for i, params in enumerate(self.enqueue):
            check_fixed(params, self.space, f"enqueue[{i}]")


@dataclass
class SweepOutputConfig:
    # The sweep directory: trials/NNNN (each trial's model and run directory), sweep.html, sweep.json.
    path: str = storage_path()
    model_path: str = storage_path()  # the best trial's model, published at the end
    mode: Literal["error", "overwrite"] = "error"  # of model_path; this sweep's own best model is always replaced

    def __post_init__(self):
        require(bool(self.path), "path", "must not be empty")
        require(bool(self.model_path), "model_path", "must not be empty")


@dataclass
class SweepConfig:
    sweep: SweepSection
    output: SweepOutputConfig
    train: TrainConfig = field(default_factory=TrainConfig)  # every trial's config before its draw
    shard: ShardConfig | None = None  # run first (as `shardtrain run`); null: train.data.path is published

    def __post_init__(self):
        if self.shard is not None:
            if self.train.data.path is None:
                self.train.data.path = self.shard.output.path
            require(self.train.data.path == self.shard.output.path, "train.data.path",
                    f"must be the shard output ({self.shard.output.path}) or unset, got {self.train.data.path}")
        require(self.train.data.path is not None, "train.data.path",
                "is required without a shard section: the URI of a dataset published by `shardtrain shard`")
        placed = {"train.output.model_path": self.train.output.model_path != TrainOutputConfig().model_path,
                  "train.output.run_dir": self.train.output.run_dir is not None,
                  "train.checkpoint.path": self.train.checkpoint.path is not None}
        for key, is_set in placed.items():
            require(not is_set, key, "must be unset: the sweep puts each trial's model, run directory and checkpoints "
                    "under output.path/trials/NNNN, and the best model at output.model_path")
        require(self.train.data.val_split is not None, "train.data.val_split",
                f"must name a split: the objective ({self.sweep.objective.metric}) and the pruner read validation")
        # Parallel trials are threads of the driver, each launching its ranks.
        launch, parallel = self.train.launch, self.sweep.parallel_trials
        require(parallel == 1 or launch.mode == "spark", "sweep.parallel_trials",
                f"is {parallel} with train.launch.mode=in_process: the trials would train in threads of one process, "
                "where torch's tracer (the model's TorchScript export) is not thread-safe and fails them; set "
                "sweep.parallel_trials=1, or train.launch.mode=spark")
        require(parallel == 1 or launch.backend != "horovod", "sweep.parallel_trials",
                f"is {parallel} with train.launch.backend=horovod: Horovod-on-Spark launches only from the driver's "
                "main thread (it installs signal handlers); set train.launch.backend=torch_tasks (or torch: "
                "TorchDistributor), or sweep.parallel_trials=1")
        check_space(self.sweep.space, self.train)


def load_sweep_config(path=None, overrides=None, defaults: dict | None = None) -> SweepConfig:
    return load_config(SweepConfig, path, overrides, defaults)


@dataclass
class SweepResult:
    study_name: str
    fingerprint: str
    storage: str
    trials: list[TrialRecord]
    best: TrialRecord | None
    model_uri: str | None
    report_uri: str
    ran: list[int]  # trials run (or resumed) by this call

    def summary(self) -> str:
        counts = {state: sum(t.state == state for t in self.trials) for state in ("COMPLETE", "PRUNED", "FAIL")}
        lines = [f"study {self.study_name} ({self.storage}): {len(self.trials)} trial(s): {counts['COMPLETE']} "
                 f"finished, {counts['PRUNED']} pruned, {counts['FAIL']} failed; {len(self.ran)} run by this command"]
        if self.best:
            lines.append(f"best: trial {self.best.number}, {self.best.value:.6g} with {json.dumps(self.best.params)}")
            lines.append(f"model:  {self.model_uri}")
        lines.append(f"report: {self.report_uri}")
        return "\n".join(lines)


def sweep(cfg: SweepConfig, spark=None) -> SweepResult:
    """Shard (if ``cfg.shard``), then run the study's remaining trials, publish the best model and
    write sweep.html. One Spark application, built from ``shard.spark`` (else ``train.spark``)."""
    from common.dataset import read_manifest
    from common.storage import resolve
    from common.writer_lock import output_lock

    _check_paths(cfg)
    needs_spark = cfg.shard is not None or cfg.train.launch.mode == "spark"
    if needs_spark and spark is None:
        from common.spark import get_or_create_session
        from training.api import session_for

        spark = get_or_create_session(session_for((cfg.shard or cfg.train).spark, cfg.train.launch))
    if needs_spark and cfg.train.launch.mode == "spark":
        _check_slots(cfg, spark)  # before a shard job runs for nothing
    train_cfg = copy.deepcopy(cfg.train)
    if cfg.shard is not None:
        from pipelines.shard_job import run_shard_job
        from shardtrain.teacher import teacher_scorer

        train_cfg.data.path = run_shard_job(spark, cfg.shard, teacher_scorer()).uri
    manifest = read_manifest(train_cfg.data.path)
    _check_objective(cfg, manifest.label.task)
    fingerprint = study_fingerprint(cfg, manifest.fingerprint)
    study_name = cfg.sweep.study_name or f"shardtrain-sweep-{fingerprint}"
    _check_model_path(cfg, fingerprint)
    with output_lock(resolve(cfg.output.path).uri):
        _claim_directory(cfg, fingerprint, study_name)
        storage, where = study_storage(cfg)
        study = _study(cfg, storage, study_name)
        tracker = _Tracker.start(cfg, fingerprint, study_name)
        runner = _Runner(cfg, train_cfg, study, storage, spark, tracker)
        runner.run()
        records = trial_records(study, cfg)
        best = _best(records, cfg.sweep.objective.direction == "maximize")
        report = write_sweep_report(resolve(cfg.output.path).join(REPORT).uri, f"shardtrain sweep: {study_name}",
                                    _overview(cfg, study_name, fingerprint, where, records, best),
                                    cfg.sweep.objective.metric, cfg.sweep.objective.direction == "maximize", records,
                                    dump_yaml(cfg))
        model_uri = _publish_best(cfg, best, fingerprint, study_name) if best else None
        tracker.finish(records, best, report)
    result = SweepResult(study_name=study_name, fingerprint=fingerprint, storage=where, trials=records, best=best,
                         model_uri=model_uri, report_uri=report, ran=sorted(runner.ran))
    if best is None:
        raise _no_trial_finished(study.get_trials(deepcopy=False), cfg.sweep.retries, report)
    return result


# --- checks before anything runs ---------------------------------------------------------------

def _check_paths(cfg: SweepConfig) -> None:
    from common.output_guard import check_disjoint
    from common.storage import check_uri
    from training.api import check_outputs

    uris = [cfg.output.path, cfg.output.model_path, *([] if cfg.shard is None else cfg.shard.uris)]
    if cfg.shard is None:
        uris.append(cfg.train.data.path)
    for uri in uris:
        check_uri(uri)
    inputs = {"the training dataset (train.data.path)": cfg.train.data.path}
    if cfg.shard is not None:
        inputs.update({f"shard source {name!r} (shard.sources.{name}.path)": src.path
                       for name, src in cfg.shard.sources.items()})
    check_disjoint(cfg.output.path, "output.path", inputs)
    check_disjoint(cfg.output.model_path, "output.model_path",
                   {**inputs, "the sweep directory (output.path), which holds the trials,": cfg.output.path})
    # Each trial's outputs, as training checks them (a probe trial: the paths differ only by number).
    probe = trial_config(cfg.train, {}, output=_trial_output(cfg, 0))
    check_outputs(probe, inputs)
    study_storage(cfg, probe_only=True)  # object storage without a URL: exit 2 now


def _check_model_path(cfg: SweepConfig, fingerprint: str) -> None:
    """With output.mode=error, output.model_path may hold only this study's own best model."""
    from common.commit_marker import KIND_MODEL
    from common.output_guard import check_replaceable
    from common.storage import resolve

    if cfg.output.mode == "error" and resolve(cfg.output.model_path).exists():
        published = _published_sweep(cfg)
        if published is None or published.get("fingerprint") != fingerprint:
            raise OutputExistsError(f"{cfg.output.model_path} already exists (output.model_path) and is not this "
                                    "sweep's best model; set output.mode=overwrite to replace it")
    check_replaceable(resolve(cfg.output.model_path).uri, KIND_MODEL)


def _check_slots(cfg: SweepConfig, spark) -> None:
    from training.api import task_slots

    known = task_slots(spark)
    need = cfg.sweep.parallel_trials * cfg.train.launch.num_proc
    if known and need > known[2]:
        master, task_cpus, slots = known
        raise ConfigError(f"sweep.parallel_trials={cfg.sweep.parallel_trials} x train.launch.num_proc="
                          f"{cfg.train.launch.num_proc} needs {need} concurrent Spark tasks, but master {master} with "
                          f"spark.task.cpus={task_cpus} runs {slots}; lower sweep.parallel_trials or "
                          f"train.launch.num_proc, or give the application more task slots")
    if not known:
        log.info("this Spark master's task slots cannot be counted up front; %d trial(s) x %d rank(s) need %d at once",
                 cfg.sweep.parallel_trials, cfg.train.launch.num_proc, need)


def _check_objective(cfg: SweepConfig, task: str) -> None:
    metric = cfg.sweep.objective.metric
    wrong = {"val_accuracy": "regression", "val_mae": "classification"}.get(metric)
    if wrong == task:
        other = "val_mae" if metric == "val_accuracy" else "val_accuracy"
        raise ConfigError(f"sweep.objective.metric: {metric} is not reported for a {task} label; use {other} or "
                          "val_loss")


def study_fingerprint(cfg: SweepConfig, dataset_fingerprint: str) -> str:
    """What makes two runs of a sweep the same study: the dataset, every trial's config before its
    draw, the space, the objective, the pruner and the seed (not how many trials, nor how many at once)."""
    base = to_dict(cfg.train)
    for key in ("output", "spark", "tracking"):
        base.pop(key, None)
    base["data"].pop("path", None)
    s = cfg.sweep
    return config_fingerprint({"dataset": dataset_fingerprint, "train": base, "space": to_dict(s.space),
                               "objective": to_dict(s.objective), "pruner": to_dict(s.pruner), "seed": s.seed})


def study_storage(cfg: SweepConfig, probe_only: bool = False):
    """(Optuna storage, where in words): an RDB URL as given; else a journal file (sweep.storage,
    or output.path/study.journal), which must be on a local path or a volume (a journal is
    appended under a file lock: object storage has neither)."""
    from common.storage import resolve

    url = cfg.sweep.storage
    if url is not None and _RDB_URL.match(url):
        _check_sqlite_directory(url)
        if probe_only:
            return None, url
        return _rdb_storage(url), _redacted(url)
    if url is not None:
        key, path = "sweep.storage", url
    else:
        key, path = "output.path", f"{cfg.output.path.rstrip('/')}/{JOURNAL}"
    try:
        loc = resolve(path)
    except StorageError as exc:
        raise ConfigError(f"sweep.storage: {exc}") from None
    if loc.scheme != "file":
        raise ConfigError(f"sweep.storage: the study's journal would be {loc.uri} ({key}), on object storage, where a "
                          "journal file cannot be appended safely; set sweep.storage to an Optuna RDB URL "
                          "(postgresql://..., mysql://..., sqlite:///path/on/a/local/disk.db)")
    if probe_only:
        return None, loc.path
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    os.makedirs(os.path.dirname(loc.path) or ".", exist_ok=True)
    # The open-lock (O_EXCL on a lock file) works on volumes that have no symlinks (Databricks /Volumes, /dbfs).
    backend = JournalFileBackend(loc.path, lock_obj=JournalFileOpenLock(loc.path))
    return optuna.storages.JournalStorage(backend), loc.path


def _check_sqlite_directory(url: str) -> None:
    """SQLite creates its database file, not the file's directory; SQLAlchemy would say only
    "unable to open database file", in a traceback, once the study is opened."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number
        raise ConfigError(f"sweep.storage: {_redacted(url)} is not a database URL: {first_line(exc)}") from None
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return
    directory = os.path.dirname(os.path.abspath(parsed.database))
    if not os.path.isdir(directory):
        raise ConfigError(f"sweep.storage: the directory {directory} of the SQLite database {parsed.database} does "
                          "not exist; create it, or name a database file in an existing directory")


def _rdb_storage(url: str):
    """Optuna's storage on the database at ``url``, or one line naming sweep.storage: a missing
    driver is exit 2 (install it), a database that cannot be reached exit 1 (it may come back)."""
    import optuna

    try:
        return optuna.storages.RDBStorage(url)
    except ImportError as exc:
        raise ConfigError(f"sweep.storage: {_redacted(url)}: {first_line(exc)} (install the database's Python "
                          "driver)") from None
    except Exception as exc:  # noqa: BLE001 - SQLAlchemy's errors, any driver's: one line, not a traceback
        raise StorageIOError(f"sweep.storage: cannot open the study's database {_redacted(url)}: "
                             f"{type(exc).__name__}: {first_line(exc)}") from None


def _redacted(url: str) -> str:
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


def _claim_directory(cfg: SweepConfig, fingerprint: str, study_name: str) -> None:
    """output.path belongs to one study: its sweep.json says which; another study's is refused."""
    from common.storage import resolve

    root = resolve(cfg.output.path)
    if root.fs.exists(root.join(RECORD).path):
        record = json.loads(root.read_text(RECORD))
        if record.get("fingerprint") != fingerprint or record.get("study_name") != study_name:
            raise ConfigError(f"output.path {root.uri} holds the sweep of another study ({record.get('study_name')}, "
                              f"fingerprint {record.get('fingerprint')}; this config's is {fingerprint}: the dataset, "
                              "the train section, the space, the objective, the pruner or the seed differ); choose "
                              "another output.path, or restore the config that study ran with")
        return
    root.fs.makedirs(root.path, exist_ok=True)
    root.write_text(RECORD, json.dumps({"fingerprint": fingerprint, "study_name": study_name,
                                        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2))


# --- the study and its trials ------------------------------------------------------------------

def _study(cfg: SweepConfig, storage, study_name: str):
    import optuna

    from shardtrain.sweep_sampler import TrialSeededSampler

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep logs its own lines
    s = cfg.sweep
    # Not TPESampler(seed=s.seed): its one stream would start over on every rerun of the sweep and
    # draw the finished trials' values again (see shardtrain.sweep_sampler).
    study = optuna.create_study(storage=storage, study_name=study_name, direction=s.objective.direction,
                                sampler=TrialSeededSampler(s.seed), pruner=_pruner(s.pruner), load_if_exists=True)
    if s.enqueue and not study.user_attrs.get("enqueued"):
        # The study's first trials, in order (twice the same values is two trials); once: a rerun
        # finds the flag, and a run killed while enqueueing adds only the ones still missing.
        for params in s.enqueue[len(study.get_trials(deepcopy=False)):]:
            study.enqueue_trial(optuna_params(params, s.space))
        study.set_user_attr("enqueued", True)
    return study


def _pruner(p: PrunerConfig):
    import optuna

    if p.type == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=p.startup_trials, n_warmup_steps=p.warmup_epochs)
    if p.type == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=p.min_epochs, reduction_factor=p.reduction_factor)
    if p.type == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=p.min_epochs, reduction_factor=p.reduction_factor)
    return optuna.pruners.NopPruner()


def _trial_dir(cfg: SweepConfig, number: int) -> str:
    return f"{cfg.output.path.rstrip('/')}/trials/{number:04d}"


def _trial_output(cfg: SweepConfig, number: int) -> dict:
    # The same directory on every run of the sweep: a resumed trial's training finds its checkpoints there.
    return {"model_path": f"{_trial_dir(cfg, number)}/model", "mode": "overwrite", "run_dir": None}


class _Runner:
    """Runs the study's remaining trials, ``parallel_trials`` at a time (threads of the driver,
    each one training launch at a time)."""

    def __init__(self, cfg: SweepConfig, train_cfg: TrainConfig, study, storage, spark, tracker: "_Tracker"):
        self.cfg, self.train_cfg, self.study, self.storage = cfg, train_cfg, study, storage
        self.spark, self.tracker = spark, tracker
        self.lock = threading.Lock()
        self.to_ask = 0  # new trials still to draw
        self.ran: list[int] = []
        self.errors: list[BaseException] = []

    def run(self) -> None:
        self._requeue_interrupted(self.study.get_trials(deepcopy=False))
        self._retry_failed(self.study.get_trials(deepcopy=False))
        finished = sum(t.state.is_finished() for t in _standing(self.study.get_trials(deepcopy=False)))
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
        retried = _superseded(trials)
        for t in trials:
            if t.number in retried or not _retryable(t, self.cfg.sweep.retries):
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
        trial.set_user_attr("run_dir", f"{_trial_dir(cfg, trial.number)}/model.run")
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
            train_cfg = trial_config(self.train_cfg, params, output=_trial_output(cfg, trial.number),
                                     tracking=self.tracker.trial_tracking(self.train_cfg, trial.number))
            result = train(train_cfg, self.spark, on_epoch=on_epoch)
        except Exception as exc:  # noqa: BLE001 - a trial's failure is recorded; the sweep goes on
            error = f"{type(exc).__name__}: {first_line(exc)}"
            trial.set_user_attr("error", error)
            # Its class decides whether a rerun tries it again (_retryable), as for a command's exit status.
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


def _superseded(trials) -> set[int]:
    """Failed trials that a later trial retries: the retry stands in for them."""
    return {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}


def _standing(trials) -> list:
    """The study's trials less those a retry stands in for: what sweep.trials counts."""
    superseded = _superseded(trials)
    return [t for t in trials if t.number not in superseded]


def _retryable(trial, retries: int) -> bool:
    """A failed trial a rerun runs again: its failure may pass (exit-1 class; a trial failed before
    the class was recorded counts as one), and it has tries left."""
    return (trial.state.name == "FAIL" and trial.user_attrs.get("exit_code", EXIT_RUNTIME) == EXIT_RUNTIME
            and trial.user_attrs.get("attempt", 1) <= retries)


def _no_trial_finished(trials, retries: int, report: str) -> ShardtrainError:
    """Exit 1 while a rerun would run a trial (a retry, a waiting trial); else exit 2: every trial
    ended for good (refused as bad config, or failed again after its retries), so rerunning the
    same command cannot help, and a scheduler must not retry it without end."""
    standing = _standing(trials)
    errors = "; ".join(f"trial {t.number}: {t.user_attrs['error']}" for t in standing
                       if t.user_attrs.get("error")) or "none finished"
    if any(not t.state.is_finished() or _retryable(t, retries) for t in standing):
        return TrainingError(f"no trial of the sweep finished ({errors}); see {report}")
    return ConfigError(f"no trial of the sweep finished, and a rerun would run none: {errors} (a trial refused by the "
                       f"training config or the dataset runs once; one that failed otherwise runs again, "
                       f"sweep.retries={retries} time(s)); change sweep.space or the train section; see {report}")


def trial_records(study, cfg: SweepConfig) -> list[TrialRecord]:
    records = []
    for t in study.get_trials(deepcopy=False):
        value = t.value if t.value is not None else (t.intermediate_values[max(t.intermediate_values)]
                                                     if t.intermediate_values else None)
        records.append(TrialRecord(number=t.number, state=t.state.name, value=value,
                                   params=decode_params(t.params, cfg.sweep.space),
                                   epochs=t.user_attrs.get("epochs"), run_dir=t.user_attrs.get("run_dir"),
                                   error=t.user_attrs.get("error"), intermediate=dict(t.intermediate_values)))
    return records


def _best(records: list[TrialRecord], maximize: bool) -> TrialRecord | None:
    complete = [t for t in records if t.state == "COMPLETE" and t.value is not None]
    if not complete:
        return None
    # Ties go to the earlier trial, as Optuna's best_trial does.
    return sorted(complete, key=lambda t: ((-t.value if maximize else t.value), t.number))[0]


def _overview(cfg, study_name, fingerprint, where, records, best) -> list[tuple[str, object]]:
    counts = {state: sum(t.state == state for t in records) for state in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")}
    return [("study", study_name), ("study fingerprint", fingerprint), ("storage", where),
            ("dataset", cfg.train.data.path), ("objective", f"{cfg.sweep.objective.direction} "
                                                            f"{cfg.sweep.objective.metric}"),
            ("pruner", cfg.sweep.pruner.type), ("trials", f"{len(records)} of {cfg.sweep.trials}: "
                                                          f"{counts['COMPLETE']} finished, {counts['PRUNED']} pruned, "
                                                          f"{counts['FAIL']} failed"),
            ("best trial", f"{best.number}: {best.value:.6g}" if best else "none finished"),
            ("best model", cfg.output.model_path if best else "not published")]


# --- the result --------------------------------------------------------------------------------

def _published_sweep(cfg: SweepConfig) -> dict | None:
    """The sweep record of the model at output.model_path, if a sweep published it."""
    from common.commit_marker import is_committed
    from common.publish import read_marker
    from common.storage import resolve

    loc = resolve(cfg.output.model_path)
    if not is_committed(loc):
        return None
    return read_marker(loc).get("sweep")


def _publish_best(cfg: SweepConfig, best: TrialRecord, fingerprint: str, study_name: str) -> str:
    """The best trial's model at output.model_path, atomically: its files, its marker plus the
    study, and sweep.json. Already there (a rerun of a finished sweep): nothing to do."""
    from common.publish import publish, read_marker
    from common.storage import resolve, storage_errors

    mine = {"study_name": study_name, "fingerprint": fingerprint, "trial": best.number}
    published = _published_sweep(cfg)
    if published == mine:
        log.info("the best model (trial %d) is already published at %s", best.number, cfg.output.model_path)
        return cfg.output.model_path
    source = resolve(f"{_trial_dir(cfg, best.number)}/model")
    marker = {k: v for k, v in read_marker(source).items() if k != "committed_at"}
    mode = "overwrite" if published is not None and published.get("fingerprint") == fingerprint else cfg.output.mode
    record = {"study_name": study_name, "fingerprint": fingerprint, "trial": best.number, "params": best.params,
              "objective": {"metric": cfg.sweep.objective.metric, "direction": cfg.sweep.objective.direction,
                            "value": best.value},
              "source": source.uri, "sweep_config": to_dict(cfg)}
    with publish(cfg.output.model_path, mode=mode, marker={**marker, "sweep": mine}) as staging:
        for name in sorted(source.fs.ls(source.path, detail=False)):
            base = name.rstrip("/").rsplit("/", 1)[-1]
            if base.startswith("_") or source.fs.isdir(name):
                continue  # the marker is written by the commit
            with storage_errors(f"copying {base}", source.uri):
                data = source.fs.cat_file(name)
                with staging.open(base, "wb") as fh:
                    fh.write(data)
        staging.write_text(RECORD, json.dumps(record, indent=2, sort_keys=True, default=str))
    log.info("best trial %d (%s %.6g) published at %s", best.number, cfg.sweep.objective.metric, best.value,
             cfg.output.model_path)
    return cfg.output.model_path


class _Tracker:
    """With train.tracking.mlflow: the sweep's parent MLflow run (its id kept in output.path's
    sweep.json, so a rerun goes on with it); each trial's own run (training's tracking) becomes a
    child through the mlflow.parentRunId tag, and a failed trial gets a child run from here.
    Like training's tracking, it warns and never fails the sweep."""

    def __init__(self, cfg: SweepConfig, client=None, parent: str | None = None):
        self.cfg, self.client, self.parent = cfg, client, parent

    @classmethod
    def start(cls, cfg: SweepConfig, fingerprint: str, study_name: str) -> "_Tracker":
        mlflow_cfg = cfg.train.tracking.mlflow
        if mlflow_cfg is None:
            return cls(cfg)
        from common.storage import resolve

        root = resolve(cfg.output.path)
        record = json.loads(root.read_text(RECORD))
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=mlflow_cfg.tracking_uri)
            parent = record.get("mlflow_parent_run")
            if parent is None:
                name = mlflow_cfg.experiment
                experiment = (client.get_experiment_by_name(name) or None) if name else None
                experiment_id = (experiment.experiment_id if experiment else client.create_experiment(name)) if name \
                    else "0"
                run = client.create_run(experiment_id, run_name=mlflow_cfg.run_name or study_name,
                                        tags={"study_fingerprint": fingerprint, "study_name": study_name})
                parent = run.info.run_id
                for key, spec in cfg.sweep.space.items():
                    client.log_param(parent, f"space.{key}", json.dumps(to_dict(spec)))
                root.write_text(RECORD, json.dumps({**record, "mlflow_parent_run": parent}, indent=2))
            log.info("MLflow parent run %s (each trial a child run)", parent)
            return cls(cfg, client, parent)
        except Exception as exc:  # noqa: BLE001 - tracking never fails the sweep
            log.warning("MLflow tracking of the sweep skipped, the trials still run: %s: %s", type(exc).__name__,
                        first_line(exc))
            return cls(cfg)

    def trial_tracking(self, train_cfg: TrainConfig, number: int) -> dict:
        tracking = to_dict(train_cfg.tracking)
        if tracking.get("mlflow") is not None and self.parent:
            tracking["mlflow"]["tags"] = {**tracking["mlflow"].get("tags", {}), "mlflow.parentRunId": self.parent,
                                          "sweep_trial": str(number)}
            tracking["mlflow"]["run_name"] = f"trial {number}"
        return tracking

    def failed_trial(self, number: int, params: dict, error: str) -> None:
        if not self.parent:
            return
        try:
            parent = self.client.get_run(self.parent)
            run = self.client.create_run(parent.info.experiment_id, run_name=f"trial {number}",
                                         tags={"mlflow.parentRunId": self.parent, "sweep_trial": str(number),
                                               "error": error[:5000]})
            for key, value in params.items():
                self.client.log_param(run.info.run_id, key, json.dumps(value) if isinstance(value, (list, dict))
                                      else value)
            self.client.set_terminated(run.info.run_id, status="FAILED")
        except Exception as exc:  # noqa: BLE001 - see the class docstring
            log.warning("MLflow: trial %d's failure was not recorded: %s", number, first_line(exc))

    def finish(self, records: list[TrialRecord], best: TrialRecord | None, report: str) -> None:
        if not self.parent:
            return
        try:
            metric = self.cfg.sweep.objective.metric
            if best is not None:
                self.client.log_metric(self.parent, f"best_{metric}", best.value)
                self.client.set_tag(self.parent, "best_trial", str(best.number))
            self.client.log_metric(self.parent, "trials_finished", sum(t.state == "COMPLETE" for t in records))
            self.client.log_artifact(self.parent, report)
            self.client.set_terminated(self.parent, status="FINISHED" if best is not None else "FAILED")
        except Exception as exc:  # noqa: BLE001 - see the class docstring
            log.warning("MLflow: the sweep's parent run was not completed: %s", first_line(exc))


def handle_sweep(args) -> int:
    result = sweep(load_sweep_config(args.config, args.overrides))
    print(result.summary())
    return 0


__all__ = ["ObjectiveConfig", "PrunerConfig", "SweepConfig", "SweepOutputConfig", "SweepResult", "SweepSection",
           "handle_sweep", "load_sweep_config", "study_fingerprint", "study_storage", "sweep", "trial_records"]
