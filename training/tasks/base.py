"""What a task is to training (``Task``) and to its readers (``Metric``): the base of the task
modules in ``training.tasks``.

A task owns its loss (the label term, the transfer-set mask, the distillation term), its
validation metrics and their names, the trivial baseline they are compared with, the scaling its
targets are trained at, and the serving head (what the published program makes of the network's
output). The loss mix, ``Task.loss``, is one for all tasks: Hinton et al.'s
alpha * soft + (1 - alpha) * hard, in float32 whatever the autocast dtype (a bf16/fp16
log-softmax loses the small probabilities the teacher term is about).

Importing this (and the task modules) does not import torch: the run report, the driver's API
and the sweep read metric names from here. torch is imported by the methods that compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.dataset import LabelSpec
from common.tasks import LabelTask

if TYPE_CHECKING:
    import torch

    from training.config import DistillConfig


@dataclass(frozen=True)
class Metric:
    """A validation metric: every epoch with a val split reports ``val_<name>`` (on the val rows)
    and ``baseline_<name>`` (the task's trivial baseline on the same rows)."""

    name: str
    direction: str  # "maximize" or "minimize": which way is better (a sweep's default direction)

    @property
    def key(self) -> str:
        return f"val_{self.name}"

    @property
    def baseline_key(self) -> str:
        return f"baseline_{self.name}"

    @property
    def better(self) -> str:
        return "higher" if self.direction == "maximize" else "lower"


VAL_LOSS = Metric("loss", "minimize")  # every task's: the loss on the val rows (no baseline)


class Task:
    """One task (``label.task``). A subclass sets ``label`` (its contract, ``common.tasks``) and
    ``metrics``, and defines the methods that raise here."""

    label: LabelTask
    metrics: tuple[Metric, ...]

    @property
    def name(self) -> str:
        return self.label.name

    # --- the loss -------------------------------------------------------------------------------

    def loss(self, output: torch.Tensor, label: torch.Tensor, label_spec: LabelSpec,
             distill: DistillConfig | None = None, teacher: torch.Tensor | None = None) -> torch.Tensor:
        """The training loss of one micro-batch. With ``distill``: alpha * the teacher term
        (``teacher_loss``) + (1 - alpha) * the label term.

        A dataset with transfer rows (``label_spec.transfer_rows``: train rows without a label,
        whose label column holds the task's ``missing_label``) takes the label term from
        ``masked_label_loss``: the sum of the labelled rows' losses over all B rows of the batch,
        so a transfer row adds exactly zero to it and every row keeps the weight 1/B in both terms
        (a batch of transfer rows only: the teacher term alone). The marker never enters the
        loss as a label."""
        output = output.float()
        term = self.masked_label_loss if label_spec.transfer_rows else self.label_loss
        hard = term(output, label, label_spec)
        if distill is None:
            return hard
        return distill.alpha * self.teacher_loss(output, teacher, label_spec, distill) + (1 - distill.alpha) * hard

    def label_loss(self, output: torch.Tensor, label: torch.Tensor, label_spec: LabelSpec) -> torch.Tensor:
        """The mean label loss over the batch's rows (every row labelled)."""
        raise NotImplementedError

    def masked_label_loss(self, output: torch.Tensor, label: torch.Tensor, label_spec: LabelSpec) -> torch.Tensor:
        """The labelled rows' summed label loss over all rows (``batch_rows``); see ``loss``."""
        raise NotImplementedError

    def teacher_loss(self, output: torch.Tensor, teacher: torch.Tensor, label_spec: LabelSpec,
                     distill: DistillConfig) -> torch.Tensor:
        """The distillation term, against the teacher's stored soft targets."""
        raise NotImplementedError

    # --- targets, baseline, serving ---------------------------------------------------------------

    def target_scaling(self, label_spec: LabelSpec) -> tuple[float, float]:
        """(mean, std) the network's output is trained at: output * std + mean is the label's scale."""
        return 0.0, 1.0

    def baseline(self, label_spec: LabelSpec):
        """The trivial baseline's prediction for every row, from the train split's statistics."""
        raise NotImplementedError

    def serving_arguments(self, label_spec: LabelSpec) -> dict:
        """What the published program does to the network's output: ``training.export.ServingModel``'s
        arguments. One class serves classification and regression, with the code every program
        published before holds; a task whose output it cannot express has a serving module of its
        own (``serving_module``)."""
        raise NotImplementedError

    def serving_module(self, net, label_spec: LabelSpec):
        """``net`` as published and served, where the task has a serving module of its own (an
        ``nn.Module`` taking the batch dict; its ``.net`` is the network); None: served by
        ``training.export.ServingModel`` with ``serving_arguments``."""
        return None

    # --- validation metrics ------------------------------------------------------------------------

    def metric_sums(self, label_spec: LabelSpec) -> int:
        """How many float64 sums ``add_metric_sums`` accumulates (reduced over ranks once, at the end)."""
        return 2 * len(self.metrics)

    def add_metric_sums(self, sums: torch.Tensor, output: torch.Tensor, label: torch.Tensor,
                        label_spec: LabelSpec) -> None:
        """Add one validation batch's sums into ``sums`` (``metric_sums`` float64 values)."""
        raise NotImplementedError

    def metric_values(self, sums: list[float], rows: float, label_spec: LabelSpec) -> dict:
        """The metrics of the summed ``sums`` over ``rows`` val rows: by default, for each metric,
        ``val_<name>`` then ``baseline_<name>``, each a mean over the rows (sums in that order)."""
        values = {}
        for i, metric in enumerate(self.metrics):
            values[metric.key] = sums[2 * i] / rows
            values[metric.baseline_key] = sums[2 * i + 1] / rows
        return values


def batch_rows(output: torch.Tensor) -> int:
    """The rows a masked label term is averaged over: all of the batch's (at least 1)."""
    return max(int(output.shape[0]), 1)


__all__ = ["Metric", "Task", "VAL_LOSS", "batch_rows"]
