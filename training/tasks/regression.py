"""Regression (``label.task: regression``): the label is a value; the network gives one.

Targets are trained standardized (the train split's mean 0, std 1) for a well-scaled loss.
Loss: MSE to the standardized label; a transfer row's marker (NaN) is a 0 factor on a target
whose marker was zeroed. The distillation term is the MSE to the teacher's value, standardized
like the label (a temperature does not apply). Metric: mean absolute error, on the label's scale,
against the train mean. Served: the network's value, de-standardized.
"""

from __future__ import annotations

from common.tasks import REGRESSION
from training.tasks.base import Metric, Task, batch_rows


class Regression(Task):
    label = REGRESSION
    metrics = (Metric("mae", "minimize"),)

    def label_loss(self, output, label, label_spec):
        import torch.nn.functional as F

        mean, std = self.target_scaling(label_spec)
        return F.mse_loss(output, (label.float() - mean) / std)

    def masked_label_loss(self, output, label, label_spec):
        import torch

        mean, std = self.target_scaling(label_spec)
        labelled = ~torch.isnan(label)
        target = (torch.nan_to_num(label.float(), nan=0.0) - mean) / std
        return (labelled.float() * (output - target) ** 2).sum() / batch_rows(output)

    def teacher_loss(self, output, teacher, label_spec, distill):
        import torch.nn.functional as F

        mean, std = self.target_scaling(label_spec)
        return F.mse_loss(output, (teacher.float() - mean) / std)

    def target_scaling(self, label_spec) -> tuple[float, float]:
        std = label_spec.train_std or 1.0
        return label_spec.train_mean or 0.0, std if std > 0 else 1.0

    def baseline(self, label_spec) -> float:
        """The train split's mean."""
        return self.target_scaling(label_spec)[0]

    def serving_arguments(self, label_spec) -> dict:
        mean, std = self.target_scaling(label_spec)
        return {"regression": True, "target_mean": mean, "target_std": std}

    def add_metric_sums(self, sums, output, label, label_spec) -> None:
        mean, std = self.target_scaling(label_spec)
        sums[0] += ((output.float() * std + mean) - label).abs().sum()
        sums[1] += (label - self.baseline(label_spec)).abs().sum()


__all__ = ["Regression"]
