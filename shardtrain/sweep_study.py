"""The sweep's Optuna study: what makes two runs of a sweep the same study (``study_fingerprint``),
where it lives (``study_storage``: an RDB URL, or a journal file on a local path or a volume), the
sweep directory it owns (``claim_directory``: ``output.path/sweep.json`` names the study), the
study itself with its sampler, pruner and enqueued trials (``open_study``), and its trials read
back: as plain records for the report (``trial_records``, ``best_trial``), which ones a rerun runs
again (``retryable``, ``superseded_trials``, ``standing_trials``), and the error when none finished.

Driver-only. Optuna is an optional dependency, imported where a study is opened, never at module
level; it runs no trial (shardtrain.sweep_runner) and publishes nothing (shardtrain.sweep_publish).
"""

from __future__ import annotations

import json
import os
import re
import time

from common.config import config_fingerprint, to_dict
from common.errors import (EXIT_RUNTIME, ConfigError, ShardtrainError, StorageError, StorageIOError, TrainingError,
                           first_line)
from shardtrain.sweep_config import PrunerConfig, SweepConfig
from shardtrain.sweep_report import TrialRecord
from shardtrain.sweep_space import decode_params, optuna_params

RECORD = "sweep.json"  # in output.path: the study this directory belongs to; in the published model: the trial
JOURNAL = "study.journal"
_RDB_URL = re.compile(r"^(sqlite|postgresql|postgres|mysql|mariadb|oracle|mssql)(\+\w+)?://", re.IGNORECASE)


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


def claim_directory(cfg: SweepConfig, fingerprint: str, study_name: str) -> None:
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


def open_study(cfg: SweepConfig, storage, study_name: str):
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


def superseded_trials(trials) -> set[int]:
    """Failed trials that a later trial retries: the retry stands in for them."""
    return {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}


def standing_trials(trials) -> list:
    """The study's trials less those a retry stands in for: what sweep.trials counts."""
    superseded = superseded_trials(trials)
    return [t for t in trials if t.number not in superseded]


def retryable(trial, retries: int) -> bool:
    """A failed trial a rerun runs again: its failure may pass (exit-1 class; a trial failed before
    the class was recorded counts as one), and it has tries left."""
    return (trial.state.name == "FAIL" and trial.user_attrs.get("exit_code", EXIT_RUNTIME) == EXIT_RUNTIME
            and trial.user_attrs.get("attempt", 1) <= retries)


def no_trial_finished(trials, retries: int, report: str) -> ShardtrainError:
    """Exit 1 while a rerun would run a trial (a retry, a waiting trial); else exit 2: every trial
    ended for good (refused as bad config, or failed again after its retries), so rerunning the
    same command cannot help, and a scheduler must not retry it without end."""
    standing = standing_trials(trials)
    errors = "; ".join(f"trial {t.number}: {t.user_attrs['error']}" for t in standing
                       if t.user_attrs.get("error")) or "none finished"
    if any(not t.state.is_finished() or retryable(t, retries) for t in standing):
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


def best_trial(records: list[TrialRecord], maximize: bool) -> TrialRecord | None:
    complete = [t for t in records if t.state == "COMPLETE" and t.value is not None]
    if not complete:
        return None
    # Ties go to the earlier trial, as Optuna's best_trial does.
    return sorted(complete, key=lambda t: ((-t.value if maximize else t.value), t.number))[0]


__all__ = ["JOURNAL", "RECORD", "best_trial", "claim_directory", "no_trial_finished", "open_study", "retryable",
           "standing_trials", "study_fingerprint", "study_storage", "superseded_trials", "trial_records"]
