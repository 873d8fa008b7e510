"""``sweep.html``: one self-contained page per sweep, from its trials as plain records: the trial
table (state, objective, parameters, epochs, run directory, error), the objective over trials
(with the best so far), and the objective against each searched parameter. Charts are
matplotlib's, embedded as PNG, as in a run's report.html (common.html_report).

It knows nothing of Optuna: ``shardtrain.sweep_study`` turns the study's trials into ``TrialRecord``s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from common.html_report import Page, key_values, line_chart, paragraph, preformatted, scatter_chart, table, write_page

REPORT = "sweep.html"


@dataclass
class TrialRecord:
    number: int
    state: str  # COMPLETE, PRUNED, FAIL, RUNNING, WAITING
    value: float | None  # the objective (a pruned trial: its last reported value)
    params: dict[str, Any]
    epochs: int | None = None  # epochs it trained
    run_dir: str | None = None
    error: str | None = None
    intermediate: dict[int, float] = field(default_factory=dict)  # epoch -> objective


def sweep_html(title: str, overview: list[tuple[str, object]], metric: str, maximize: bool,
               trials: list[TrialRecord], config_text: str) -> str:
    page = Page(title)
    page.add("Sweep", key_values(overview))
    keys = sorted({k for t in trials for k in t.params})
    page.add("Trials", table(["trial", "state", metric, "epochs", *keys, "run directory", "error"],
                             [[t.number, t.state, t.value, t.epochs, *[_show(t.params.get(k)) for k in keys],
                               t.run_dir, t.error] for t in trials]))
    scored = [t for t in trials if t.state in ("COMPLETE", "PRUNED") and t.value is not None]
    complete = [t for t in scored if t.state == "COMPLETE"]
    charts = []
    if scored:
        series = {"finished": ([t.number for t in complete], [t.value for t in complete])}
        pruned = [t for t in scored if t.state == "PRUNED"]
        if pruned:
            series["pruned (last epoch reported)"] = ([t.number for t in pruned], [t.value for t in pruned])
        charts.append(scatter_chart(f"{metric} per trial", "trial", series, metric, integer_x=True))
        if complete:
            best, xs, ys = None, [], []
            for t in complete:
                best = t.value if best is None else (max(best, t.value) if maximize else min(best, t.value))
                xs.append(t.number)
                ys.append(best)
            charts.append(line_chart(f"best {metric} so far", "trial", {"best so far": (xs, ys)}, metric))
        curves = {f"trial {t.number}": (sorted(t.intermediate), [t.intermediate[e] for e in sorted(t.intermediate)])
                  for t in scored if t.intermediate}
        if curves:
            charts.append(line_chart(f"{metric} per epoch (what the pruner saw)", "epoch", curves, metric))
    page.add("Objective over trials", *(charts or [paragraph("no trial has reported the objective yet", note=True)]))
    per_param = []
    for key in keys:
        series, xs_all = {}, []
        for state, label in (("COMPLETE", "finished"), ("PRUNED", "pruned (last epoch reported)")):
            points = [(_point(t.params[key]), t.value) for t in scored if key in t.params and t.state == state]
            if points:
                series[label] = ([x for x, _ in points], [y for _, y in points])
                xs_all += series[label][0]
        if series:
            numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs_all)
            log_x = numeric and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 100
            per_param.append(scatter_chart(f"{metric} against {key}", key, series, metric, log_x=log_x))
    page.add("Objective against each parameter", *(per_param or [paragraph("nothing to plot yet", note=True)]))
    page.add("Sweep config", preformatted(config_text))
    return page.render()


def write_sweep_report(uri: str, *args, **kwargs) -> str:
    return write_page(uri, sweep_html(*args, **kwargs))


def _point(value: Any) -> Any:
    """A parameter's value as a chart's x: numbers as they are, anything else as its text."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else str(_show(value))


def _show(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (list, dict)) else value


__all__ = ["REPORT", "TrialRecord", "sweep_html", "write_sweep_report"]
