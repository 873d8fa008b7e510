"""The task registry (``training.tasks``): every task the stages below training know
(``common.tasks``) trains with one task module of the same name, and the metric names a run
reports, the sweep accepts and the summary prints are the registry's. What each task computes
(its loss, distillation and transfer terms) is tested in test_distill.py; its metrics through
whole runs in test_train_in_process.py."""

import pytest

from common.tasks import LABEL_TASKS
from training.tasks import TASKS, all_metrics, validation_metrics


def test_every_label_task_has_one_training_task_that_names_it():
    assert list(TASKS) == list(LABEL_TASKS)
    assert all(TASKS[name].label is LABEL_TASKS[name] for name in TASKS)


def test_each_task_reports_its_own_metrics_beside_the_validation_loss():
    assert validation_metrics("classification") == {"val_loss": "minimize", "val_accuracy": "maximize"}
    assert validation_metrics("regression") == {"val_loss": "minimize", "val_mae": "minimize"}
    assert validation_metrics("multilabel") == {"val_loss": "minimize", "val_micro_f1": "maximize",
                                                "val_macro_f1": "maximize"}
    assert validation_metrics() == {"val_loss": "minimize", "val_accuracy": "maximize", "val_mae": "minimize",
                                    "val_micro_f1": "maximize", "val_macro_f1": "maximize"}
    assert [(m.key, m.baseline_key, m.better) for m in all_metrics()] == [
        ("val_accuracy", "baseline_accuracy", "higher"), ("val_mae", "baseline_mae", "lower"),
        ("val_micro_f1", "baseline_micro_f1", "higher"), ("val_macro_f1", "baseline_macro_f1", "higher")]


def test_multilabel_f1s_pool_and_average_the_classes_as_scikit_learn_does():
    """Micro F1 pools every class's counts, macro F1 averages the classes' F1s (0 for a class
    with no positive either way, as f1_score(zero_division=0)); each class's own F1 is
    val_f1/<class>; the baseline predicts each class most train rows hold."""
    import torch

    from common.dataset import LabelSpec

    spec = LabelSpec("label", "multilabel", num_classes=3, classes=("red", "green", "blue?"),
                     train_class_counts=(6, 2, 0), record={"name": "label", "task": "multilabel", "num_classes": 3,
                                                           "classes": ["red", "green", "blue?"], "train_rows": 10,
                                                           "train_class_counts": [6, 2, 0], "threshold": 0.5})
    task = TASKS["multilabel"]
    truth = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 0]], dtype=torch.float32)
    logits = torch.tensor([[2.0, -2, -2], [2, -2, -2], [-2, 2, -2], [2, -2, -2]])  # red: tp 2 fp 1; green: tp 1 fn 1
    sums = torch.zeros(task.metric_sums(spec), dtype=torch.float64)
    task.add_metric_sums(sums, logits, truth, spec)
    values = task.metric_values(sums.tolist(), 4, spec)
    assert values["val_micro_f1"] == pytest.approx(2 * 3 / (2 * 3 + 1 + 1))
    assert values["val_f1/red"] == pytest.approx(0.8) and values["val_f1/green"] == pytest.approx(2 / 3)
    assert values["val_f1/blue_"] == 0.0 and values["val_macro_f1"] == pytest.approx((0.8 + 2 / 3 + 0) / 3)
    assert values["baseline_micro_f1"] == pytest.approx(2 * 2 / (2 * 2 + 2 + 2))  # red on every row
    assert list(values)[:4] == ["val_micro_f1", "baseline_micro_f1", "val_macro_f1", "baseline_macro_f1"]
