"""The task registry (``training.tasks``): every task the stages below training know
(``common.tasks``) trains with one task module of the same name, and the metric names a run
reports, the sweep accepts and the summary prints are the registry's. What each task computes
(its loss, distillation and transfer terms) is tested in test_distill.py; its metrics through
whole runs in test_train_in_process.py."""

from common.tasks import LABEL_TASKS
from training.tasks import TASKS, all_metrics, validation_metrics


def test_every_label_task_has_one_training_task_that_names_it():
    assert list(TASKS) == list(LABEL_TASKS)
    assert all(TASKS[name].label is LABEL_TASKS[name] for name in TASKS)


def test_each_task_reports_its_own_metrics_beside_the_validation_loss():
    assert validation_metrics("classification") == {"val_loss": "minimize", "val_accuracy": "maximize"}
    assert validation_metrics("regression") == {"val_loss": "minimize", "val_mae": "minimize"}
    assert validation_metrics() == {"val_loss": "minimize", "val_accuracy": "maximize", "val_mae": "minimize"}
    assert [(m.key, m.baseline_key, m.better) for m in all_metrics()] == [
        ("val_accuracy", "baseline_accuracy", "higher"), ("val_mae", "baseline_mae", "lower")]
