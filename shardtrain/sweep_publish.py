"""The sweep's result at ``output.model_path``: the best finished trial's model, published
atomically (its files, its marker plus the study's name, fingerprint and trial number, and
``sweep.json``: the trial, its parameters, its objective and the sweep config), and the check,
before anything runs, that the path holds nothing else this sweep would replace.

Driver-only: it copies a published model's files and knows nothing of Optuna.
"""

from __future__ import annotations

import json
import logging

from common.config import to_dict
from common.errors import OutputExistsError
from shardtrain.sweep_config import SweepConfig
from shardtrain.sweep_report import TrialRecord
from shardtrain.sweep_runner import trial_dir
from shardtrain.sweep_study import RECORD

log = logging.getLogger("shardtrain.sweep")


def check_model_path(cfg: SweepConfig, fingerprint: str) -> None:
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


def _published_sweep(cfg: SweepConfig) -> dict | None:
    """The sweep record of the model at output.model_path, if a sweep published it."""
    from common.commit_marker import is_committed
    from common.publish import read_marker
    from common.storage import resolve

    loc = resolve(cfg.output.model_path)
    if not is_committed(loc):
        return None
    return read_marker(loc).get("sweep")


def publish_best(cfg: SweepConfig, best: TrialRecord, fingerprint: str, study_name: str) -> str:
    """The best trial's model at output.model_path, atomically: its files, its marker plus the
    study, and sweep.json. Already there (a rerun of a finished sweep): nothing to do."""
    from common.publish import publish, read_marker
    from common.storage import resolve, storage_errors

    mine = {"study_name": study_name, "fingerprint": fingerprint, "trial": best.number}
    published = _published_sweep(cfg)
    if published == mine:
        log.info("the best model (trial %d) is already published at %s", best.number, cfg.output.model_path)
        return cfg.output.model_path
    source = resolve(f"{trial_dir(cfg, best.number)}/model")
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


__all__ = ["check_model_path", "publish_best"]
