"""Everything rank 0 writes for a run, in one place, so every kind of run writes the same outputs:
the run files (config.yaml, run.json), progress lines and steps.jsonl, metrics.jsonl, the
published model, then the run report and MLflow.

``Recorder`` exists on rank 0 only; the rank loop (``training.loop``) calls it at the run's start
(again after a Horovod elastic reset: the world size and steps changed), at logged steps, at each
epoch end and once the model is trained. Publishing runs under the driver's writer lock on the
model path. The report and tracking warn and never fail a run.

Rank-side only (imports torch).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time

import torch

from common.config import dump_yaml
from common.dataset import ROW_INDEX, TEACHER_COLUMN
from common.features import FeatureSpec
from common.model_artifact import ROW_RULES
from common.storage import resolve
from common.writer_lock import writing_under
from training.data import read_first_rows
from training.export import publish_model, published_by, serving_model
from training.model_specs import model_spec
from training.plan import RankPlan
from training.run_record import METRICS, REPORT, SUMMARY, write_run_info, write_steps
from training.split_layout import check_manifest_unchanged

log = logging.getLogger("shardtrain.train")

_NOT_INPUTS = ("label", ROW_INDEX, TEACHER_COLUMN)  # batch entries a served model is not given


class Recorder:
    """Rank 0's writer for one run (``plan``: the plan of the current world size)."""

    def __init__(self, plan: RankPlan):
        self.plan = plan
        self.progress: Progress | None = None

    def begin(self, plan: RankPlan, start_step: int) -> None:
        """The run files and the progress clock, for ``plan`` from ``start_step`` on."""
        self.plan = plan
        run = resolve(plan.run_dir)
        _forget_finished_run(run, start_step)
        run.write_text("config.yaml", dump_yaml(plan.config))
        write_run_info(plan)  # run.json follows the world size (Horovod elastic)
        self.progress = Progress(plan, start_step)

    def step(self, step: int, epoch: int, loss: float, timer) -> None:
        self.progress.log(step, epoch, loss, timer.data_wait_seconds, timer.allreduce_wait_seconds)

    def epoch_end(self, record: dict) -> None:
        """The epoch's record into metrics.jsonl, the progress lines into steps.jsonl."""
        plan = self.plan
        _append_metrics(plan, record)
        write_steps(plan.run_dir, self.progress.records, self.progress.start_step)
        log.info("epoch %d/%d: %s", record["epoch"], plan.config.train.epochs, _describe(record))

    def publish(self, model, history: list[dict], device) -> dict:
        """Reference predictions from the in-memory model, then the model published at
        ``output.model_path``; returns what the driver reports."""
        plan = self.plan
        model.eval()
        reference = None
        if plan.val:
            arrays = read_first_rows(plan.val, plan.columns, plan.reference_rows)
            example = {k: torch.from_numpy(v) for k, v in arrays.items() if k not in _NOT_INPUTS}
            with torch.no_grad():
                out = serving_model(model, plan.label_spec)({k: v.to(device) for k, v in example.items()})
            reference = {"rows": arrays["_row"].tolist(), "predictions": out.float().cpu().numpy().tolist()}
        model_cfg = plan.config.model
        arguments = model_spec(model_cfg.name).arguments(model_cfg, plan.feature_spec, plan.label_spec.to_record())
        provenance = plan.provenance()  # run_id, config, dataset
        model_record = {"name": model_cfg.name, "arguments": arguments}
        if plan.user_code is not None:  # what was given to train() in code (not stored: its names and digest)
            model_record["code"] = plan.user_code.record()
        meta = {"model": model_record, **provenance,
                "features": FeatureSpec(plan.feature_spec).spec, "label": plan.label_spec.to_record(), "metrics": history,
                ROW_RULES: {"max_category_bytes": plan.max_category_bytes},
                "inputs": FeatureSpec(plan.feature_spec).inputs()}
        # Last word before publishing: the model was trained on the dataset the plan pinned, all of it.
        check_manifest_unchanged(plan.dataset_uri, plan.fingerprint)
        for layout in filter(None, (plan.train, plan.val)):
            layout.check_unchanged()
        published = published_by(plan.model_path, provenance) is None
        if not published:
            # A relaunch after ranks failed once this run had published (resumed from the last
            # checkpoint): the model there is this run's own, so the run is finished, in either output.mode.
            log.warning("model at %s was already published by this run (run id %s, the same config and dataset) "
                        "before the ranks were relaunched; not publishing it again", plan.model_path, plan.run_id)
        else:
            with _under_writer_lock(plan):
                publish_model(plan.model_path, plan.output_mode, model, meta, plan.config.output.torchscript,
                              code=plan.user_code.payload if plan.user_code and "model" in plan.user_code.names
                              else None)
            log.info("model published at %s; metrics in %s/metrics.jsonl", plan.model_path, plan.run_dir)
        return {"model_uri": plan.model_path, "metrics": history, "reference": reference, "published": published}

    def report_and_track(self, history: list[dict]) -> None:
        """Once the model is published: the run report, then MLflow; each warns, never fails the run."""
        from training.report import write_run_report_or_warn

        plan = self.plan
        report = write_run_report_or_warn(plan.run_dir)
        if plan.config.tracking.mlflow is not None:
            from training.tracking import track_run_or_warn

            track_run_or_warn(plan, history, report)


class Progress:
    """Rank 0's progress lines: steps/s, samples/s, loss, ETA; ``records`` keeps each line's values
    (for steps.jsonl, training.run_record)."""

    def __init__(self, plan: RankPlan, start_step: int):
        t = plan.config.train
        self.samples_per_step = plan.data_parallel_size * t.batch_size * t.grad_accum
        self.total_steps, self.epochs = t.epochs * plan.steps_per_epoch, t.epochs
        self.start_step = start_step
        self.last_step, self.last_time, self.last_wait, self.last_sync = start_step, time.perf_counter(), 0.0, 0.0
        self.records: list[dict] = []

    def log(self, step: int, epoch: int, loss: float, data_wait_seconds: float = 0.0,
            allreduce_wait_seconds: float = 0.0) -> None:
        now = time.perf_counter()
        elapsed = max(now - self.last_time, 1e-9)
        rate = (step - self.last_step) / elapsed
        eta = (self.total_steps - step) / rate if rate > 0 else float("inf")
        wait = (data_wait_seconds - self.last_wait) / elapsed
        log.info("step %d/%d (epoch %d/%d) loss %.4f | %.1f steps/s, %.0f samples/s, data wait %.0f%% | ETA %s",
                 step, self.total_steps, epoch + 1, self.epochs, loss, rate, rate * self.samples_per_step,
                 100 * wait, _duration(eta))
        self.records.append({"step": step, "epoch": epoch + 1, "loss": loss, "steps_per_s": round(rate, 4),
                             "samples_per_s": round(rate * self.samples_per_step, 2),
                             "data_wait_fraction": round(wait, 4),
                             "allreduce_wait_fraction": round((allreduce_wait_seconds - self.last_sync) / elapsed, 4)})
        self.last_step, self.last_time, self.last_wait = step, now, data_wait_seconds
        self.last_sync = allreduce_wait_seconds


def _append_metrics(plan: RankPlan, record: dict) -> None:
    # Rewritten whole each epoch: object stores have no append, and the file stays small.
    run = resolve(plan.run_dir)
    lines = run.read_text(METRICS).splitlines() if run.fs.exists(run.join(METRICS).path) else []
    lines = [line for line in lines if line.strip() and json.loads(line).get("epoch") < record["epoch"]]
    lines.append(json.dumps(record, sort_keys=True))
    run.write_text(METRICS, "\n".join(lines) + "\n")


def _forget_finished_run(run, start_step: int) -> None:
    """Before this run writes its config.yaml: the files of a run that finished in this run
    directory before (its summary and report; its metrics too where this run starts from step 0,
    resuming nothing), so a run that fails before its end never leaves its config beside another
    run's results."""
    stale = [SUMMARY, REPORT] + ([METRICS] if start_step == 0 else [])
    for name in stale:
        path = run.join(name).path
        if run.fs.isfile(path):  # only the files a run writes; anything else there is not ours to remove
            run.fs.rm_file(path)


def _under_writer_lock(plan: RankPlan):
    """The driver's writer lock on the model path, for this rank's publish (training.api says why)."""
    if plan.writer_lock is None:  # a plan made without train() (tests of the loop itself)
        return contextlib.nullcontext()
    return writing_under(plan.model_path, plan.writer_lock)


def _describe(record: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items() if k != "epoch")


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


__all__ = ["Progress", "Recorder"]
