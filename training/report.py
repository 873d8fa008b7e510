"""The run report: ``report.html`` in a run directory, built only from the run directory's files
(training.run_record), so a finished run gets the same report at the end of training (rank 0,
after the model is published) and later from ``shardtrain report RUN_DIR``.

It shows loss and the validation metric per epoch and per logged step, throughput (steps/s,
samples/s), the data-wait and allreduce-wait fractions, world size and restarts, checkpoints,
the dataset fingerprint and the resolved config. Page layout and charts: common.html_report.
"""

from __future__ import annotations

import argparse
import logging

from common.errors import first_line
from common.html_report import Page, key_values, line_chart, paragraph, preformatted, table, write_page
from common.storage import resolve
from training.run_record import REPORT, RunRecord, epoch_rates, read_run
from training.tasks import Metric, all_metrics

log = logging.getLogger("shardtrain.train")


def write_run_report(run_dir: str, output: str | None = None) -> str:
    """Build the report of ``run_dir`` and write it (default: ``<run_dir>/report.html``); its URI."""
    record = read_run(run_dir)
    return write_page(output or resolve(record.uri).join(REPORT).uri, run_report_html(record))


def write_run_report_or_warn(run_dir: str) -> str | None:
    """For the end of training: the report's URI, or None after one warning. A report is a
    convenience; the model is already published, so nothing here may fail the run."""
    try:
        return write_run_report(run_dir)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.warning("the run report was not written to %s/%s: %s: %s", run_dir, REPORT, type(exc).__name__,
                    first_line(exc))
        return None


def run_report_html(record: RunRecord) -> str:
    page = Page(f"shardtrain run: {record.uri}")
    page.add("Run", key_values(_overview(record)))
    page.add("Per epoch", *_epoch_charts(record), _epoch_table(record))
    page.add("Per logged step", *_step_charts(record))
    page.add("Restarts", *_restarts(record))
    page.add("Checkpoints", _checkpoints(record))
    page.add("Resolved config", preformatted(record.config_text) if record.config_text
             else paragraph("config.yaml is missing from the run directory", note=True))
    return page.render()


def _overview(record: RunRecord) -> list[tuple[str, object]]:
    last = record.epochs[-1]
    rates = epoch_rates(last, record.samples_per_step)
    total = record.info.get("epochs") or record.config.get("train", {}).get("epochs")
    return [("run directory", record.uri), ("model", record.model_path), ("dataset", record.dataset_uri),
            ("dataset fingerprint", record.fingerprint), ("world size", record.world_size),
            ("launch", _launch(record)),
            ("epochs finished", f"{len(record.epochs)} of {total or '?'}"),
            ("steps per epoch", record.info.get("steps_per_epoch")), ("optimizer steps", last.get("step")),
            ("samples per step", record.samples_per_step),
            ("restarts", len(record.restarts)),
            ("last epoch: steps/s", rates.get("steps_per_s")), ("last epoch: samples/s", rates.get("samples_per_s")),
            ("last epoch: data wait", _percent(rates.get("data_wait_fraction"))),
            ("last epoch: allreduce wait", _percent(rates.get("allreduce_wait_fraction"))),
            ("seconds in training steps, all epochs", sum(e.get("seconds", 0.0) for e in record.epochs))]


def _launch(record: RunRecord) -> str:
    launch = {**record.config.get("launch", {}), **record.info}
    if launch.get("mode") == "in_process":
        return "in_process (one rank in the driver process)"
    return f"Spark tasks, backend {launch.get('backend', '?')}"


def _metrics(epochs: list[dict]) -> list[Metric]:
    """The validation metrics the epochs report: their task's (``training.tasks``), in its order."""
    return [metric for metric in all_metrics() if any(metric.key in e for e in epochs)]


def _epoch_charts(record: RunRecord) -> list[str]:
    epochs = [e["epoch"] for e in record.epochs]
    losses = {"train loss": (epochs, [e["train_loss"] for e in record.epochs])}
    with_val = [e for e in record.epochs if "val_loss" in e]
    if with_val:
        losses["validation loss"] = ([e["epoch"] for e in with_val], [e["val_loss"] for e in with_val])
    charts = [line_chart("Loss per epoch", "epoch", losses, "loss")]
    metrics = _metrics(record.epochs)
    for metric in metrics:
        name = metric.name
        scored = [e for e in record.epochs if metric.key in e]
        xs = [e["epoch"] for e in scored]
        charts.append(line_chart(f"Validation {name} per epoch", "epoch",
                                 {f"validation {name}": (xs, [e[metric.key] for e in scored]),
                                  "trivial baseline": (xs, [e[metric.baseline_key] for e in scored])}, name))
    if not metrics:
        charts.append(paragraph("No validation metric: the run had no validation split (data.val_split).", note=True))
    return charts


def _epoch_table(record: RunRecord) -> str:
    metrics = _metrics(record.epochs)
    headers = ["epoch", "step", "train loss", "val loss"]
    headers += [heading for metric in metrics for heading in (f"val {metric.name}", f"baseline {metric.name}")]
    headers += ["seconds", "steps/s", "samples/s", "data wait", "allreduce wait"]
    # Periodic synchronisation (train.sync) records its rounds, what each rank sent and the drift.
    synced = any("sync_rounds" in e for e in record.epochs)
    headers += ["sync rounds", "sync bytes/sample", "drift at sync"] if synced else []
    # Pipeline stages (train.pipeline) record each stage's measured bubble: idle share of step time.
    staged = any(e.get("pipeline_bubble_fraction") for e in record.epochs)
    headers += ["bubble per stage"] if staged else []
    rows = []
    for e in record.epochs:
        rates = epoch_rates(e, record.samples_per_step)
        row = [e["epoch"], e.get("step"), e.get("train_loss"), e.get("val_loss")]
        row += [value for metric in metrics for value in (e.get(metric.key), e.get(metric.baseline_key))]
        row += [e.get("seconds"), rates.get("steps_per_s"), rates.get("samples_per_s"),
                _percent(rates.get("data_wait_fraction")), _percent(rates.get("allreduce_wait_fraction"))]
        row += [e.get("sync_rounds"), e.get("sync_bytes_per_sample"), e.get("sync_drift")] if synced else []
        row += [" / ".join(_percent(f) or "" for f in e.get("pipeline_bubble_fraction") or [])] if staged else []
        rows.append(row)
    return table(headers, rows)


def _step_charts(record: RunRecord) -> list[str]:
    if not record.steps:
        every = record.config.get("train", {}).get("log_every_steps", "?")
        return [paragraph(f"No step was logged (rank 0 logs every train.log_every_steps={every} steps; "
                          "steps.jsonl is absent or empty).", note=True)]
    steps = [s["step"] for s in record.steps]
    charts = [line_chart("Training loss per logged step (rank 0)", "optimizer step",
                         {"loss": (steps, [s["loss"] for s in record.steps])}, "loss"),
              line_chart("Throughput per logged step", "optimizer step",
                         {"samples/s": (steps, [s["samples_per_s"] for s in record.steps])}, "samples/s"),
              line_chart("Waiting, share of wall time between logged steps", "optimizer step",
                         {"data wait": (steps, [s["data_wait_fraction"] for s in record.steps]),
                          "allreduce wait": (steps, [s["allreduce_wait_fraction"] for s in record.steps])},
                         "fraction")]
    return charts + [table(["step", "epoch", "loss", "steps/s", "samples/s", "data wait", "allreduce wait"],
                           [[s["step"], s["epoch"], s["loss"], s["steps_per_s"], s["samples_per_s"],
                             _percent(s["data_wait_fraction"]), _percent(s["allreduce_wait_fraction"])]
                            for s in record.steps])]


def _restarts(record: RunRecord) -> list[str]:
    if not record.restarts:
        return [paragraph("The ranks were never relaunched.")]
    return [table(["restart", "of launch.max_restarts", "at (UTC)", "after"],
                  [[r.get("restart"), r.get("max_restarts"), r.get("at"), r.get("reason")] for r in record.restarts])]


def _checkpoints(record: RunRecord) -> str:
    if not record.checkpoints:
        return paragraph("No checkpoint in <run_dir>/checkpoints (checkpoint.path may point elsewhere).", note=True)
    return table(["checkpoint", "complete"], [[name, "yes" if done else "no (no _COMMITTED)"]
                                              for name, done in record.checkpoints])


def _percent(fraction: float | None) -> str | None:
    return None if fraction is None else f"{100 * fraction:.1f}%"


# --- command handler (shardtrain report) ----------------------------------------------------------

def handle_report(args: argparse.Namespace) -> int:
    uri = write_run_report(args.run_dir, args.output)
    print(f"wrote {uri}")
    return 0


__all__ = ["REPORT", "handle_report", "run_report_html", "write_run_report", "write_run_report_or_warn"]
