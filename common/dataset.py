"""The dataset contract between pipelines/ (producer) and training/ (consumer): the manifest, its
typed records, and the one validation every reader runs. The one way to build a manifest is
``common.manifest_builder.build_manifest``; a dataset's files are checked against it by
``common.dataset_files``.

``_manifest.json`` sits at the root of a published dataset, beside the ``_COMMITTED`` marker::

    {
      "format": "shardtrain.dataset", "format_version": 2,
      "shardtrain_version": "0.1.0", "created_at": "2026-11-29T22:00:00Z",
      "schema": [{"name": "x", "dtype": "float32", "shape": []}, ...],    # stored columns
      "features": [                                         # in stored-column order; each kind's fields
        {"name": "x", "kind": "numeric", "mean": 0.1, "std": 1.2, "fill": 0.1, "null_share": 0.0123},
        {"name": "city", "kind": "categorical", "vocab": ["paris", ...], "num_embeddings": 12, "null_share": 0.0},
        {"name": "image", "kind": "arrays", "shape": [28, 28], "null_share": 0.0}
      ],
      "label": {"name": "label", "task": "classification", "num_classes": 2,
                "train_class_counts": [600, 400]}        # regression: "train_mean", "train_std"
                                                        # named classes: "classes": ["cat", "dog"]
                                                        # multilabel: "threshold": 0.5, "train_rows": 1000
                                                        # (class counts: each class's train rows)
      "row_index_column": "_row",
      "splits": {"train": {"rows": 1000, "files": [
          {"path": "train/part-00000.parquet", "rows": 125, "row_groups": [100, 25],
           "bytes": 5123, "sha256": "..."}]}, ...},
      "quarantine": {"path": "_quarantine", "rows": 3, "by_reason": {"null_label": 3}},
      "accounting": {"input_rows": 1003, "published_rows": 1000, "quarantined_rows": 3},
      "sources": {"raw": {"path": "...", "format": "csv", "files": [{"path", "size", "mtime"}]}},
      "config": {...},                                      # the resolved shard config
      "fingerprint": "sha256 over the data checksums, feature and label spec"
    }

Optional, written by a shard job with a ``teacher`` (knowledge distillation)::

      "teacher": {"uri": "s3://models/teacher", "fingerprint": "<sha256 of its model.json>",
                  "temperature": 2.0, "column": "teacher", "task": "classification", "num_classes": 2,
                  "features": [{"name": "x", "kind": "numeric"}, {"name": "city", "kind": "categorical"},
                               {"name": "image", "kind": "arrays", "shape": [28, 28]}]}

  The stored column ``teacher`` holds the teacher's soft targets for every row of every split:
  float32 class probabilities at ``temperature`` (shape [num_classes]) for classification, the
  teacher's predicted value (float32, the label's scale) for regression. ``task``, ``num_classes``
  (and ``classes``, a teacher's class names where its label names them) and ``features`` (the raw columns the teacher reads) are the teacher's own, so a consumer can
  check it suits the dataset's label and features (``teacher_differences``).

  With the shard config's ``label.unlabeled: transfer``, the train split also holds rows without
  a label (a transfer set: they teach through the soft targets only). Then ``label`` adds
  ``"unlabeled": "transfer", "train_transfer_rows": 900`` (of the train split's rows; class counts
  and moments are the labelled rows'), ``accounting`` adds ``"transfer_rows"`` (part of the
  published rows), and those rows store their task's ``missing_label`` (``common.tasks``): -1 as
  the class (classification), NaN (regression). A marker in the label column itself, so every
  Parquet reader passes it on unchanged; the training loss masks those rows out of the label term
  (``training.tasks.base.Task.loss``).

``null_share`` (each feature's null values over the train split's clean rows, a fraction in
[0, 1]; an array's is 0: a null array is quarantined) is what the score job compares an input's
nulls with (scoring/quality.py). It describes the data, not the encoding: ``FeatureSpec.encoding``
leaves it out. Manifests (and models) written before it was recorded lack it, so readers must not
require it (``FeatureSpec.null_shares`` is then empty).

Also written by the shard job (readers must not require them): ``num_shards``,
``rows_per_row_group``; ``label.source`` (the raw column or expression); ``quarantine.files``
(same entries as a split's files); ``input_fingerprint`` (sha256 of the resolved config minus
``spark``, ``output.mode`` and ``output.staging_partitions``, the source fingerprints and the versions: what ``skip_if_exists``
compares). The quarantine is Parquet with string columns ``reason``, ``source`` (a source name,
or "query") and ``raw`` (the malformed line, or the table row as JSON). ``config.yaml`` beside the
manifest holds the same resolved config.

Each feature's ``kind`` names the module that owns it (``common.features``: what its record
holds, how it is fitted, stored, checked and served). Version 1 (datasets written before)
holds ``features`` (and a teacher's) as a dict by kind, ``{"numeric": [records], ...}``;
``common.features.v1`` reads it as the same list. Stored encodings are the kinds' (numeric
features float32, imputed and standardized; categorical ones int32 indices; arrays float32 lists
of length prod(shape)); the label is int64 (classification) or float32 (regression); ``_row`` is
the row's position in the split (files in order, rows in order).

A feature record may list side files its kind needs to serve raw values (``files``: [{"path",
"sha256"}]): a text feature's tokenizer, ``_text/<column>/tokenizer.json`` (common.features.text;
its stored column is ``list<int32>`` token ids, ``"ragged": true`` in the schema, ``shape``
[max_tokens] the most a row holds). They are published with the dataset and checked against their
sha256 whenever the manifest is read (``FeatureSpec.attach``): a changed one is refused, named.

File paths are relative to the dataset root and stay inside it (``validate_manifest`` refuses
absolute paths and ``..``). Every file's sha256 is recorded; readers check a file against it
before using its rows (``common.dataset_files.verify_file``), and ``verify_dataset`` checks them all.

``read_manifest`` validates the record, then parses it once: ``Manifest.label`` (``LabelSpec``),
``Manifest.teacher`` (``TeacherRecord``, or None), ``Manifest.splits`` (a ``SplitEntry`` of
``FileEntry``s per split) and ``Manifest.features`` (``FeatureSpec``); readers use these typed,
frozen objects, never the raw dicts. ``to_record()`` gives back a label's or teacher's record
exactly as parsed: model.json stores the label's, and a plug-in model factory receives it.

``FeatureSpec.transform`` applies the same preprocessing to raw rows (pandas or Arrow, whole
columns at once): training's ``load_model(...).predict`` and scoring's mapInArrow use it, so serving
reproduces training exactly.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from typing import Any


from common.commit_marker import is_committed
from common.errors import DatasetError, StorageError
from common.features import KINDS, FeatureSpec
from common.features.v1 import KIND, listed
from common.features.spec import NULL_SHARE
from common.publish import require_committed
from common.storage import Location, resolve, storage_errors
from common.tasks import DEFAULT_THRESHOLD, LABEL_TASKS, LabelTask, class_list_problem, label_task, task_names

MANIFEST_NAME = "_manifest.json"
FORMAT = "shardtrain.dataset"
FORMAT_VERSION = 2  # 2: ``features`` is one ordered list of records naming their kind
READABLE_VERSIONS = (1, 2)  # 1: ``features`` by kind (common.features.v1 reads it)
ROW_INDEX = "_row"
LABEL_NAME = "label"
TEACHER_COLUMN = "teacher"
DTYPES = ("float32", "int32", "int64", "binary")  # binary: encoded values (an image feature's bytes)


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the dataset root
    rows: int
    row_groups: tuple[int, ...]
    bytes: int
    sha256: str


@dataclass(frozen=True)
class SplitEntry:
    """A split's entry in ``splits``: its row count and its files, in order."""
    rows: int
    files: tuple[FileEntry, ...]

    @classmethod
    def from_record(cls, record: dict) -> "SplitEntry":
        return cls(rows=int(record["rows"]), files=tuple(_file_entry(f) for f in record["files"]))


@dataclass(frozen=True)
class LabelSpec:
    """The manifest's ``label`` (model.json's ``label`` is the same record): what the label is and
    its train statistics, class counts for classification, mean and std for regression.

    ``record`` is the dict it was parsed from, kept whole (with ``source`` and any field a newer
    writer adds), so ``to_record`` hands back exactly that: what model.json stores and what a
    plug-in model factory receives. Built by hand (tests), the record is made from the fields."""
    name: str
    task: str
    num_classes: int | None = None
    train_class_counts: tuple[int, ...] | None = None
    train_mean: float | None = None
    train_std: float | None = None
    record: dict = field(default_factory=dict, compare=False, repr=False)
    classes: tuple[str, ...] | None = None  # the class names in index order (``common.tasks``), if named

    def __post_init__(self):
        if not self.record:
            fields = {"name": self.name, "task": self.task, "num_classes": self.num_classes,
                      "classes": None if self.classes is None else list(self.classes),
                      "train_class_counts": None if self.train_class_counts is None else list(self.train_class_counts),
                      "train_mean": self.train_mean, "train_std": self.train_std}
            object.__setattr__(self, "record", {k: v for k, v in fields.items() if v is not None})

    @classmethod
    def from_record(cls, record: dict) -> "LabelSpec":
        """A validated label record (``validate_manifest``; model.json's ``_check_meta_fields``)."""
        counts, mean, std = (record.get(key) for key in ("train_class_counts", "train_mean", "train_std"))
        return cls(name=record.get("name", LABEL_NAME), task=record["task"], num_classes=record.get("num_classes"),
                   train_class_counts=None if counts is None else tuple(counts),
                   train_mean=None if mean is None else float(mean), train_std=None if std is None else float(std),
                   record=copy.deepcopy(record), classes=_class_names(record))

    @property
    def classification(self) -> bool:
        """A class label (its task's ``LabelTask.classes``, ``common.tasks``)."""
        return label_task(self.task).classes

    @property
    def output_shape(self) -> tuple[int, ...]:
        """One row's served output: (num_classes,) (probabilities) or () (a value)."""
        return label_task(self.task).output_shape(self.num_classes)

    @property
    def transfer_rows(self) -> int:
        """Train rows without a label (``label.unlabeled: transfer``; see the module doc); 0 if none."""
        return int(self.record.get("train_transfer_rows", 0))

    @property
    def threshold(self) -> float:
        """A multilabel label's: the probability at or above which a class is predicted."""
        return float(self.record.get("threshold", DEFAULT_THRESHOLD))

    @property
    def train_rows(self) -> int | None:
        """A multilabel label's labelled train rows (its class counts are each class's share of them)."""
        return self.record.get("train_rows")

    def to_record(self) -> dict:
        return copy.deepcopy(self.record)


@dataclass(frozen=True)
class TeacherRecord:
    """The manifest's ``teacher`` (see the module doc): the model whose soft targets the splits
    store, and its contract (task, classes, the raw feature columns it reads). ``to_record`` gives
    back exactly the dict it was parsed from (what the shard job writes into the manifest)."""
    uri: str
    fingerprint: str
    temperature: float
    task: str
    num_classes: int | None
    features: tuple[dict, ...]  # each feature's contract, naming its kind (``FeatureSpec.teacher_features``)
    record: dict = field(compare=False, repr=False)
    classes: tuple[str, ...] | None = None  # the teacher's class names in index order, if its label names them

    @classmethod
    def from_record(cls, record: dict) -> "TeacherRecord":
        """A teacher record of the shape ``_validate_teacher`` checks (the shard job types its own
        record before ``build_manifest`` validates it)."""
        return cls(uri=record["uri"], fingerprint=record["fingerprint"], temperature=float(record["temperature"]),
                   task=record["task"], num_classes=record.get("num_classes"),
                   features=tuple(_listed(record["features"])),
                   record=copy.deepcopy(record), classes=_class_names(record))

    @property
    def classification(self) -> bool:
        """A teacher of class probabilities (its task's ``LabelTask.classes``, ``common.tasks``)."""
        return label_task(self.task).classes

    @property
    def shape(self) -> tuple[int, ...]:
        """The stored soft-target column's shape: (num_classes,) (probabilities) or () (a value)."""
        return label_task(self.task).output_shape(self.num_classes)

    def to_record(self) -> dict:
        return copy.deepcopy(self.record)


def _class_names(record: dict) -> tuple[str, ...] | None:
    classes = record.get("classes")
    return None if classes is None else tuple(classes)


class Manifest:
    """A parsed, validated ``_manifest.json``; ``root`` is the dataset Location."""

    def __init__(self, data: dict, root: Location):
        self.data = data
        self.root = root
        self._validate()
        # Parsed once, after the validation: readers use these, never the raw records.
        self.features = FeatureSpec(data["features"], _recorded_category_bytes(data))
        self.features.attach(root)  # a kind's side files (a tokenizer), checked against their sha256
        self.label = LabelSpec.from_record(data["label"])
        # The soft-target record, or None: the splits store no teacher column.
        self.teacher = None if data.get("teacher") is None else TeacherRecord.from_record(data["teacher"])
        self.splits = {name: SplitEntry.from_record(info) for name, info in data["splits"].items()}

    def _validate(self) -> None:
        validate_manifest(self.data, f"{self.root.uri}/{MANIFEST_NAME}")

    @property
    def fingerprint(self) -> str:
        return self.data["fingerprint"]

    @property
    def split_names(self) -> list[str]:
        return list(self.splits)

    def rows(self, split: str) -> int:
        return self._split(split).rows

    def files(self, split: str) -> list[FileEntry]:
        return list(self._split(split).files)

    def file_uris(self, split: str) -> list[str]:
        return [self.root.join(f.path).uri for f in self.files(split)]

    def num_shards(self, split: str) -> int:
        return len(self._split(split).files)

    def column(self, name: str) -> dict:
        for col in self.data["schema"]:
            if col["name"] == name:
                return col
        raise DatasetError(f"{self.root.uri}: column {name!r} is not in the dataset schema")

    def _split(self, split: str) -> SplitEntry:
        try:
            return self.splits[split]
        except KeyError:
            raise DatasetError(
                f"{self.root.uri}: split {split!r} is not in the manifest (it has {self.split_names})") from None


def _recorded_category_bytes(data: dict) -> int | None:
    """The shard job's features.max_category_bytes, from the resolved config the manifest records;
    None where it records none (a manifest written by other producers, tests)."""
    value = ((data.get("config") or {}).get("features") or {}).get("max_category_bytes")
    return value if type(value) is int and value >= 1 else None


def read_manifest(uri: str | Location) -> Manifest:
    """Read and validate a published dataset's manifest; refuses uncommitted datasets and
    directories that are not shardtrain datasets at all."""
    loc = uri if isinstance(uri, Location) else resolve(uri)
    with storage_errors("reading the dataset manifest", loc.uri):
        _require_dataset(loc)
        try:
            data = _manifest_record(loc)
        except FileNotFoundError:
            raise DatasetError(f"{loc.uri}: committed but has no {MANIFEST_NAME}; it is not a shardtrain dataset "
                               "(give the path of a dataset published by `shardtrain shard`)") from None
    return Manifest(data, loc)


def _manifest_record(loc: Location) -> dict:
    """``_manifest.json`` parsed: a JSON object, or a DatasetError (exit 2) naming the file and
    what is wrong with it (not UTF-8 text, not JSON, not an object)."""
    where = f"{loc.uri}/{MANIFEST_NAME}"
    with loc.open(MANIFEST_NAME, "rb") as fh:
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{where}: not UTF-8 text (byte {exc.start}); the manifest is damaged: re-run the shard "
                           "job") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise DatasetError(f"{where}: not valid JSON ({exc}); the manifest is damaged: re-run the shard job") from None
    if not isinstance(data, dict):
        raise DatasetError(f"{where}: holds a JSON {type(data).__name__}, not the manifest's object; the manifest is "
                           "damaged: re-run the shard job")
    return data


def _require_dataset(loc: Location) -> None:
    fs = loc.fs
    if fs.exists(loc.path) and not fs.isdir(loc.path):
        raise DatasetError(f"{loc.uri} is a file, not a shardtrain dataset (a directory published by "
                           "`shardtrain shard`)")
    if fs.isdir(loc.path) and not fs.exists(f"{loc.path}/{MANIFEST_NAME}") and not is_committed(loc):
        raise DatasetError(f"{loc.uri} is not a shardtrain dataset (it has no {MANIFEST_NAME} and no _COMMITTED "
                           "marker; raw Parquet goes in a shard config's sources, and training reads the "
                           "dataset `shardtrain shard` publishes)")
    try:
        require_committed(loc, "dataset")
    except StorageError as exc:
        raise DatasetError(str(exc)) from None


def _file_entry(f: dict) -> FileEntry:
    return FileEntry(path=f["path"], rows=int(f["rows"]), row_groups=tuple(f["row_groups"]),
                     bytes=int(f["bytes"]), sha256=f["sha256"])




def validate_manifest(data: dict, where: str) -> None:
    """Everything a reader relies on, checked before anything else reads the dataset; a
    DatasetError names the manifest (``where``) and the field."""
    if data.get("format") != FORMAT:
        raise DatasetError(f"{where}: field 'format' is {data.get('format')!r}, expected {FORMAT!r}")
    version = data.get("format_version")
    if version not in READABLE_VERSIONS:
        raise DatasetError(
            f"{where}: field 'format_version' is {version!r}; this shardtrain reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}. Re-shard the data with this version of shardtrain")
    for key in ("schema", "features", "label", "splits", "fingerprint"):
        if key not in data:
            raise DatasetError(f"{where}: required field {key!r} is missing")
    _validate_schema(data["schema"], where)
    _validate_label(data["label"], where)
    _validate_features(data["features"], version, where)
    if data.get("row_index_column", ROW_INDEX) != ROW_INDEX:
        raise DatasetError(f"{where}: field 'row_index_column' is {data['row_index_column']!r}, expected {ROW_INDEX!r}")
    stored = {col["name"] for col in data["schema"]}
    feature_names = [f.get("name") for f in _listed(data["features"])]
    missing = [name for name in [*feature_names, data["label"]["name"], ROW_INDEX] if name not in stored]
    if missing:
        raise DatasetError(f"{where}: field 'schema' lacks column(s) {missing} that 'features'/'label' name")
    if data.get("teacher") is not None:
        _validate_teacher(data["teacher"], data["schema"], where)
    transfer = data["label"].get("train_transfer_rows", 0)
    if not isinstance(transfer, int) or transfer < 0:
        raise DatasetError(f"{where}: field 'label.train_transfer_rows' is {transfer!r}; expected an integer >= 0")
    if transfer and data.get("teacher") is None:
        raise DatasetError(f"{where}: field 'label.train_transfer_rows' is {transfer}, but there is no field "
                           "'teacher': rows without a label need the teacher's soft targets")
    _validate_splits(data["splits"], where)
    quarantine = data.get("quarantine") or {}
    for i, entry in enumerate(quarantine.get("files") or []):
        _validate_file_path(entry.get("path") if isinstance(entry, dict) else None,
                            f"{where}: field 'quarantine.files[{i}].path'")


def _validate_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, list) or not schema:
        raise DatasetError(f"{where}: field 'schema' must be a non-empty list of columns")
    for i, col in enumerate(schema):
        name = col.get("name") if isinstance(col, dict) else None
        if not name:
            raise DatasetError(f"{where}: field 'schema[{i}].name' is missing")
        if col.get("dtype") not in DTYPES:
            raise DatasetError(f"{where}: field 'schema[{name}].dtype' is {col.get('dtype')!r}; "
                               f"expected one of {', '.join(DTYPES)}")
        shape = col.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d > 0 for d in shape):
            raise DatasetError(f"{where}: field 'schema[{name}].shape' is {shape!r}; expected a list of positive integers")


def _validate_label(label: Any, where: str) -> None:
    if not isinstance(label, dict) or not label.get("name"):
        raise DatasetError(f"{where}: field 'label.name' is missing")
    task = record_task(label, "label", where)
    if task.classes:
        num_classes = label.get("num_classes")
        if not isinstance(num_classes, int) or num_classes < 2:
            raise DatasetError(f"{where}: field 'label.num_classes' is {num_classes!r}; {task.name} needs >= 2")
        _validate_classes(label, "label", where)
    threshold = label.get("threshold", DEFAULT_THRESHOLD)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < 1:
        raise DatasetError(f"{where}: field 'label.threshold' is {threshold!r}; expected a probability in (0, 1)")


def _validate_classes(record: dict, section: str, where: str) -> None:
    """A label's or teacher's class names (``common.tasks.class_list_problem``), where it has them."""
    problem = class_list_problem(record.get("classes"), record.get("num_classes"))
    if problem is not None:
        raise DatasetError(f"{where}: field '{section}.classes' {problem}")


def record_task(record: dict, section: str, where: str) -> LabelTask:
    """The task a label or teacher record names (``common.tasks``); a DatasetError if none."""
    task = record.get("task")
    if task not in LABEL_TASKS:
        raise DatasetError(f"{where}: field '{section}.task' is {task!r}; expected {task_names()}")
    return label_task(task)


def _validate_features(features: Any, version: int, where: str) -> None:
    """The features record: by kind in version 1, an ordered list of records naming their kind since."""
    if version == 1 and not isinstance(features, dict) or version != 1 and not isinstance(features, list):
        raise DatasetError(f"{where}: field 'features' must be a {'mapping' if version == 1 else 'list'} of "
                           f"feature records (format_version {version}), got {type(features).__name__}")
    records = _listed(features)
    if not records:
        raise DatasetError(f"{where}: field 'features' declares no feature columns")
    names = {kind.name: kind for kind in KINDS}
    for record in records:
        kind = names.get(record.get(KIND)) if isinstance(record, dict) else None
        if kind is None:
            raise DatasetError(f"{where}: field 'features[{_record_name(record)}].kind' is "
                               f"{record.get(KIND) if isinstance(record, dict) else None!r}; expected one of {sorted(names)}")
        kind.check_record(record, where)
        share = record.get(NULL_SHARE, 0.0)  # optional: absent from manifests written before
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise DatasetError(f"{where}: field 'features.{kind.name}[{record.get('name')}].{NULL_SHARE}' is "
                               f"{share!r}; expected a fraction in [0, 1]")


def _record_name(record: Any) -> Any:
    return record.get("name") if isinstance(record, dict) else record


def _listed(features: Any) -> list:
    """A features record (or a teacher's) as the ordered list, whichever version wrote it."""
    return listed(features) if isinstance(features, dict) else list(features or [])


def _validate_teacher(teacher: Any, schema: list[dict], where: str) -> None:
    """The teacher record, and the stored soft-target column it describes."""
    if not isinstance(teacher, dict):
        raise DatasetError(f"{where}: field 'teacher' must be a mapping, got {type(teacher).__name__}")
    for key in ("uri", "fingerprint"):
        if not isinstance(teacher.get(key), str) or not teacher[key]:
            raise DatasetError(f"{where}: field 'teacher.{key}' is {teacher.get(key)!r}; expected a non-empty string")
    temperature = teacher.get("temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
        raise DatasetError(f"{where}: field 'teacher.temperature' is {temperature!r}; expected a number > 0")
    if teacher.get("column") != TEACHER_COLUMN:
        raise DatasetError(f"{where}: field 'teacher.column' is {teacher.get('column')!r}, expected {TEACHER_COLUMN!r}")
    if not isinstance(teacher.get("features"), (dict, list)):
        raise DatasetError(f"{where}: field 'teacher.features' is missing (the raw columns the teacher reads)")
    shape = teacher_shape(teacher, where)
    _validate_classes(teacher, "teacher", where)
    column = next((c for c in schema if c["name"] == TEACHER_COLUMN), None)
    if column is None or column["dtype"] != "float32" or column["shape"] != shape:
        raise DatasetError(f"{where}: field 'schema' must hold column {TEACHER_COLUMN!r} as float32 of shape {shape} "
                           f"(what field 'teacher' describes), but has {column}")


def teacher_shape(teacher: dict, where: str = "the manifest being built") -> list[int]:
    """The stored soft-target column's shape: [num_classes] (probabilities) or [] (a value)."""
    task = record_task(teacher, "teacher", where)
    num_classes = teacher.get("num_classes")
    if task.classes and (isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2):
        raise DatasetError(f"{where}: field 'teacher.num_classes' is {num_classes!r}; a {task.name} teacher "
                           "needs >= 2")
    return list(task.output_shape(num_classes))


def teacher_differences(teacher: TeacherRecord, features: dict, label: LabelSpec) -> list[str]:
    """How a teacher record's task, classes and features differ from a dataset's ``features`` spec
    (the manifest's own field, or the same shape of dict) and label; [] when it fits. The order of
    features does not matter: the teacher reads its columns by name."""
    found = []
    if teacher.task != label.task:
        found.append(f"task is {teacher.task!r}, but the dataset's label.task is {label.task!r}")
    elif label.classification and teacher.num_classes != label.num_classes:
        found.append(f"num_classes is {teacher.num_classes}, but the dataset's label.num_classes is "
                     f"{label.num_classes}")
    elif label.classification and teacher.classes != label.classes:  # the same number of other classes
        found.append(f"classes are {_listed_or_none(teacher.classes)}, but the dataset's label.classes are "
                     f"{_listed_or_none(label.classes)}")
    ours = FeatureSpec(features).teacher_features()
    for kind in KINDS:
        theirs = kind.teacher_names([e for e in teacher.features if e.get(KIND) == kind.name])
        mine = kind.teacher_names([e for e in ours if e[KIND] == kind.name])
        if theirs != mine:
            found.append(f"{kind.name} features are {_shown(theirs)}, but the dataset's are {_shown(mine)}")
    return found


def _listed_or_none(classes: tuple[str, ...] | None) -> list[str] | None:
    return None if classes is None else list(classes)


def _shown(names: dict) -> Any:
    """A kind's teacher entries as a message shows them: sorted names, or {name: shape}."""
    return sorted(names) if all(v is None for v in names.values()) else names


def _validate_splits(splits: Any, where: str) -> None:
    if not isinstance(splits, dict) or not splits:
        raise DatasetError(f"{where}: field 'splits' must name at least one split")
    for split, info in splits.items():
        for key in ("rows", "files"):
            if key not in info:
                raise DatasetError(f"{where}: field 'splits.{split}.{key}' is missing")
        for i, entry in enumerate(info["files"]):
            for key in ("path", "rows", "row_groups", "bytes", "sha256"):
                if key not in entry:
                    raise DatasetError(f"{where}: field 'splits.{split}.files[{i}].{key}' is missing")
            _validate_file_path(entry["path"], f"{where}: field 'splits.{split}.files[{i}].path'")
            if sum(entry["row_groups"]) != entry["rows"]:
                raise DatasetError(f"{where}: field 'splits.{split}.files[{i}].row_groups' adds up to "
                                   f"{sum(entry['row_groups'])}, not its 'rows' ({entry['rows']})")
        if sum(int(e["rows"]) for e in info["files"]) != int(info["rows"]):
            raise DatasetError(f"{where}: field 'splits.{split}.rows' is {info['rows']}, but its files hold "
                               f"{sum(int(e['rows']) for e in info['files'])} rows")


def _validate_file_path(path: Any, field: str) -> None:
    """Files are named relative to the dataset root and stay inside it: a manifest must never
    send a reader to another dataset or anywhere else on the file system."""
    if not isinstance(path, str) or not path:
        raise DatasetError(f"{field} is {path!r}; expected a path relative to the dataset")
    if path.startswith("/") or "://" in path or ":" in path.split("/", 1)[0]:
        raise DatasetError(f"{field} is {path!r}, an absolute path or URI; a manifest names its files relative to "
                           "the dataset root")
    parts = path.split("/")
    if any(part in ("..", ".", "") for part in parts) or "\\" in path:
        raise DatasetError(f"{field} is {path!r}; a manifest's file paths must stay inside the dataset (no '..', "
                           "'.' or empty parts)")
