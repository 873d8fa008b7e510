"""Categorical features: a category per row, stored as an int32 index into a vocabulary.

The shard job fits each one's vocabulary on the train split's clean rows: the values seen at
least ``features.min_count`` times, most frequent first, ties by value, at most
``features.max_vocab`` of them (pipelines/summary.py counts them; pipelines/preprocess.py ranks a
column with too many distinct values by a Spark aggregation). Index 0 is a null, 1 a value
outside the vocabulary (unseen), and the vocabulary's i-th value is 2 + i; ``num_embeddings`` is
the vocabulary's length + 2. The network receives all categorical features of a row as one
int64 matrix under ``batch["categorical"]``, in manifest order.

Row rules (``common.rows``): ``too_long:<col>`` (more UTF-8 bytes than the shard job's
``features.max_category_bytes``); null and unseen values are no reason (they have their
indices). Spark types the raw value as STRING (a boolean as 'true'/'false'); a raw value may be
text, so ``bad_encoding`` applies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from common.config import require
from common.errors import DatasetError
from common.features.base import ScalarColumns
from common.rows import MAX_CATEGORY_BYTES, each, is_missing, mask, reason, reason_text
from common.sql import quote_identifier as q

NULL_INDEX = 0
UNSEEN_INDEX = 1
RESERVED_INDICES = 2
UNSEEN_EXAMPLE = "<unseen category>"  # a word outside every vocabulary: index UNSEEN_INDEX
MAX_VOCAB = 10_000_000  # entries of one vocabulary, each stored in the manifest: a typo fails at once
# No number's string form is longer (an int64 has 20 characters, a float64's repr at most 24).
_NUMBER_FORM_BYTES = 32


class Categorical(ScalarColumns):
    name = "categorical"
    batch_dtype = "int64"
    text = True
    required = ("name", "vocab")
    typed_prefix = "_c_"
    columns_help = ("columns read as categories, stored as int32 indices into a vocabulary fitted on train in "
                    "frequency order (0: null, 1: a value not in the vocabulary)")
    options = (("max_vocab", int, 100_000, "the most values a vocabulary keeps (the most frequent on train)"),
               ("min_count", int, 1, "the fewest train rows a value needs to enter the vocabulary"),
               # Such values are almost always a broken record, and each vocabulary entry lives in the manifest.
               ("max_category_bytes", int, 1024, "a longer category (UTF-8 bytes) is quarantined as too_long:<column>"))

    def __init__(self, records: list[dict], max_category_bytes: int):
        super().__init__(records, max_category_bytes)
        self._vocab = {r["name"]: {v: i + RESERVED_INDICES for i, v in enumerate(r.get("vocab", []))}
                       for r in self.records}  # no vocabulary before the shard job fits one

    @classmethod
    def check_record(cls, record: dict, where: str) -> None:
        if not isinstance(record.get("vocab"), list):
            raise DatasetError(f"{where}: field 'features.categorical[{record.get('name')}].vocab' is missing")

    def num_embeddings(self, name: str) -> int:
        return len(self._vocab[name]) + RESERVED_INDICES

    # --- the shard config and Spark -------------------------------------------------------------

    @classmethod
    def check_config(cls, features_cfg) -> None:
        require(1 <= features_cfg.max_vocab <= MAX_VOCAB, "max_vocab",
                f"must be in [1, {MAX_VOCAB:,}], got {features_cfg.max_vocab}")
        require(features_cfg.min_count >= 1, "min_count", "must be >= 1")
        require(1 <= features_cfg.max_category_bytes <= MAX_CATEGORY_BYTES, "max_category_bytes",
                f"must be in [1, {MAX_CATEGORY_BYTES:,}], got {features_cfg.max_category_bytes}")

    @staticmethod
    def config_key(name: str) -> str:
        return "features.categorical"

    @staticmethod
    def spark_type_ok(dtype, stored: bool = False) -> bool:
        from pyspark.sql import types as T

        if stored:
            return isinstance(dtype, T.IntegralType)
        return isinstance(dtype, T.AtomicType) and not isinstance(dtype, T.BinaryType)

    @staticmethod
    def wanted(stored: bool = False) -> str:
        return "a category index" if stored else "a category (string)"

    def counted_columns(self) -> list[tuple[str, str]]:
        return [(name, self.typed(name)) for name in self.names]

    def fit(self, features_cfg, train) -> list[dict]:
        """Each feature's vocabulary from the scan's value counts; one the scan left uncounted (too
        many distinct values) is ranked by a Spark aggregation over the train rows instead."""
        min_count, max_vocab = features_cfg.min_count, features_cfg.max_vocab
        vocabularies = {name: top_values(counts, min_count, max_vocab)
                        for name, counts in train.value_counts.items() if counts is not None and name in self.names}
        wide = [name for name in self.names if name not in vocabularies]
        if wide:
            vocabularies.update(self.spark_vocabularies(train.frame(), wide, min_count, max_vocab))
        return [{"name": name, "vocab": vocabularies[name], "num_embeddings": len(vocabularies[name]) + RESERVED_INDICES}
                for name in self.names]

    def spark_vocabularies(self, clean_train, names: list[str], min_count: int, max_vocab: int) -> dict[str, list[str]]:
        """Vocabularies of ``names`` by one Spark aggregation (``spark_top_values``): for features
        with too many distinct values to count on the driver."""
        return spark_top_values(clean_train, {name: self.typed(name) for name in names}, min_count, max_vocab)

    def sql_reasons(self, name: str, dtype, stored: bool = False) -> list[str]:
        """A value longer than the shard job took (almost always a broken record; each vocabulary
        entry lives in the manifest); a stored index outside the vocabulary's."""
        if stored:
            return [f"WHEN {q(name)} IS NULL OR {q(name)} < 0 OR {q(name)} >= {self.num_embeddings(name)} "
                    f"THEN {reason('bad_value', name)}"]
        return [f"WHEN octet_length(CAST({q(name)} AS STRING)) > {int(self.max_category_bytes)} "
                f"THEN {reason('too_long', name)}"]

    @staticmethod
    def typed_sql(name: str, stored: bool = False) -> str:
        return f"CAST({q(name)} AS INT)" if stored else f"CAST({q(name)} AS STRING)"

    # --- the manifest ---------------------------------------------------------------------------

    def stored_columns(self) -> list[dict]:
        return [{"name": name, "dtype": "int32", "shape": []} for name in self.names]

    # --- row rules on a frame -------------------------------------------------------------------

    def frame_checks(self, columns: dict, n: int) -> list[tuple[str, str, np.ndarray]]:
        return [(reason_text("too_long", name), name, _too_long(columns[name], n, self.max_category_bytes))
                for name in self.names]

    # --- serving and the model input ------------------------------------------------------------

    def encode_column(self, name: str, values: Any) -> np.ndarray:
        """int64 codes: a null is NULL_INDEX, a value outside the vocabulary UNSEEN_INDEX, the
        vocabulary's i-th value RESERVED_INDICES + i. Arrow string arrays (what Spark's string
        casts give) are looked up at once; other values one by one, as their string forms."""
        import pyarrow as pa

        values = _arrow_strings(values)
        if isinstance(values, (pa.Array, pa.ChunkedArray)) and (pa.types.is_string(values.type)
                                                                or pa.types.is_large_string(values.type)):
            return self._encode_arrow_strings(name, values)
        if isinstance(values, _PandasStrings):
            return self._encode_pandas_strings(name, values)
        return self._encode_each(name, values)

    def _encode_each(self, name: str, values: Any) -> np.ndarray:
        """Value by value, as their string forms."""
        import pyarrow as pa

        if isinstance(values, (pa.Array, pa.ChunkedArray)):
            values = values.to_pylist()
        vocab = self._vocab[name]
        return np.array([NULL_INDEX if _is_null(v) else _lookup(vocab, v) for v in values], dtype=np.int64)

    def _encode_arrow_strings(self, name: str, values) -> np.ndarray:
        import pyarrow as pa
        import pyarrow.compute as pc

        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        # The dictionary's own codes, by position of its keys: the same code the dictionary
        # gives a value, even for a vocabulary listing one value twice (the later position wins).
        vocab = self._vocab[name]
        codes_of = np.array([UNSEEN_INDEX, *vocab.values()], dtype=np.int64)
        keys = pa.array(list(vocab), type=values.type)
        index = pc.fill_null(pc.index_in(values, value_set=keys), -1).to_numpy(zero_copy_only=False)
        codes = codes_of[index.astype(np.int64) + 1]
        codes[pc.is_null(values).to_numpy(zero_copy_only=False)] = NULL_INDEX
        return codes

    def _encode_pandas_strings(self, name: str, values: "_PandasStrings") -> np.ndarray:
        """A pandas column of strings and missing values: the strings looked up at once; each
        missing one (None, NaN, pd.NA, ...) coded as it would be on its own, one by one."""
        codes = self._encode_arrow_strings(name, values.arrow)
        gaps = np.flatnonzero(codes == NULL_INDEX)
        if len(gaps):
            codes[gaps] = self._encode_each(name, values.series.iloc[gaps])
        return codes

    def stored_values(self, name: str, values: Any) -> np.ndarray:
        return self.encode_column(name, values).astype(np.int32)

    def probe(self, rows: int) -> dict[str, np.ndarray]:
        matrix = super().probe(rows)[self.name]
        if rows:  # the largest index last: an embedding table smaller than the vocabulary fails on it
            matrix[-1] = [self.num_embeddings(name) - 1 for name in self.names]
        return {self.name: matrix}

    def signature_columns(self) -> list:
        from mlflow.types import ColSpec
        from mlflow.types.schema import AnyType

        return [ColSpec(AnyType(), name) for name in self.names]

    def raw_example(self, name: str, stored: Any) -> list:
        """Stored codes back as raw values (an MLflow input example); UNSEEN_EXAMPLE for an unseen one."""
        vocab = next(r["vocab"] for r in self.records if r["name"] == name)
        return [None if c == NULL_INDEX else vocab[c - RESERVED_INDICES] if c >= RESERVED_INDICES else UNSEEN_EXAMPLE
                for c in stored.to_numpy()]

    # --- inspect --------------------------------------------------------------------------------

    def detail_lines(self) -> list[str]:
        return [f"{r['name']}: vocabulary of {len(r['vocab'])} (+2 reserved: null, unseen)" for r in self.records]

    def html_table(self):
        from common.html_report import table

        if not self.records:
            return None
        return table(["categorical feature", "vocabulary", "embedding rows", "most frequent values"],
                     [[f["name"], len(f["vocab"]), f.get("num_embeddings"), ", ".join(map(str, f["vocab"][:8]))]
                      for f in self.records])


def top_values(counts: dict[str, int], min_count: int, max_vocab: int) -> list[str]:
    """The vocabulary from value counts: values seen at least ``min_count`` times, most frequent
    first, ties by value (the order of Spark's ``ORDER BY count DESC, value``: UTF-8 bytes order
    as code points do), at most ``max_vocab``."""
    kept = [(-n, v) for v, n in counts.items() if n >= min_count]
    kept.sort()
    return [v for _, v in kept[:max_vocab]]


def spark_top_values(frame, columns: dict[str, str], min_count: int, max_vocab: int) -> dict[str, list[str]]:
    """The top string values of each of ``frame``'s ``columns`` (name -> column) by one Spark
    aggregation, (column, value) -> count, then a window: the order of ``top_values`` (most
    frequent first, ties by value, at most max_vocab values seen at least min_count times), with
    nothing but those values collected. A label's classes are ranked by it too (pipelines/labels.py)."""
    from pyspark.sql import functions as F
    from pyspark.sql import Window

    stacked = [F.struct(F.lit(name).alias("column"), F.col(q(column)).alias("value"))
               for name, column in columns.items()]
    counts = (frame.select(F.explode(F.array(*stacked)).alias("e")).select("e.column", "e.value")
              .where(F.col("value").isNotNull()).groupBy("column", "value").count())
    rank = F.row_number().over(Window.partitionBy("column").orderBy(F.desc("count"), F.asc("value")))
    top = counts.where(F.col("count") >= min_count).withColumn("rank", rank).where(F.col("rank") <= max_vocab)
    ranked: dict[str, list[tuple[int, str]]] = {name: [] for name in columns}
    for row in top.collect():  # at most max_vocab values per column
        ranked[row["column"]].append((int(row["rank"]), row["value"]))
    return {name: [v for _, v in sorted(values)] for name, values in ranked.items()}


class _PandasStrings:
    """A pandas column whose non-missing values are all str, with its Arrow string array."""

    def __init__(self, series: Any, arrow: Any):
        self.series = series
        self.arrow = arrow


def _arrow_strings(column: Any) -> Any:
    """A categorical column as what ``encode_column`` looks up at once where that is exact: an
    Arrow column as it is; a pandas column of str and missing values as _PandasStrings; any other
    pandas column (numbers, booleans, mixed) as it is, for the value-by-value string forms."""
    import pyarrow as pa

    if isinstance(column, (pa.Array, pa.ChunkedArray, _PandasStrings)) or getattr(column, "dtype", None) is None:
        return column
    if column.dtype.kind not in "OSU" and str(column.dtype) not in ("string", "str"):
        return column
    try:
        arrow = pa.array(column, from_pandas=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
        return column
    if not pa.types.is_string(arrow.type) and not pa.types.is_large_string(arrow.type):
        return column  # e.g. an object column of ints: each takes its own string form
    return _PandasStrings(column, arrow)


def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, float) and np.isnan(value))


def _lookup(vocab: dict[str, int], value: Any) -> int:
    # Vocabularies hold strings (Spark casts the column to string). A pandas column of integers
    # with nulls arrives as floats, so 3.0 must also find "3".
    if isinstance(value, (bool, np.bool_)):
        value = "true" if value else "false"  # Spark's CAST(boolean AS STRING), not Python's str(True)
    index = vocab.get(str(value))
    if index is None and isinstance(value, (float, np.floating)) and float(value).is_integer():
        index = vocab.get(str(int(value)))
    return UNSEEN_INDEX if index is None else index


def _too_long(values, n: int, max_bytes: int) -> np.ndarray:
    """A categorical value of more UTF-8 bytes than ``max_bytes`` (a non-text value: its str form)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from common.rows import is_binary, is_text

    if is_text(values) or is_binary(values):
        return mask(pc.greater(pc.binary_length(values), max_bytes))
    if isinstance(values, pa.Array) and max_bytes >= _NUMBER_FORM_BYTES and (
            pa.types.is_integer(values.type) or pa.types.is_floating(values.type) or pa.types.is_boolean(values.type)):
        return np.zeros(n, dtype=bool)

    def too_long(v):
        if is_missing(v):
            return False
        data = bytes(v) if isinstance(v, (bytes, bytearray)) else str(v).encode("utf-8", "surrogatepass")
        return len(data) > max_bytes

    return each(values, n, too_long)
