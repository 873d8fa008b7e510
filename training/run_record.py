"""What a training run directory records, and reading it back for the run report and tracking.

Beside ``checkpoints/``, a run directory (``output.run_dir``) holds:

- ``config.yaml``     the resolved training config (rank 0, at start)
- ``run.json``        the run's identity: dataset URI and fingerprint, world size, steps per epoch,
                      samples per step, model path, backend (rank 0, at start)
- ``metrics.jsonl``   one record per finished epoch (rank 0, after each epoch)
- ``steps.jsonl``     one record per logged step (``train.log_every_steps``): loss, steps/s,
                      samples/s, data-wait and allreduce-wait fractions (rank 0, after each epoch)
- ``restarts.jsonl``  one record per relaunch of the ranks by the supervisor (the driver)
- ``summary.json``    the driver's summary once every rank finished (training.api)
- ``report.html``     the run report (training.report), from the files above except summary.json,
                      which is written after it

Every file is rewritten whole, never appended to: object stores have no append. Readers here
need only ``metrics.jsonl``; a run directory from before a file existed reads as not having it.
"""

from __future__ import annotations

import datetime
import json
import logging
from dataclasses import dataclass, field

import yaml

from common.config import parse_yaml
from common.errors import RunDirError, StorageError, first_line
from common.storage import Location, resolve

log = logging.getLogger("shardtrain.train")

CONFIG, RUN_INFO, METRICS, STEPS, RESTARTS = "config.yaml", "run.json", "metrics.jsonl", "steps.jsonl", "restarts.jsonl"
SUMMARY, REPORT = "summary.json", "report.html"
# The numbers each record of a .jsonl file must carry for the report to read it (training writes them all).
REQUIRED_FIELDS = {METRICS: ("epoch", "train_loss"),
                   STEPS: ("step", "epoch", "loss", "steps_per_s", "samples_per_s", "data_wait_fraction",
                           "allreduce_wait_fraction"),
                   RESTARTS: ()}


# --- writing (rank 0 and the driver) -----------------------------------------------------------

def write_run_info(plan) -> None:
    """``run.json`` for a ``RankPlan``: what a report needs that the config alone does not say."""
    t = plan.config.train
    info = {"dataset_uri": plan.dataset_uri, "fingerprint": plan.fingerprint, "world_size": plan.world_size,
            "steps_per_epoch": plan.steps_per_epoch, "samples_per_step": plan.world_size * t.batch_size * t.grad_accum,
            "epochs": t.epochs, "model_path": plan.model_path, "backend": plan.config.launch.backend,
            "mode": plan.config.launch.mode}
    resolve(plan.run_dir).write_text(RUN_INFO, json.dumps(info, indent=2, sort_keys=True))


def write_steps(run_dir: str, records: list[dict], after_step: int) -> None:
    """``steps.jsonl`` = its records up to ``after_step`` (earlier launches of this run) + ``records``."""
    run = resolve(run_dir)
    kept = [r for r in _read_jsonl(run, STEPS) if r["step"] <= after_step]
    run.write_text(STEPS, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept + records))


def record_restart(run_dir: str, restart: int, max_restarts: int, reason: str) -> None:
    """One line in ``restarts.jsonl``; the driver calls it before relaunching the ranks. A failure
    to write it warns: the relaunch matters more than its record."""
    try:
        run = resolve(run_dir)
        records = _read_jsonl(run, RESTARTS)
        records.append({"restart": restart, "max_restarts": max_restarts, "reason": reason,
                        "at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
        run.write_text(RESTARTS, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    except (StorageError, RunDirError, OSError) as exc:
        log.warning("restart %d was not recorded in %s/%s: %s", restart, run_dir, RESTARTS, first_line(exc))


# --- reading -----------------------------------------------------------------------------------

@dataclass
class RunRecord:
    """A run directory read back: every file above that is there (``epochs`` always is)."""

    uri: str
    epochs: list[dict]  # metrics.jsonl
    config: dict = field(default_factory=dict)
    config_text: str = ""
    info: dict = field(default_factory=dict)  # run.json
    steps: list[dict] = field(default_factory=list)
    restarts: list[dict] = field(default_factory=list)
    checkpoints: list[tuple[str, bool]] = field(default_factory=list)  # (name, committed)
    model_meta: dict | None = None  # the published model's model.json, when it is there

    @property
    def fingerprint(self) -> str | None:
        return self.info.get("fingerprint") or ((self.model_meta or {}).get("dataset") or {}).get("fingerprint")

    @property
    def dataset_uri(self) -> str | None:
        return self.info.get("dataset_uri") or self.config.get("data", {}).get("path")

    @property
    def world_size(self) -> int | None:
        return self.info.get("world_size") or self.config.get("launch", {}).get("num_proc")

    @property
    def samples_per_step(self) -> int | None:
        if "samples_per_step" in self.info:
            return self.info["samples_per_step"]
        t = self.config.get("train", {})
        return self.world_size * t["batch_size"] * t["grad_accum"] if self.world_size and "batch_size" in t else None

    @property
    def model_path(self) -> str | None:
        return self.info.get("model_path") or self.config.get("output", {}).get("model_path")


def epoch_rates(record: dict, samples_per_step: int | None) -> dict:
    """An epoch record's throughput and time split: samples/s, steps/s, and the fractions of the
    epoch's training time spent waiting for data and for the gradient allreduce."""
    seconds = record.get("seconds") or 0.0
    if seconds <= 0:
        return {}
    rates = {"samples_per_s": record.get("samples", 0) / seconds,
             "data_wait_fraction": record.get("data_wait_seconds", 0.0) / seconds,
             "allreduce_wait_fraction": record.get("allreduce_wait_seconds", 0.0) / seconds}
    if samples_per_step:
        rates["steps_per_s"] = rates["samples_per_s"] / samples_per_step
    return rates


def read_run(run_dir: str) -> RunRecord:
    """Read a run directory; RunDirError (exit 2) naming the path when it is missing or has no
    epoch metrics, or a file cannot be read or parsed."""
    try:
        run = resolve(run_dir)
        if not run.exists():
            raise RunDirError(f"{run.uri}: no such training run directory")
        if not run.fs.exists(run.join(METRICS).path):
            raise RunDirError(f"{run.uri}: not a training run directory with results: it has no {METRICS} "
                              "(training writes it after each epoch)")
        epochs = _read_jsonl(run, METRICS)
        if not epochs:
            raise RunDirError(f"{run.join(METRICS).uri} holds no epoch record")
        config_text = _read_optional(run, CONFIG) or ""
        record = RunRecord(uri=run.uri, epochs=epochs, config_text=config_text,
                           config=_parse(run, CONFIG, config_text, lambda text: parse_yaml(text, run.join(CONFIG).uri))
                           or {},
                           info=_parse(run, RUN_INFO, _read_optional(run, RUN_INFO), json.loads) or {},
                           steps=_read_jsonl(run, STEPS), restarts=_read_jsonl(run, RESTARTS),
                           checkpoints=_checkpoints(run))
        record.model_meta = _model_meta(record.model_path)
        return record
    except (StorageError, OSError) as exc:
        raise RunDirError(f"{run_dir}: cannot read the run directory: {exc}") from None


def _read_optional(run: Location, name: str) -> str | None:
    if not run.fs.exists(run.join(name).path):
        return None
    try:
        return run.read_text(name)
    except UnicodeDecodeError as exc:
        line = exc.object[:exc.start].count(b"\n") + 1
        raise RunDirError(f"{run.join(name).uri} line {line} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x}); "
                          "training writes UTF-8: the file was damaged or replaced") from None


def _parse(run: Location, name: str, text: str | None, parse):
    if text is None:
        return None
    try:
        return parse(text)
    except (ValueError, yaml.YAMLError) as exc:  # json's errors are ValueErrors
        raise RunDirError(f"{run.join(name).uri}: cannot be parsed: {first_line(exc)}") from None


def _read_jsonl(run: Location, name: str) -> list[dict]:
    text = _read_optional(run, name)
    records = []
    for number, line in enumerate((text or "").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise RunDirError(f"{run.join(name).uri} line {number} is not JSON: {exc}") from None
        _check_record(run.join(name).uri, number, record, REQUIRED_FIELDS[name])
        records.append(record)
    return records


def _check_record(uri: str, number: int, record, required: tuple[str, ...]) -> None:
    if not isinstance(record, dict):
        raise RunDirError(f"{uri} line {number} is not a JSON object (got a {type(record).__name__}); training "
                          "writes one object per line")
    for key in required:
        value = record.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise RunDirError(f"{uri} line {number} has no number {key!r} (got {value!r}); training writes it on "
                              "every line: the file was damaged or written by something else")


def _checkpoints(run: Location) -> list[tuple[str, bool]]:
    from common.commit_marker import MARKER

    root = run.join("checkpoints")
    if not root.exists():
        return []
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in root.fs.ls(root.path, detail=False))
    return [(name, root.fs.exists(root.join(name, MARKER).path)) for name in names if name.startswith("step-")]


def _model_meta(model_path: str | None) -> dict | None:
    # The fingerprint of a run directory written before run.json existed is in the model's model.json.
    if not model_path:
        return None
    try:
        model = resolve(model_path)
        return json.loads(model.read_text("model.json")) if model.fs.exists(model.join("model.json").path) else None
    except (StorageError, OSError, ValueError):
        return None  # the model moved or is unreadable: the report says what the run directory says


__all__ = ["CONFIG", "METRICS", "RESTARTS", "RUN_INFO", "RunRecord", "STEPS", "epoch_rates", "read_run",
           "record_restart", "write_run_info", "write_steps"]
