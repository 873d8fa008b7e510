"""The tasks training knows, one module each, in one registry (``TASKS``, by ``label.task``).

Each task module (``classification``, ``regression``, ``multilabel``) owns its loss with the distillation and
transfer-set terms, its validation metrics and their names, the trivial baseline, target
scaling, and the serving head (``training.tasks.base.Task``); its label contract, what the stages
below training know of it, is its ``common.tasks.LabelTask``. The loop, the validation pass,
publishing, the run report, the API's summary, tracking and the sweep look a task up here (or
read the metric names here) and never compare a task's name. A new task is one module here and
one line in ``TASKS`` (and its ``LabelTask`` in ``common.tasks``).

Importing this does not import torch (the driver's API, the run report and the sweep read the
metric names); ``Objective`` and the task methods that compute import it when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from common.dataset import TEACHER_COLUMN, LabelSpec
from training.tasks.base import VAL_LOSS, Metric, Task
from training.tasks.classification import Classification
from training.tasks.multilabel import Multilabel
from training.tasks.regression import Regression
from training.user_code import logits_of

if TYPE_CHECKING:
    import torch

    from training.config import DistillConfig

TASKS: dict[str, Task] = {task.name: task for task in (Classification(), Regression(), Multilabel())}


def task_for(label_spec: LabelSpec) -> Task:
    """The task of a validated label (the manifest's, model.json's)."""
    return TASKS[label_spec.task]


def all_metrics() -> list[Metric]:
    """Every task's validation metrics, in registry order (a name once): what a record may hold."""
    found = {}
    for task in TASKS.values():
        for metric in task.metrics:
            found.setdefault(metric.name, metric)
    return list(found.values())


def validation_metrics(task_name: str | None = None) -> dict[str, str]:
    """``val_<name>`` -> its direction ("minimize" / "maximize"), the validation loss first: those
    of the task named (a run of it reports them every epoch), or of every task."""
    metrics = TASKS[task_name].metrics if task_name is not None else all_metrics()
    return {metric.key: metric.direction for metric in (VAL_LOSS, *metrics)}


@dataclass(frozen=True)
class Objective:
    """The training loss of one micro-batch, as a strategy's step calls it: the label's task's
    loss (its scaling included) and, with ``train.distill``, the teacher's soft targets."""

    label_spec: LabelSpec
    distill: DistillConfig | None = None
    # The user's loss(outputs, batch) (training.user_code), in place of the task's.
    custom: Callable | None = None

    def __call__(self, output, batch: dict) -> torch.Tensor:
        if self.custom is not None:
            return self.custom(output, batch)
        return task_for(self.label_spec).loss(logits_of(output), batch["label"], self.label_spec, self.distill,
                                              batch.get(TEACHER_COLUMN))


__all__ = ["Metric", "Objective", "TASKS", "Task", "all_metrics", "task_for", "validation_metrics"]
