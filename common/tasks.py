"""What every stage knows of a task (``label.task``): the label contract the shard job writes,
training reads and scoring serves, one ``LabelTask`` per task in ``LABEL_TASKS``.

A task's label contract is: whether the label is a class index (``classes``: then
``label.num_classes`` >= 2 is required, the shard job counts the train split's classes, the
network gives one score per class and serving a probability per class, at a temperature), the
stored label column's type, and what a transfer row (no label) stores in its place. A label of
several classes per row (``multi``: multilabel) is a list of classes in the raw data, stored as a
multi-hot float32 vector of num_classes, served as a probability per class (each its own sigmoid)
and the set of classes at or above the label's ``threshold`` (``DEFAULT_THRESHOLD``).

A class label may name its classes (``label.classes`` in the shard config: a list, or ``auto``,
fitted on the train split): the label record then holds ``classes``, the class names in index
order (``num_classes`` of them, distinct strings; ``class_list_problem`` checks a record's), the
stored label stays the class index, and whatever serves the model gives the names. A raw value
outside the list is quarantined with reason ``UNKNOWN_CLASS``.

Callers ask the task's ``LabelTask`` (``label_task(name)``) these facts; none compares a task's
name. How a task trains and serves (loss, distillation terms, metrics, baseline, target scaling,
the serving head) is training's: ``training.tasks``, one module per task, each naming its
``LabelTask`` here. This module is the piece below training that the shard job, the manifest,
model.json and scoring share: it imports nothing of the project.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LabelTask:
    name: str
    classes: bool  # the label is a class index in [0, num_classes) (see the module doc)
    label_dtype: str  # the stored label column's type (common.dataset DTYPES)
    missing_label: int | float  # what a transfer row stores as its label (common.dataset's module doc)
    multi: bool = False  # a set of classes per row, stored multi-hot (see the module doc)

    def output_shape(self, num_classes: int | None) -> tuple[int, ...]:
        """One row's output (served, and a teacher's stored soft target): a probability per class,
        or one value."""
        return (int(num_classes),) if self.classes else ()

    def output_width(self, num_classes: int | None) -> int:
        """The network's last layer: a logit per class, or one value (squeezed to ``output_shape``)."""
        return int(num_classes) if self.classes else 1

    def label_shape(self, num_classes: int | None) -> tuple[int, ...]:
        """The stored label column's shape: the multi-hot vector, or a scalar."""
        return (int(num_classes),) if self.multi else ()


UNKNOWN_CLASS = "unknown_class"  # the quarantine reason of a label value outside the class list
# The most classes a label may name: each is a name in the manifest and model.json, and a logit per
# row; far above a real task's, low enough that a label mistaken for an id column fails at once.
MAX_CLASSES = 100_000


def class_list_problem(classes, num_classes) -> str | None:
    """What is wrong with a label record's ``classes`` (absent: nothing), in words that follow
    "field 'label.classes' ": num_classes distinct strings, in index order."""
    if classes is None:
        return None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        return f"is {classes!r}; expected a list of class names (strings)"
    if len(classes) != num_classes:
        return f"names {len(classes)} classes, but 'num_classes' is {num_classes!r}"
    if len(set(classes)) != len(classes):
        return f"names {sorted({c for c in classes if classes.count(c) > 1})} more than once"
    return None


CLASSIFICATION = LabelTask("classification", classes=True, label_dtype="int64", missing_label=-1)
REGRESSION = LabelTask("regression", classes=False, label_dtype="float32", missing_label=float("nan"))
MULTILABEL = LabelTask("multilabel", classes=True, label_dtype="float32", missing_label=float("nan"), multi=True)
LABEL_TASKS = {task.name: task for task in (CLASSIFICATION, REGRESSION, MULTILABEL)}
DEFAULT_THRESHOLD = 0.5  # a multilabel label's ``threshold`` when its record has none
TASK_NAMES = tuple(LABEL_TASKS)  # a config's ``Literal[TASK_NAMES]``: the choices its error names


def label_task(name: str) -> LabelTask:
    """The task of a validated label record (``common.dataset``, model.json) or config."""
    return LABEL_TASKS[name]


def task_names(quote: bool = False) -> str:
    """The tasks in words, for a message: "classification or regression"."""
    names = [f"'{name}'" if quote else name for name in LABEL_TASKS]
    return " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"


__all__ = ["CLASSIFICATION", "DEFAULT_THRESHOLD", "LABEL_TASKS", "LabelTask", "MAX_CLASSES", "MULTILABEL", "REGRESSION",
           "TASK_NAMES", "UNKNOWN_CLASS", "class_list_problem", "label_task", "task_names"]
