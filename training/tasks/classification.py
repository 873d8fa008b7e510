"""Classification (``label.task: classification``): the label is a class index in
[0, num_classes); the network gives one logit per class.

Loss: cross-entropy; a transfer row's marker (-1) is cross-entropy's ``ignore_index``. The
distillation term is T^2 * KL(teacher probabilities at T || softmax(logits / T)); the T^2 keeps
its gradients on the label term's scale. Metric: accuracy, against the train split's majority
class. Served: the softmax probabilities (scoring adds the class index, their argmax).
"""

from __future__ import annotations

import numpy as np

from common.tasks import CLASSIFICATION
from training.tasks.base import Metric, Task, batch_rows


class Classification(Task):
    label = CLASSIFICATION
    metrics = (Metric("accuracy", "maximize"),)

    def label_loss(self, output, label, label_spec):
        import torch.nn.functional as F

        return F.cross_entropy(output, label)

    def masked_label_loss(self, output, label, label_spec):
        import torch.nn.functional as F

        return F.cross_entropy(output, label, ignore_index=self.label.missing_label, reduction="sum") / batch_rows(output)

    def teacher_loss(self, output, teacher, label_spec, distill):
        import torch.nn.functional as F

        temperature = distill.temperature
        # kl_div(log q, p) = sum p (log p - log q), with 0 log 0 = 0 for classes the teacher rules out.
        return temperature ** 2 * F.kl_div(F.log_softmax(output / temperature, dim=-1), teacher.float(),
                                           reduction="batchmean")

    def baseline(self, label_spec) -> int:
        """The majority class of the train split."""
        return int(np.argmax(label_spec.train_class_counts or [0]))

    def serving_arguments(self, label_spec) -> dict:
        return {"regression": False}

    def add_metric_sums(self, sums, output, label, label_spec) -> None:
        sums[0] += (output.argmax(dim=-1) == label).sum()
        sums[1] += (label == self.baseline(label_spec)).sum()


__all__ = ["Classification"]
