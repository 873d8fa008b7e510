"""The shard job's config tree: one dataclass per section, each validating itself.

Section and key names are a public contract (scheduled jobs and notebooks use them): add keys,
never rename them. Load with ``load_shard_config(path, overrides)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, make_dataclass
from typing import Literal, get_origin

from common.config import SparkConfig, load_config, require, setting, storage_path
from common.dataset import TEACHER_COLUMN
from common.features import KINDS
from common.sql import quote_identifier
from common.tasks import MAX_CLASSES, TASK_NAMES, label_task
from common.sources import SourceConfig, check_sources_and_query

# Fixed ceilings on the counts that size a loop or an allocation before any data is seen (the
# job's partition keys, every feature's array, the manifest's vocabularies). Far above what a
# dataset needs, low enough that a typo (num_shards=1000000000000) fails at once, not after hours.
MAX_SHARDS = 10_000  # shard files per split
# The features' own ceilings are their kinds' (common.features: MAX_ARRAY_VALUES, MAX_VOCAB, and
# MAX_CATEGORY_BYTES, common.rows', which serving refuses beyond).


def _features_config() -> type:
    """The ``features`` section: each registered kind's keys (``FeatureKind.columns_type`` under
    its name, then its ``options``), checked by the kinds, and no column declared twice."""
    def setting_of(default, help_text):
        kwargs = {"default_factory": default} if callable(default) else {"default": default}
        return setting(help_text, **kwargs)

    # A kind's own key is empty by default: an empty list or mapping (its type's origin).
    keys = [(kind.name, kind.columns_type, setting_of(get_origin(kind.columns_type), kind.columns_help))
            for kind in KINDS]
    keys += [(key, type_, setting_of(default, help_text)) for kind in KINDS for key, type_, default, help_text in kind.options]

    def __post_init__(self):
        names = self.all_columns
        dup = sorted({n for n in names if names.count(n) > 1})
        require(not dup, "features", f"lists column(s) {dup} more than once")
        for kind in KINDS:
            kind.check_config(self)

    def all_columns(self) -> list[str]:
        return [name for kind in KINDS for name in getattr(self, kind.name)]

    cls = make_dataclass("FeaturesConfig", keys,
                         namespace={"__post_init__": __post_init__, "all_columns": property(all_columns),
                                    "__doc__": "The features section: which columns are features, of which kind."})
    cls.__module__ = __name__  # pickled by reference (a config travels to Spark's workers)
    return cls


FeaturesConfig = _features_config()


@dataclass
class LabelConfig:
    column: str | None = setting("the label column; exactly one of `column` and `expr`", default=None)
    expr: str | None = setting("instead of `column`: a Spark SQL expression computing the label", default=None)
    task: Literal[TASK_NAMES] = setting(
        "what the label is: `multilabel` is a list of classes per row (names with `classes`, or indices), stored "
        "as a multi-hot vector and trained with a sigmoid per class", default="classification")
    num_classes: int | None = setting(
        "classification and multilabel: the number of classes (at least 2), required unless `classes` names "
        "them; labels must be integers in `[0, num_classes)`. With `classes` it follows from them (set both and "
        "they must agree)", default=None)
    # The transfer set's rows learn from the teacher's soft targets only (see common/dataset.py).
    unlabeled: Literal["quarantine", "transfer"] = setting(
        "rows with a null label: quarantined (`null_label`), or `transfer`: with a `teacher`, every one of them "
        "joins the train split as a transfer set (val and test keep only labelled rows); `transfer` without a "
        "teacher is exit 2", default="quarantine")
    classes: Literal["auto"] | list[str] | None = setting(
        "a class label's values name its classes (a value's string form): `auto` fits the list on the train split "
        "(most frequent first, ties by name, as a categorical vocabulary), or a list names them in index order; "
        "a value outside the list is quarantined (`unknown_class`); predictions carry the names. Null: the values "
        "are class indices", default=None)
    threshold: float | None = setting(
        "multilabel: the probability at or above which a class is predicted (served, and in the F1 metrics). Null: "
        "0.5", default=None)

    def __post_init__(self):
        require((self.column is None) != (self.expr is None), "column", "or label.expr must be set (exactly one)")
        if self.threshold is not None:
            require(self.multi, "threshold",
                    f"applies to task=multilabel, not task={self.task}; remove label.threshold")
            require(0 < self.threshold < 1, "threshold", f"must be a probability in (0, 1), got {self.threshold:g}")
        if self.classes is not None:
            self._check_classes()
        elif self.classification:
            require(self.num_classes is not None and self.num_classes >= 2, "num_classes",
                    f"must be set (>= 2) for task={self.task}, or name the classes (label.classes: auto, or a list)")

    def _check_classes(self) -> None:
        require(self.classification, "classes", f"names a class label's classes, but task={self.task} has none; "
                "remove label.classes")
        if self.classes == "auto":
            return  # num_classes, if set, is checked against the list fitted on train (pipelines/labels.py)
        dup = sorted({c for c in self.classes if self.classes.count(c) > 1})
        require(not dup, "classes", f"names {dup} more than once")
        require(2 <= len(self.classes) <= MAX_CLASSES, "classes",
                f"must name 2 to {MAX_CLASSES:,} classes, got {len(self.classes)}")
        require(self.num_classes in (None, len(self.classes)), "num_classes",
                f"is {self.num_classes}, but label.classes names {len(self.classes)} classes; set one of them "
                "(num_classes follows from classes)")
        self.num_classes = len(self.classes)

    @property
    def classification(self) -> bool:
        """A class label (its task's ``LabelTask.classes``, ``common.tasks``)."""
        return label_task(self.task).classes

    @property
    def multi(self) -> bool:
        """A set of classes per row (its task's ``LabelTask.multi``): a list column."""
        return label_task(self.task).multi

    @property
    def sql(self) -> str:
        return self.expr if self.expr is not None else quote_identifier(self.column)


@dataclass
class SplitConfig:
    key: str = setting(
        "a column or Spark SQL expression hashed to assign each row its split (a user id keeps a user's rows "
        "together)")
    fractions: dict[str, float] = setting(
        "split name -> its share of the rows; must add up to 1 and include `train`",
        default_factory=lambda: {"train": 0.8, "val": 0.1, "test": 0.1})
    seed: int = setting("changes the split assignment and the shuffle", default=0)

    def __post_init__(self):
        require(bool(self.key), "key", "must name a column or expression")
        require("train" in self.fractions, "fractions", "must include a train split")
        for name, frac in self.fractions.items():
            require(name.isidentifier(), f"fractions.{name}", "must be a simple name (letters, digits, _)")
            require(0 < frac <= 1, f"fractions.{name}", f"must be in (0, 1], got {frac}")
        total = sum(self.fractions.values())
        require(math.isclose(total, 1.0, abs_tol=1e-6), "fractions", f"must add up to 1, got {total:g}")


@dataclass
class OutputConfig:
    path: str = storage_path("the dataset's URI")
    num_shards: int = setting(
        "shard files per split (at most 10,000), their row counts differing by at most one: the most ranks that "
        "can train on the dataset; a split with fewer rows is exit 2 once the rows are counted", default=8)
    row_group_mb: float | None = setting(
        "row-group size in MiB of stored data (null, and no `rows_per_row_group`: 16); `shardtrain inspect` "
        "shows the result", default=None)
    rows_per_row_group: int | None = setting("instead of `row_group_mb`: row-group size in rows", default=None)
    mode: Literal["error", "overwrite", "skip_if_exists"] = setting(
        "`error` refuses an existing dataset, `overwrite` replaces it atomically, `skip_if_exists` exits 0 "
        "without work when the same config over the same input is already published", default="error")
    # How the job runs, not what it writes: the files are the same for any value (the default's
    # arithmetic: pipelines/shard_placement.py, staging_parts).
    staging_partitions: int | None = setting(
        "partitions per split of the job's first pass (read, check, stage, count); null: num_shards x "
        "(cores / (splits x num_shards), rounded up), or 1 when the sources hold under 8 MiB; always "
        "num_shards with a `teacher`. Not part of the input fingerprint", default=None)
    ignore_readers: bool = setting(
        "`overwrite` refuses (exit 1, naming each reader) a dataset that running trainings hold reader leases "
        "on; true replaces it anyway, and those trainings then fail (exit 1) without publishing. Not part of "
        "the input fingerprint", default=False)

    def __post_init__(self):
        require(self.num_shards >= 1, "num_shards", f"must be >= 1, got {self.num_shards}")
        require(self.num_shards <= MAX_SHARDS, "num_shards",
                f"must be at most {MAX_SHARDS:,} (shard files per split), got {self.num_shards}")
        require(self.staging_partitions is None or 1 <= self.staging_partitions <= 4096, "staging_partitions",
                f"must be in [1, 4096] (the buckets per split), got {self.staging_partitions}")
        require(self.row_group_mb is None or self.rows_per_row_group is None, "row_group_mb",
                "and rows_per_row_group (same section) are alternatives; set one")
        require(self.row_group_mb is None or self.row_group_mb > 0, "row_group_mb", "must be > 0")
        require(self.rows_per_row_group is None or self.rows_per_row_group >= 1, "rows_per_row_group", "must be >= 1")


@dataclass
class QualityConfig:
    max_bad_fraction: float = setting(
        "above this share of quarantined input rows the job fails (exit 1) with the counts by reason",
        default=0.01)

    def __post_init__(self):
        require(0 <= self.max_bad_fraction <= 1, "max_bad_fraction", f"must be in [0, 1], got {self.max_bad_fraction}")


@dataclass
class TeacherConfig:
    """Knowledge distillation: store a published model's soft targets as a ``teacher`` column of
    every split (see pipelines/teacher.py)."""

    model: str = storage_path(
        "URI of a model published by `shardtrain train` (or `models:/NAME/VERSION`, `models:/NAME@ALIAS`)")
    temperature: float = setting(
        "softmax temperature of the stored class probabilities (above 1 softens them); must stay 1 for "
        "regression", default=1.0)
    model_code: Literal["refuse", "trust"] = setting(
        "a teacher trained from code given to `train(model=...)` holds that code and is rebuilt by running it: "
        "`trust` runs it (its sha256 is logged), `refuse` is exit 2 naming this key", default="refuse")

    def __post_init__(self):
        require(bool(self.model), "model", "must be the URI of a published model")
        require(0 < self.temperature < math.inf, "temperature", f"must be > 0, got {self.temperature}")


@dataclass
class ShardConfig:
    sources: dict[str, SourceConfig] = setting(
        "the input: each source, under a name of yours, becomes a Spark SQL view of that name")
    label: LabelConfig = setting("what the model learns to predict")
    split: SplitConfig = setting("how rows are assigned to splits")
    output: OutputConfig = setting("the dataset this job publishes")
    spark: SparkConfig = setting("the Spark session, when the job creates one", default_factory=SparkConfig)
    query: str | None = setting(
        "one Spark SQL query (`SELECT`, `WITH`, `VALUES`, `FROM`, `TABLE`) over the source views producing the "
        "training table; required with several sources; a statement that writes, several statements or "
        "`${var}` are exit 2 before anything runs", default=None)
    transform: str | None = setting(
        "`package.module:function` taking and returning a DataFrame, applied after `query`, for logic SQL "
        "cannot express", default=None)
    features: FeaturesConfig = setting("which columns are features, of which kind", default_factory=FeaturesConfig)
    quality: QualityConfig = setting("when too much of the input is refused", default_factory=QualityConfig)
    teacher: TeacherConfig | None = setting(
        "a published model whose soft targets every split also stores, in column `teacher`, for distillation; "
        "null: none", default=None)

    def __post_init__(self):
        require(bool(self.sources), "sources", "must name at least one source")
        check_sources_and_query(self.sources, self.query)
        require(self.transform is None or ":" in self.transform, "transform",
                f"must be 'module:function', got {self.transform!r}")
        require(bool(self.features.all_columns), "features", "must declare at least one feature column")
        require(self.label.unlabeled != "transfer" or self.teacher is not None, "label.unlabeled",
                "is transfer, but no teacher is set: rows without a label learn only from a teacher's soft "
                "targets. Set teacher.model (a published model URI; `shardtrain distill` sets it with "
                "soft_targets.unlabeled=transfer) or label.unlabeled=quarantine")
        if self.teacher is not None:
            require(not self.label.multi, "teacher", f"is set, but a {self.label.task} label takes no teacher yet: "
                    "distillation and transfer sets are for classification and regression labels; remove teacher")
            require(self.label.classification or self.teacher.temperature == 1, "teacher.temperature",
                    f"applies to class probabilities only; a {self.label.task} teacher's value has none (got "
                    f"{self.teacher.temperature:g}; leave it at 1)")
            require(TEACHER_COLUMN not in self.features.all_columns, "features",
                    f"name a column {TEACHER_COLUMN!r}, the column a teacher's soft targets are stored in; "
                    "rename it in the query")

    @property
    def uris(self) -> list[str]:
        """Every storage location the job touches: checked before Spark starts."""
        teacher = [self.teacher.model] if self.teacher is not None else []
        return [self.output.path, *(src.path for src in self.sources.values() if src.path is not None), *teacher]


def load_shard_config(path=None, overrides=None, defaults: dict | None = None) -> ShardConfig:
    return load_config(ShardConfig, path, overrides, defaults)
