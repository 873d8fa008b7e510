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

The config is shardtrain.sweep_config; the study, its storage and its trials read back
shardtrain.sweep_study; running the trials shardtrain.sweep_runner; publishing the best model
shardtrain.sweep_publish; the MLflow parent run shardtrain.sweep_tracking; sweep.html
shardtrain.sweep_report. This module runs them in order, after the checks that need no study.

Driver-only; it reaches training through its public API (``training.api``, ``training.config``).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass

from common.config import dump_yaml
from common.errors import ConfigError
from shardtrain.sweep_config import SweepConfig, load_sweep_config
from shardtrain.sweep_publish import check_model_path, publish_best
from shardtrain.sweep_report import REPORT, TrialRecord, write_sweep_report
from shardtrain.sweep_runner import TrialRunner, trial_output
from shardtrain.sweep_space import trial_config
from shardtrain.sweep_study import (best_trial, claim_directory, no_trial_finished, open_study, study_fingerprint,
                                    study_storage, trial_records)
from shardtrain.sweep_tracking import SweepTracker
from training.tasks import validation_metrics

log = logging.getLogger("shardtrain.sweep")


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
    check_model_path(cfg, fingerprint)
    with output_lock(resolve(cfg.output.path).uri):
        claim_directory(cfg, fingerprint, study_name)
        storage, where = study_storage(cfg)
        study = open_study(cfg, storage, study_name)
        tracker = SweepTracker.start(cfg, fingerprint, study_name)
        runner = TrialRunner(cfg, train_cfg, study, storage, spark, tracker)
        runner.run()
        records = trial_records(study, cfg)
        best = best_trial(records, cfg.sweep.objective.direction == "maximize")
        report = write_sweep_report(resolve(cfg.output.path).join(REPORT).uri, f"shardtrain sweep: {study_name}",
                                    _overview(cfg, study_name, fingerprint, where, records, best),
                                    cfg.sweep.objective.metric, cfg.sweep.objective.direction == "maximize", records,
                                    dump_yaml(cfg))
        model_uri = publish_best(cfg, best, fingerprint, study_name) if best else None
        tracker.finish(records, best, report)
    result = SweepResult(study_name=study_name, fingerprint=fingerprint, storage=where, trials=records, best=best,
                         model_uri=model_uri, report_uri=report, ran=sorted(runner.ran))
    if best is None:
        raise no_trial_finished(study.get_trials(deepcopy=False), cfg.sweep.retries, report)
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
    probe = trial_config(cfg.train, {}, output=trial_output(cfg, 0))
    check_outputs(probe, inputs)
    study_storage(cfg, probe_only=True)  # object storage without a URL: exit 2 now


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
    reported = validation_metrics(task)
    if metric not in reported:
        own = [name for name in reported if name != "val_loss"]
        raise ConfigError(f"sweep.objective.metric: {metric} is not reported for a {task} label; use "
                          f"{' or '.join(own)} or val_loss")


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


def handle_sweep(args) -> int:
    result = sweep(load_sweep_config(args.config, args.overrides))
    print(result.summary())
    return 0


__all__ = ["SweepResult", "handle_sweep", "sweep"]
