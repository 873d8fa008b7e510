"""What a feature kind is: one ``FeatureKind`` subclass per kind of column (``common.features``
registers them), owning everything about that kind that more than one stage needs.

An instance holds one dataset's (or model's) features of that kind: their manifest records, in
order, as the shard job fitted them on the train split. The class answers what needs no records
(the manifest section's name, a record's checks); the instance answers, for its features:

* the manifest: a record's checks (``check_record``), the stored columns (``stored_columns``), the
  contract a teacher records (``contract`` / ``teacher_names``);
* the row rules on a pandas or Arrow frame (``frame_checks``; the Spark SQL forms are the shard
  job's and scoring's, built from the same ``common.rows`` rules);
* serving: raw values to the encoded arrays training saw (``encode_column``, ``batch``), whole
  columns at once;
* the model input: the batch entries a network receives (``batch_keys``), a probe batch that
  exercises every input (``probe``), the MLflow signature's columns (``signature_columns``);
* what ``inspect`` says (``summary_part``, ``detail_lines``).

The code that uses kinds loops over ``common.features.KINDS`` and never names one. A kind module
imports numpy at most at import time; pyarrow, pandas, pyspark and mlflow inside the method that
needs them (driver code imports this without them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np

from common.errors import DatasetError


# A record's files (``files``: [{"path", "sha256"}], relative to the dataset or model root) are its
# kind's side files (a tokenizer); while the shard job runs, the record also holds their text under
# FILE_TEXTS ({path: text}), which the job writes beside the manifest and drops from it.
FILES = "files"
FILE_TEXTS = "_file_texts"


def typed_name(prefix: str, name: str) -> str:
    return prefix + name.replace("%", "%25").replace("`", "%60").replace(".", "%2E")


@dataclass
class TrainSummary:
    """What the shard job's one scan of the train split's clean rows gives the kinds' ``fit``:
    exact moments (count, mean, m2) and value counts by feature (None: too many distinct values
    to count on the driver), and ``frame()``, those rows as a DataFrame (made only when called)."""
    moments: dict[str, tuple[int, float, float]]
    value_counts: dict[str, dict[str, int] | None]
    frame: Callable[[], Any]


@dataclass(frozen=True)
class BatchEntry:
    """One entry of the batch a network receives, and the stored columns it is read from: with
    ``shape`` () the scalar ``columns`` side by side as [rows, len(columns)]; otherwise the one
    list column in ``columns`` as [rows, *shape]. ``dtype`` is the entry's numpy dtype.
    ``decode``: where the one stored column holds encoded values (an image's bytes), the picklable
    function (a ``functools.partial`` of a module-level function) turning one stored value into
    the entry's row, of ``shape`` and ``dtype``.

    ``ragged``: the list column's rows hold 0 to shape[0] values (token ids): the entry is
    [rows, L], padded with ``pad`` to the batch's longest row (L rounded up to the loader's
    pad multiple), and the batch holds its mask, True where a value is, under ``key + MASK_SUFFIX``."""
    key: str
    columns: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...] = ()
    ragged: bool = False
    pad: int = 0
    decode: Callable[[Any], np.ndarray] | None = None


MASK_SUFFIX = "#mask"  # a ragged entry's mask in a batch (a reserved suffix: no feature name ends with it)


def padded(rows: list, pad: int, multiple: int = 1, dtype="int64") -> tuple[np.ndarray, np.ndarray]:
    """Ragged rows (sequences of ids) as ([n, L] padded with ``pad``, [n, L] bool mask), L the
    longest row (at least 1) rounded up to ``multiple``."""
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    width = max(int(lengths.max()) if len(rows) else 0, 1)
    width = -(-width // multiple) * multiple
    mask = np.arange(width)[None, :] < lengths[:, None]
    ids = np.full((len(rows), width), pad, dtype=dtype)
    if len(rows) and lengths.sum():
        ids[mask] = np.concatenate([np.asarray(r, dtype=dtype) for r in rows if len(r)])
    return ids, mask


def stacked_scalars(table: Any, names: list[str], n: int, dtype) -> np.ndarray:
    """Scalar stored columns of an Arrow table side by side: [n, len(names)] of ``dtype``."""
    if not names:
        return np.zeros((n, 0), dtype=dtype)
    return np.stack([table.column(name).to_numpy().astype(dtype, copy=False) for name in names], axis=1)


class FeatureKind:
    """One kind of feature column. Subclasses set ``name`` (the manifest's section and the shard
    config's key under ``features``), ``text`` (whether a raw value may be text, so the
    ``bad_encoding`` rule applies) and ``required`` (the keys every record holds)."""

    name: ClassVar[str]
    text: ClassVar[bool] = False
    required: ClassVar[tuple[str, ...]] = ("name",)

    def __init__(self, records: list[dict], max_category_bytes: int):
        self.attached: dict[str, str] = {}  # the records' side files' text, by path (FeatureSpec.attach)
        self.records = list(records)
        self.names = [r["name"] for r in self.records]
        self.max_category_bytes = max_category_bytes

    # --- the shard job: config, typing, statistics fitted on the train split ---------------------

    typed_prefix: ClassVar[str]  # the typed copy's column name is this + the feature's (escaped) name
    # The shard config's keys under ``features`` this kind owns: its own (``name``: which columns,
    # of type ``columns_type``, empty by default), then ``options``: (key, type, default, help).
    columns_type: ClassVar[Any] = list[str]
    columns_help: ClassVar[str] = ""
    options: ClassVar[tuple[tuple[str, Any, Any, str], ...]] = ()

    @classmethod
    def check_config(cls, features_cfg) -> None:
        """This kind's checks of its keys (``common.config.require``: a ConfigError naming the key)."""

    @staticmethod
    def config_key(name: str) -> str:
        """The shard config key that declares feature ``name`` (what a message names)."""
        raise NotImplementedError

    @staticmethod
    def spark_type_ok(dtype, stored: bool = False) -> bool:
        """Whether a Spark column of ``dtype`` can be typed as this kind's raw value (``stored``:
        as its stored value, when scoring an already-encoded table)."""
        raise NotImplementedError

    @staticmethod
    def wanted(stored: bool = False) -> str:
        """What ``spark_type_ok`` wants, as a message says it."""
        raise NotImplementedError

    def sql_reasons(self, name: str, dtype, stored: bool = False) -> list[str]:
        """The row rules of feature ``name`` (a column of Spark type ``dtype``) as SQL CASE branches,
        in order (``stored``: the checks of a stored value instead)."""
        raise NotImplementedError

    @staticmethod
    def typed_sql(name: str, stored: bool = False) -> str:
        """SQL typing feature ``name``'s raw value (``stored``: its stored value) as the kind takes it."""
        raise NotImplementedError

    @classmethod
    def configured(cls, features_cfg) -> list[dict]:
        """This kind's features in the shard config (its ``features.<name>`` list), as records
        without statistics."""
        return [{"name": name} for name in getattr(features_cfg, cls.name)]

    def typed(self, name: str) -> str:
        """The column holding a feature's typed value in the shard job's checked rows. SQL names
        it through quote_identifier, like every other column; the name itself is escaped where
        Spark's DataFrame API would parse it (a backtick, a dot: pyspark's mapInArrow looks its
        input columns up by name), so a feature may be called "price-usd" or "first name"."""
        return typed_name(self.typed_prefix, name)

    def prepared(self, frame: Any, store: bool) -> Any:
        """``frame`` (a Spark DataFrame of raw columns) with the columns this kind's SQL row rules
        and typing read besides the raw ones, where they need a Python stage (decoding an image):
        the shard job (``store``: what it stores too) and scoring run it before the rules. The
        frame itself where the kind needs none (the default)."""
        return frame

    def prepared_columns(self) -> list[str]:
        """The columns ``prepared`` adds (none by default): not part of a row's raw text."""
        return []

    def raw_sql(self, name: str) -> str:
        """What a quarantined row's raw text holds for feature ``name``'s column (SQL): the value
        itself by default; a kind whose values are large keeps less (an image: its length)."""
        from common.sql import quote_identifier

        return quote_identifier(name)

    @classmethod
    def input_files(cls, features_cfg) -> dict[str, str]:
        """Files besides the sources that this kind's output is a function of, as {config key: URI}
        (a tokenizer given as a file): the shard job's input fingerprint holds their sha256, so a
        file changed at the same URI is a new input (``output.mode: skip_if_exists`` does not skip)."""
        return {}

    @classmethod
    def fits_before_rows(cls, features_cfg) -> bool:
        """Whether a row rule of this kind needs something fitted on the train split first (a
        tokenizer): then the shard job calls ``fit_before_rows`` before its pass over the rows."""
        return False

    @classmethod
    def fit_before_rows(cls, features_cfg, clean_train, seed: int) -> None:
        """Fit what the row rules need on ``clean_train`` (a Spark DataFrame of the train split's
        rows that pass every rule, typed), leaving it on ``features_cfg`` for ``configured``."""

    def moment_columns(self) -> list[tuple[str, str]]:
        """(feature, typed column) whose exact train moments ``fit`` needs (pipelines/summary.py)."""
        return []

    def counted_columns(self) -> list[tuple[str, str]]:
        """(feature, typed column) whose train value counts ``fit`` needs (pipelines/summary.py)."""
        return []

    def fit(self, features_cfg, train: "TrainSummary") -> list[dict]:
        """The manifest records of these features, fitted on the train split's clean rows."""
        return [dict(r) for r in self.records]

    # --- the manifest ---------------------------------------------------------------------------

    @classmethod
    def check_record(cls, record: dict, where: str) -> None:
        """A DatasetError naming ``where`` and the field when ``record`` lacks what readers use."""
        for key in cls.required:
            if key not in record:
                raise DatasetError(f"{where}: field 'features.{cls.name}[{record.get('name')}].{key}' is missing")

    def stored_columns(self) -> list[dict]:
        """The stored column of each feature, in order: {"name", "dtype", "shape"}."""
        raise NotImplementedError

    def contract(self, record: dict) -> dict:
        """What a reader of this feature's raw column must match (a teacher record lists it)."""
        return {"name": record["name"]}

    def input_entry(self) -> Any:
        """model.json's ``inputs`` entry for these features (the columns, as the network takes them)."""
        return list(self.names)

    @classmethod
    def teacher_names(cls, entries: list) -> dict:
        """Contracts (``contract``) as {name: what else must match}, for a message."""
        return {e["name"]: None for e in entries}

    # --- row rules on a frame -------------------------------------------------------------------

    def frame_checks(self, columns: dict, n: int) -> list[tuple[str, str, np.ndarray]]:
        """(reason, column, mask) for each rule of each feature, in rule order (common.rows)."""
        return []

    # --- serving and the model input ------------------------------------------------------------

    def encode_column(self, name: str, values: Any) -> np.ndarray:
        """One feature's raw values (an Arrow or pandas column) as stored in the dataset."""
        raise NotImplementedError

    def stored_values(self, name: str, values: Any) -> Any:
        """One feature's typed values (an Arrow column, as the shard job's SQL typed them) as the
        shard writer stores them."""
        return self.encode_column(name, values)

    def batch_layout(self) -> list[BatchEntry]:
        """The batch entries these features give, and the stored columns each is read from: what
        training's loader converts stored rows by (training/columns.py)."""
        raise NotImplementedError

    def stored_batch(self, table: Any, n: int) -> dict[str, np.ndarray]:
        """The batch entries of ``n`` stored rows (an Arrow table of the dataset's columns), as
        ``batch_layout`` lays them out (scoring an already-encoded table; training's loader
        converts by the same layout, with its shuffling and memory reuse: training/columns.py)."""
        out = {}
        for entry in self.batch_layout():
            if entry.decode is not None:
                values = table.column(entry.columns[0]).to_pylist()
                out[entry.key] = (np.stack([entry.decode(v) for v in values]).astype(entry.dtype, copy=False)
                                  if values else np.zeros((0, *entry.shape), dtype=entry.dtype))
                continue
            if not entry.shape:
                out[entry.key] = stacked_scalars(table, list(entry.columns), n, np.dtype(entry.dtype))
                continue
            flat = table.column(entry.columns[0]).combine_chunks().flatten().to_numpy(zero_copy_only=False)
            out[entry.key] = flat.astype(entry.dtype, copy=False).reshape((n, *entry.shape))
        return out

    def batch(self, frame: Any, n: int) -> dict[str, np.ndarray]:
        """The batch entries these features give for ``n`` raw rows of ``frame``."""
        raise NotImplementedError

    def batch_keys(self) -> list[str]:
        """The keys of the batch entries these features give (none when there are no features of
        the kind, except where a network always takes the entry)."""
        raise NotImplementedError

    def probe(self, rows: int) -> dict[str, np.ndarray]:
        """``rows`` rows of the batch entries (zeros, and for a lookup its largest index in the
        last row), for checking that a network takes these inputs."""
        raise NotImplementedError

    def signature_columns(self) -> list:
        """The MLflow signature's ColSpec of each feature's raw column."""
        raise NotImplementedError

    def raw_example(self, name: str, stored: Any) -> Any:
        """A feature's stored values (an Arrow column) back as raw ones: an MLflow input example."""
        raise NotImplementedError

    # --- inspect --------------------------------------------------------------------------------

    def summary_part(self) -> str:
        """This kind's part of ``inspect``'s one-line feature summary."""
        return f"{len(self.names)} {self.name}"

    def detail_lines(self) -> list[str]:
        """``inspect``'s lines under the summary, one per feature that has something to say."""
        return []

    def html_table(self):
        """``inspect --html``'s table of these features, or None where there are none."""
        return None

    # Whether ``inspect --html`` reads a few stored rows for ``html_samples`` (the one report part
    # that reads data files): only a kind whose values are worth seeing (images) sets it.
    shows_samples: ClassVar[bool] = False

    def html_samples(self, table: Any, labels: list) -> list[str]:
        """``inspect --html``'s samples of these features: HTML parts from ``table`` (an Arrow table
        of stored train rows) and each row's class name (``labels``, None for regression)."""
        return []


class ScalarColumns(FeatureKind):
    """A kind whose features are each one scalar column, side by side in one batch entry named after
    the kind: [rows, features] of ``batch_dtype``, there even with no features of the kind (the
    built-in networks always take it)."""

    batch_dtype: ClassVar[str]

    def batch_layout(self) -> list[BatchEntry]:
        return [BatchEntry(self.name, tuple(self.names), self.batch_dtype)]

    def batch(self, frame: Any, n: int) -> dict[str, np.ndarray]:
        matrix = np.zeros((n, len(self.names)), dtype=self.batch_dtype)
        for j, name in enumerate(self.names):
            matrix[:, j] = self.encode_column(name, frame[name])
        return {self.name: matrix}

    def batch_keys(self) -> list[str]:
        return [self.name]

    def probe(self, rows: int) -> dict[str, np.ndarray]:
        return {self.name: np.zeros((rows, len(self.names)), dtype=self.batch_dtype)}
