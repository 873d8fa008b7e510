"""The sweep in MLflow (with ``train.tracking.mlflow``): ``SweepTracker``, the study's parent run,
its trials as child runs, and the parent run's end (the best trial, the number finished,
``sweep.html``).

Driver-only; MLflow is imported only where the parent run starts, and tracking never fails the sweep.
"""

from __future__ import annotations

import json
import logging

from common.config import to_dict
from common.errors import first_line
from shardtrain.sweep_config import SweepConfig
from shardtrain.sweep_report import TrialRecord
from shardtrain.sweep_study import RECORD
from training.config import TrainConfig

log = logging.getLogger("shardtrain.sweep")


class SweepTracker:
    """With train.tracking.mlflow: the sweep's parent MLflow run (its id kept in output.path's
    sweep.json, so a rerun goes on with it); each trial's own run (training's tracking) becomes a
    child through the mlflow.parentRunId tag, and a failed trial gets a child run from here.
    Like training's tracking, it warns and never fails the sweep."""

    def __init__(self, cfg: SweepConfig, client=None, parent: str | None = None):
        self.cfg, self.client, self.parent = cfg, client, parent

    @classmethod
    def start(cls, cfg: SweepConfig, fingerprint: str, study_name: str) -> "SweepTracker":
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


__all__ = ["SweepTracker"]
