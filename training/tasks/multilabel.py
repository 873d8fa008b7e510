"""Multilabel classification (``label.task: multilabel``): a row holds a set of classes, stored as
a multi-hot float32 vector of num_classes; the network gives one logit per class, each its own
sigmoid (the classes do not compete, as a softmax's do).

Loss: the binary cross-entropy of each class's logit against its 0/1 target, averaged over the
classes and rows. A class is predicted where its probability is at or above the label's
``threshold`` (0.5 unless the shard config's ``label.threshold`` says otherwise). Metrics:
micro F1 (every class's true and false positives and negatives pooled) and macro F1 (the mean of
the classes' F1s), each against the trivial baseline that predicts, for every row, each class
that most train rows hold; and each class's own F1 as ``val_f1/<class>`` (``label_metric_key``).
An F1 with no positive either way (no true, predicted or missed positive) is 0, as
scikit-learn's ``f1_score(zero_division=0)``. Served: each class's probability and the set of
classes at or above the threshold (``training.tasks.multilabel_serving``: a program of its own,
so the published programs of the other tasks keep their code). No teacher yet: the shard config
refuses ``teacher`` for a multilabel label, so neither a distillation nor a transfer-set term is
defined here.
"""

from __future__ import annotations

import re

import numpy as np

from common.tasks import MULTILABEL
from training.tasks.base import Metric, Task

_SUMS = 3  # per class: true positives, false positives, false negatives


class Multilabel(Task):
    label = MULTILABEL
    metrics = (Metric("micro_f1", "maximize"), Metric("macro_f1", "maximize"))

    def label_loss(self, output, label, label_spec):
        import torch.nn.functional as F

        return F.binary_cross_entropy_with_logits(output, label.float())

    def baseline(self, label_spec) -> np.ndarray:
        """Each class that most labelled train rows hold (bool, one per class)."""
        counts = np.asarray(label_spec.train_class_counts or [0] * label_spec.num_classes)
        return 2 * counts > (label_spec.train_rows or 0)

    def serving_module(self, net, label_spec):
        from training.tasks.multilabel_serving import MultilabelServing

        return MultilabelServing(net)

    # --- validation metrics ----------------------------------------------------------------------

    def metric_sums(self, label_spec) -> int:
        return 2 * _SUMS * label_spec.num_classes  # the model's per-class counts, then the baseline's

    def add_metric_sums(self, sums, output, label, label_spec) -> None:
        import torch

        truth = label > 0.5
        predicted = torch.sigmoid(output.float()) >= label_spec.threshold  # what serving predicts
        baseline = torch.as_tensor(self.baseline(label_spec), device=label.device).expand_as(truth)
        k = label_spec.num_classes
        for offset, guess in ((0, predicted), (_SUMS * k, baseline)):
            for i, hits in enumerate((guess & truth, guess & ~truth, ~guess & truth)):
                sums[offset + i * k:offset + (i + 1) * k] += hits.sum(dim=0)

    def metric_values(self, sums, rows, label_spec) -> dict:
        k = label_spec.num_classes
        counts = np.asarray(sums, dtype=np.float64).reshape(2, _SUMS, k)  # (model, baseline) x (tp, fp, fn) x class
        per_class = [_f1(*counts[which]) for which in (0, 1)]
        values = {}
        for metric, pooled in zip(self.metrics, (True, False)):
            for which, key in ((0, metric.key), (1, metric.baseline_key)):
                values[key] = float(_f1(*counts[which].sum(axis=1))) if pooled else float(per_class[which].mean())
        values.update({label_metric_key(name): float(f1) for name, f1 in zip(class_names(label_spec), per_class[0])})
        return values


def _f1(tp, fp, fn):
    """2 TP / (2 TP + FP + FN), elementwise; 0 where nothing is positive either way."""
    tp, denominator = np.asarray(tp, dtype=np.float64), np.asarray(2 * tp + fp + fn, dtype=np.float64)
    return np.divide(2 * tp, denominator, out=np.zeros_like(denominator), where=denominator > 0)


def class_names(label_spec) -> list[str]:
    """The classes as metric keys name them: their names, or their indices."""
    if label_spec.classes is not None:
        return list(label_spec.classes)
    return [str(i) for i in range(label_spec.num_classes)]


def label_metric_key(name: str) -> str:
    """A class's own F1, ``val_f1/<class>``: characters an MLflow metric name cannot hold become '_'."""
    return "val_f1/" + re.sub(r"[^\w.\- ]", "_", name)


__all__ = ["Multilabel", "class_names", "label_metric_key"]
