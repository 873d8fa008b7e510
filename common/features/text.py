"""Text features: a string per row, stored as its token ids (``list<int32>``, one list per row:
the list's length is the row's token count) by a tokenizer the shard job fits on the train split.

Config (``features.text.<column>``, ``TextFeatureConfig``): the tokenizer, trained
(``tokenizer: {type: wordpiece | bpe | unigram, vocab_size, lowercase, fit_rows}``) or given
(``tokenizer: {file: URI of a tokenizer.json}``, used byte for byte), ``max_tokens``, ``truncate``
and ``on_null``.

Fitting happens before pass one (``fit_before_rows``), since a row rule depends on it
(``too_many_tokens``): a deterministic sample of at most ``fit_rows`` of the train split's clean
values (the rows with the smallest seeded hash of their text, streamed from the executors, never
the whole column) trains the tokenizer on one thread, and the same sample gives the token length
statistics the manifest records (``lengths``: percentiles, the share longer than max_tokens). Val
and test values are never seen.

The tokenizer's JSON is stored in the dataset beside the manifest (``_text/<column>/tokenizer.json``,
published with it) and listed in the record's ``files`` with its sha256 (``FeatureSpec.attach``
checks it on every read: a changed file is refused, named). During the shard job the record also
carries the JSON itself (``FILE_TEXTS``, dropped from the manifest), so that executors encode
without reading it back.

Row rules (``common.rows``): ``bad_encoding`` (the text rule), ``null_text:<col>`` with
``on_null: quarantine`` (else a null is an empty sequence), ``too_many_tokens:<col>`` with
``truncate: quarantine`` (Spark counts tokens with a pandas UDF over the same tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from common.config import require, setting, storage_path
from common.errors import DatasetError, InputDataError
from common.features.base import FILE_TEXTS, MASK_SUFFIX, BatchEntry, FeatureKind, padded
from common.rows import each, is_missing, mask, reason, reason_text
from common.sql import quote_identifier as q
from common.tokenizer import TOKENIZER_TYPES

MAX_TOKENS = 1 << 16  # the longest max_tokens: a typo fails at once
MAX_VOCAB_SIZE = 1 << 22
TEXT_DIR = "_text"


@dataclass
class TokenizerConfig:
    type: Literal[TOKENIZER_TYPES] | None = setting(
        "the tokenizer trained on the train split: `wordpiece`, `bpe` or `unigram`; null: wordpiece, unless `file` "
        "gives one", default=None)
    vocab_size: int = setting("a trained tokenizer's vocabulary size, its special tokens ([PAD], [UNK]) included",
                              default=16000)
    lowercase: bool = setting("a trained tokenizer lowercases text (after NFC normalization)", default=True)
    fit_rows: int = setting(
        "the most train rows a tokenizer is trained on (and the length statistics taken over): a deterministic "
        "sample, the rows with the smallest seeded hash of their text", default=1_000_000)
    file: str | None = storage_path(
        "instead of training one: the URI of a Hugging Face `tokenizer.json`, used byte for byte (stored in the "
        "dataset, recorded by its sha256); it must declare a pad token ([PAD], <pad> or its padding's)", default=None)

    def __post_init__(self):
        require(self.file is None or self.type is None, "type",
                "and tokenizer.file are exclusive: a file is used as it is; remove one")
        require(2 < self.vocab_size <= MAX_VOCAB_SIZE, "vocab_size",
                f"must be in (2, {MAX_VOCAB_SIZE:,}], got {self.vocab_size}")
        require(self.fit_rows >= 1, "fit_rows", f"must be >= 1, got {self.fit_rows}")


@dataclass
class TextFeatureConfig:
    tokenizer: TokenizerConfig = setting("how the column is tokenized", default_factory=TokenizerConfig)
    max_tokens: int = setting("the most token ids a row keeps (see `truncate`)", default=256)
    truncate: Literal["head", "tail", "quarantine"] = setting(
        "a longer row keeps its first (`head`) or last (`tail`) max_tokens tokens, or is quarantined "
        "(`quarantine`: `too_many_tokens:<column>`)", default="head")
    on_null: Literal["empty", "quarantine"] = setting(
        "a null value is an empty token sequence (`empty`) or quarantined (`quarantine`: `null_text:<column>`)",
        default="empty")

    def __post_init__(self):
        require(1 <= self.max_tokens <= MAX_TOKENS, "max_tokens", f"must be in [1, {MAX_TOKENS:,}], got {self.max_tokens}")


# What fit_before_rows leaves on a TextFeatureConfig (an attribute, not a config key: the recorded
# config stays the user's): the tokenizer JSON, its source and the sample's length statistics.
FITTED = "_fitted"


class Text(FeatureKind):
    name = "text"
    text = True
    required = ("name", "max_tokens", "truncate", "on_null", "vocab_size", "pad_id", "tokenizer", "files")
    typed_prefix = "_x_"
    columns_type = dict[str, TextFeatureConfig]
    columns_help = ("column -> its tokenizer and length rules: stored as token ids (a list of int32 per row) by a "
                    "tokenizer fitted on the train split (docs/guides/text.md)")

    def __init__(self, records: list[dict], max_category_bytes: int):
        super().__init__(records, max_category_bytes)
        self.by_name = {r["name"]: r for r in self.records}
        self._encoders: dict[str, Any] = {}

    @classmethod
    def check_config(cls, features_cfg) -> None:
        for name in features_cfg.text:
            require(not name.endswith(MASK_SUFFIX), f"text.{name}",
                    f"ends with {MASK_SUFFIX!r}, which a batch reserves for masks; rename the column in the query")

    @classmethod
    def check_record(cls, record: dict, where: str) -> None:
        super().check_record(record, where)
        for key in ("max_tokens", "vocab_size"):
            if not isinstance(record.get(key), int) or record[key] < 1:
                raise DatasetError(f"{where}: field 'features.text[{record.get('name')}].{key}' is {record.get(key)!r}")

    # --- the shard config and Spark -------------------------------------------------------------

    @classmethod
    def configured(cls, features_cfg) -> list[dict]:
        out = []
        for name, tcfg in features_cfg.text.items():
            record = {"name": name, "max_tokens": tcfg.max_tokens, "truncate": tcfg.truncate, "on_null": tcfg.on_null}
            fitted = getattr(tcfg, FITTED, None)
            if fitted is not None:
                record.update(_fitted_record(name, fitted))
            out.append(record)
        return out

    @staticmethod
    def config_key(name: str) -> str:
        return f"features.text.{name}"

    @staticmethod
    def spark_type_ok(dtype, stored: bool = False) -> bool:
        from pyspark.sql import types as T

        if stored:
            return isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, T.IntegralType)
        return isinstance(dtype, T.StringType)

    @staticmethod
    def wanted(stored: bool = False) -> str:
        return "token ids (array<int>)" if stored else "text (string)"

    @staticmethod
    def typed_sql(name: str, stored: bool = False) -> str:
        return f"CAST({q(name)} AS ARRAY<INT>)" if stored else f"CAST({q(name)} AS STRING)"

    def sql_reasons(self, name: str, dtype, stored: bool = False) -> list[str]:
        record = self.by_name[name]
        if stored:
            return [f"WHEN {q(name)} IS NULL OR size({q(name)}) > {int(record['max_tokens'])} "
                    f"OR array_max({q(name)}) >= {int(record['vocab_size'])} OR array_min({q(name)}) < 0 "
                    f"THEN {reason('bad_value', name)}"]
        reasons = []
        if record["on_null"] == "quarantine":
            reasons.append(f"WHEN {q(name)} IS NULL THEN {reason('null_text', name)}")
        if record["truncate"] == "quarantine" and "files" in record:  # the tokenizer is fitted: its counts
            udf = _token_count_function(self.tokenizer_json(name))
            reasons.append(f"WHEN {udf}({q(name)}) > {int(record['max_tokens'])} THEN {reason('too_many_tokens', name)}")
        return reasons

    @classmethod
    def fit_before_rows(cls, features_cfg, clean_train, seed: int) -> None:
        """Each text feature's tokenizer, fitted on (or read for) a sample of ``clean_train`` (the
        train split's rows that pass every rule not needing it), left on its config (``FITTED``)."""
        from common.tokenizer import TextEncoder, length_statistics, sha256_text, train_tokenizer

        for name, tcfg in features_cfg.text.items():
            typed = typed_text_column(name)
            sample = _sample(clean_train, typed, seed, tcfg.tokenizer.fit_rows)
            tok = tcfg.tokenizer
            if tok.file is not None:
                text = _read_tokenizer_file(tok.file, f"features.text.{name}.tokenizer.file")
                source = {"file": tok.file}
            else:
                text = train_tokenizer(iter(sample), tok.type or "wordpiece", tok.vocab_size, tok.lowercase)
                source = {"type": tok.type or "wordpiece", "vocab_size": tok.vocab_size, "lowercase": tok.lowercase,
                          "fit_rows": tok.fit_rows}
            encoder = TextEncoder(text, tcfg.max_tokens, tcfg.truncate, where=_where(name, tok))
            lengths = encoder.lengths(sample) if sample else np.zeros(0, dtype=np.int64)
            object.__setattr__(tcfg, FITTED, {
                "json": text, "sha256": sha256_text(text), "source": source, "vocab_size": encoder.vocab_size,
                "pad_id": encoder.pad_id, "lengths": length_statistics(lengths, tcfg.max_tokens)})

    @classmethod
    def fits_before_rows(cls, features_cfg) -> bool:
        return bool(features_cfg.text)

    @classmethod
    def input_files(cls, features_cfg) -> dict[str, str]:
        return _tokenizer_files(features_cfg)

    def fit(self, features_cfg, train) -> list[dict]:
        return [dict(r) for r in self.configured(features_cfg)]

    # --- the manifest and the dataset's files ---------------------------------------------------

    def stored_columns(self) -> list[dict]:
        # shape: the most ids a row holds; "ragged": a row holds from 0 to that many.
        return [{"name": r["name"], "dtype": "int32", "shape": [int(r["max_tokens"])], "ragged": True}
                for r in self.records]

    def contract(self, record: dict) -> dict:
        return {"name": record["name"]}

    def input_entry(self) -> dict:
        return {r["name"]: {"max_tokens": r["max_tokens"], "vocab_size": r.get("vocab_size"),
                            "pad_id": r.get("pad_id")} for r in self.records}

    def tokenizer_json(self, name: str) -> str:
        """Feature ``name``'s tokenizer JSON: the record's own during the shard job, else the file
        ``FeatureSpec.attach`` read (and checked against the recorded sha256)."""
        record = self.by_name[name]
        path = record["tokenizer"]["path"]
        texts = {**self.attached, **(record.get(FILE_TEXTS) or {})}
        if path not in texts:
            raise DatasetError(f"text feature {name!r}: its tokenizer {path} is not attached (read the dataset or "
                               "model with read_manifest / load_model)")
        return texts[path]

    def encoder(self, name: str):
        if name not in self._encoders:
            from common.tokenizer import TextEncoder

            r = self.by_name[name]
            self._encoders[name] = TextEncoder(self.tokenizer_json(name), r["max_tokens"], r["truncate"],
                                               where=f"text feature {name!r}'s tokenizer")
        return self._encoders[name]

    # --- row rules on a frame -------------------------------------------------------------------

    def frame_checks(self, columns: dict, n: int) -> list[tuple[str, str, np.ndarray]]:
        checks = []
        for name, r in self.by_name.items():
            nulls = _nulls(columns[name], n)
            if r["on_null"] == "quarantine":
                checks.append((reason_text("null_text", name), name, nulls))
            if r["truncate"] == "quarantine":
                texts = _texts(columns[name], n)
                long = self.encoder(name).lengths(texts) > int(r["max_tokens"])
                checks.append((reason_text("too_many_tokens", name), name, long & ~nulls))
        return checks

    # --- serving and the model input ------------------------------------------------------------

    def stored_values(self, name: str, values: Any) -> Any:
        """Typed values (an Arrow string column, nulls only where on_null is empty) as token id lists."""
        return self.encoder(name).encode_arrow(_texts(values, len(values)))

    def encode_column(self, name: str, values: Any) -> Any:
        return self.stored_values(name, values)

    def batch_layout(self) -> list[BatchEntry]:
        return [BatchEntry(name, (name,), "int64", (int(r["max_tokens"]),), ragged=True, pad=int(r["pad_id"]))
                for name, r in self.by_name.items()]

    def batch(self, frame: Any, n: int) -> dict[str, np.ndarray]:
        """Raw strings -> each feature's token ids padded to the rows' longest, and its mask: what
        the loader gives a batch of the same rows (with pad_multiple 1)."""
        out = {}
        for name, r in self.by_name.items():
            encoder = self.encoder(name)
            rows = [encoder.truncated(ids) for ids in encoder.token_ids(_texts(frame[name], n))]
            out[name], out[name + MASK_SUFFIX] = padded(rows, int(r["pad_id"]))
        return out

    def stored_batch(self, table: Any, n: int) -> dict[str, np.ndarray]:
        out = {}
        for name, r in self.by_name.items():
            out[name], out[name + MASK_SUFFIX] = padded(table.column(name).to_pylist(), int(r["pad_id"]))
        return out

    def batch_keys(self) -> list[str]:
        return [key for name in self.by_name for key in (name, name + MASK_SUFFIX)]

    def probe(self, rows: int) -> dict[str, np.ndarray]:
        out = {}
        for name, r in self.by_name.items():
            ids = np.full((rows, 2), int(r["pad_id"]), dtype=np.int64)
            mask = np.zeros((rows, 2), dtype=bool)
            if rows:
                ids[-1] = int(r["vocab_size"]) - 1  # the largest id: an embedding table too small fails on it
                mask[-1] = True
            out[name], out[name + MASK_SUFFIX] = ids, mask
        return out

    def raw_example(self, name: str, stored: Any) -> list:
        """Stored token ids back as text (an MLflow input example): the tokenizer's decoding."""
        tokenizer = self.encoder(name).tokenizer
        return [tokenizer.decode(ids) for ids in stored.to_pylist()]

    def signature_columns(self) -> list:
        from mlflow.types import ColSpec, DataType

        return [ColSpec(DataType.string, name) for name in self.by_name]

    # --- inspect --------------------------------------------------------------------------------

    def summary_part(self) -> str:
        return "text " + ", ".join(f"{r['name']} (vocab {r.get('vocab_size')}, <= {r['max_tokens']} tokens)"
                                   for r in self.records)

    def detail_lines(self) -> list[str]:
        lines = []
        for r in self.records:
            s = r.get("lengths") or {}
            if s.get("rows"):
                lines.append(f"{r['name']}: tokens per row p50 {s['p50']:g}, p95 {s['p95']:g}, max {s['max']}; "
                             f"{100 * s['truncated_share']:.2f}% over max_tokens {r['max_tokens']} "
                             f"({s['rows']:,} train rows sampled)")
        return lines


def typed_text_column(name: str) -> str:
    from common.features.base import typed_name

    return typed_name(Text.typed_prefix, name)


def _where(name: str, tok: TokenizerConfig) -> str:
    return f"features.text.{name}.tokenizer.file ({tok.file})" if tok.file else f"text feature {name!r}'s tokenizer"


def _fitted_record(name: str, fitted: dict) -> dict:
    path = f"{TEXT_DIR}/{name}/tokenizer.json"
    return {"vocab_size": fitted["vocab_size"], "pad_id": fitted["pad_id"],
            "tokenizer": {**fitted["source"], "path": path, "sha256": fitted["sha256"]},
            "lengths": dict(fitted["lengths"]),
            "files": [{"path": path, "sha256": fitted["sha256"]}],
            FILE_TEXTS: {path: fitted["json"]}}


def _tokenizer_files(features_cfg) -> dict[str, str]:
    return {f"features.text.{name}.tokenizer.file": cfg.tokenizer.file
            for name, cfg in features_cfg.text.items() if cfg.tokenizer.file is not None}


def _read_tokenizer_file(uri: str, key: str) -> str:
    from common.storage import resolve

    loc = resolve(uri)
    try:
        with loc.fs.open(loc.path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise InputDataError(f"{key}: {uri} does not exist") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputDataError(f"{key}: {uri} is not UTF-8 text (byte {exc.start}); give a tokenizer.json") from None


def _sample(clean_train, typed: str, seed: int, fit_rows: int) -> list[str]:
    """At most ``fit_rows`` non-null train values: those of the smallest seeded hash (ties by the
    text itself), in that order, streamed from the executors."""
    from pyspark.sql import functions as F

    rows = (clean_train.where(F.col(q(typed)).isNotNull())
            .select(F.xxhash64(F.lit(seed + 3), F.col(q(typed))).alias("h"), F.col(q(typed)).alias("t"))
            .orderBy("h", "t").limit(fit_rows))
    return [row["t"] for row in rows.toLocalIterator()]


_REGISTERED: dict[str, str] = {}


def _token_count_function(tokenizer_json: str) -> str:
    """The name of a Spark SQL function counting a text's tokens with this tokenizer (a pandas
    UDF, registered once per session and tokenizer)."""
    from pyspark.sql import SparkSession
    from pyspark.sql.functions import pandas_udf

    from common.tokenizer import sha256_text

    spark = SparkSession.getActiveSession()
    name = f"shardtrain_token_count_{sha256_text(tokenizer_json)[:16]}"
    if _REGISTERED.get(name) == id(spark):
        return name

    @pandas_udf("long")
    def token_count(texts):
        import pandas as pd

        from common.tokenizer import TextEncoder

        encoder = _encoder_cache.get(tokenizer_json)
        if encoder is None:
            encoder = _encoder_cache.setdefault(tokenizer_json, TextEncoder(tokenizer_json, MAX_TOKENS, "head"))
        values = texts.where(texts.notna(), "").tolist()
        return pd.Series(encoder.lengths(values), index=texts.index)

    spark.udf.register(name, token_count)
    _REGISTERED[name] = id(spark)
    return name


_encoder_cache: dict[str, Any] = {}


def _nulls(values, n: int) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return mask(pc.is_null(values))
    return each(values, n, is_missing)


def _texts(values, n: int) -> list[str]:
    """A text column's values as str, a null as "" (quarantined first where on_null says so)."""
    import pyarrow as pa

    items = values.to_pylist() if isinstance(values, (pa.Array, pa.ChunkedArray)) else list(values)
    out = []
    for v in items:
        if v is None or is_missing(v):
            out.append("")
        elif isinstance(v, (bytes, bytearray)):
            out.append(bytes(v).decode("utf-8", "replace"))
        else:
            out.append(str(v))
    return out


__all__ = ["Text", "TextFeatureConfig", "TokenizerConfig"]
