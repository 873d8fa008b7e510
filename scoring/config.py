"""The score job's config tree (``conf/score.yaml``): one dataclass per section, each validating itself.

The input is either ``sources`` + ``query`` (the shard job's own syntax and meaning: each source
becomes a Spark SQL view) or ``dataset`` + ``split`` (a published dataset's stored encodings).
Section and key names are a public contract: add keys, never rename them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from common.config import SparkConfig, load_config, require, setting, storage_path
from common.sources import SourceConfig, check_sources_and_query
from common.tables import table_parts
from scoring.predict import DEFAULT_BATCH_SIZE


@dataclass
class ScoreOutputConfig:
    path: str = storage_path(
        "the scores' URI: Parquet, with `_scores.json` (the accounting), the config and `_quarantine/` beside "
        "them, published atomically (marker kind `shardtrain.scores`); with `output.table`, only those three go "
        "here")
    mode: Literal["error", "overwrite", "skip_if_exists"] = setting(
        "`error` refuses existing scores, `overwrite` replaces only a scores output, `skip_if_exists` exits 0 "
        "without work when the same config, input files and model are already scored", default="error")
    keep_columns: list[str] = setting(
        "input columns written beside the predictions (ids, keys); the features are not kept unless listed",
        default_factory=list)
    # Published atomically (common.tables: a staging table swapped in, or a new version of a Delta table).
    table: str | None = setting(
        "a catalog table (`table`, `schema.table` or `catalog.schema.table`) that gets the scores instead, "
        "published atomically", default=None)

    def __post_init__(self):
        require(bool(self.path), "path", "must not be empty")
        if self.table is not None:
            table_parts(self.table, "table")
        dup = sorted({c for c in self.keep_columns if self.keep_columns.count(c) > 1})
        require(not dup, "keep_columns", f"lists column(s) {dup} more than once")


@dataclass
class ScoreQualityConfig:
    # A column an upstream change emptied is imputed row by row and would score without a word.
    max_null_increase: float = setting(
        "each feature's share of null values in the input against its share on the model's train split "
        "(recorded by the shard job, carried in model.json): an absolute increase past this is a warning naming "
        "the column; both shares are in `_scores.json` (`null_share`)", default=0.5)
    fail_null_increase: float | None = setting(
        "past this increase the job fails (exit 2) naming the column(s) with both shares, and publishes nothing; "
        "null: never", default=None)

    def __post_init__(self):
        for key in ("max_null_increase", "fail_null_increase"):
            value = getattr(self, key)
            require(value is None or 0 <= value <= 1, key, f"must be a fraction in [0, 1], got {value}")


@dataclass
class ScoreConfig:
    model: str = storage_path(
        "URI of a published model, or of a registered version: `models:/NAME/VERSION`, `models:/NAME@ALIAS` "
        "(MLflow's default registry: `MLFLOW_REGISTRY_URI`, else `MLFLOW_TRACKING_URI`)")
    output: ScoreOutputConfig = setting("where the scores go")
    spark: SparkConfig = setting("the Spark session, when the job creates one", default_factory=SparkConfig)
    sources: dict[str, SourceConfig] = setting(
        "the input, exactly as in the shard job: each source becomes a Spark SQL view of its name (CSV and JSON "
        "records that do not parse are quarantined as `malformed_record`); or `dataset`", default_factory=dict)
    query: str | None = setting("one Spark SQL query over the source views, as in the shard job", default=None)
    dataset: str | None = storage_path(
        "instead of `sources`: a published dataset whose `split` is scored from its stored encodings; the model "
        "must have been trained on that dataset's encodings", default=None)
    split: str | None = setting("with `dataset`: the split to score (e.g. `test`)", default=None)
    batch_size: int = setting("rows per forward pass", default=DEFAULT_BATCH_SIZE)
    temperature: float = setting("classification: probabilities are softmax(logits / temperature)", default=1.0)
    program: bool = setting("run the model's TorchScript program (`model.torchscript.pt`, where the model holds one: "
                            "`output.torchscript`) instead of the network rebuilt from its weights", default=False)
    model_code: Literal["refuse", "trust"] = setting(
        "a model trained from code given to `train(model=...)` holds that code (`model.code.pkl`), and is rebuilt by "
        "running it: `trust` runs it (its sha256 is logged), `refuse` is exit 2 naming this key", default="refuse")
    quality: ScoreQualityConfig = setting("the input's null shares against training's",
                                          default_factory=ScoreQualityConfig)

    def __post_init__(self):
        require(bool(self.model), "model", "must name a published model")
        require(bool(self.sources) != (self.dataset is not None), "sources",
                "or dataset must be set (exactly one): raw data through sources (+ query), or a published dataset")
        if self.dataset is not None:
            require(bool(self.split), "split", "must name the dataset's split to score (e.g. test)")
            require(self.query is None, "query", "applies to sources only; a dataset is scored as it is stored")
        else:
            require(self.split is None, "split", "applies to a dataset only; filter sources in the query")
            check_sources_and_query(self.sources, self.query)
            if self.output.table is not None:
                same = [n for n, src in self.sources.items() if src.table is not None and
                        table_parts(src.table, "table")[-2:] == table_parts(self.output.table, "table")[-2:]]
                name = same[0] if same else ""
                require(not same, "output.table", f"is the table of source {name!r} (sources.{name}.table); writing "
                        "the scores there would replace the input: choose another table")
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(math.isfinite(self.temperature) and self.temperature > 0, "temperature",
                f"must be a finite number > 0, got {self.temperature}")

    @property
    def inputs(self) -> dict[str, str]:
        """Every input location, described by its config key (what the output may not overlap)."""
        found = {"the model (model)": self.model}
        if self.dataset is not None:
            found["the dataset (dataset)"] = self.dataset
        found.update({f"source {name!r} (sources.{name}.path)": src.path for name, src in self.sources.items()
                      if src.path is not None})
        return found


def load_score_config(path=None, overrides=None, defaults: dict | None = None) -> ScoreConfig:
    return load_config(ScoreConfig, path, overrides, defaults)


__all__ = ["ScoreConfig", "ScoreOutputConfig", "ScoreQualityConfig", "load_score_config"]
