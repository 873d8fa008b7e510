"""The score job's check for training/serving skew: each feature's share of null values in the
input against its share on the model's train split.

A feature column that an upstream change emptied (or that Spark reads as all null: a Parquet
file whose embedded schema names a column its data lacks) is imputed row by row, and its rows
would score like any other. The shard job records each feature's null share over the train
split's clean rows (``null_share`` in the manifest's ``features``, which model.json carries:
``FeatureSpec.null_shares``); the score job counts the input's nulls per feature in its scoring
pass (``observe_nulls``: a Spark observation, like the reasons, no pass of its own), over every
row of the input table (scored or quarantined: an emptied array column quarantines every row),
and ``compare_null_shares`` compares them before anything is committed:

* an increase past ``quality.max_null_increase`` (absolute; default 0.5): a warning naming each
  such column, with both shares;
* past ``quality.fail_null_increase`` (default: off): an InputDataError (exit 2) naming the
  column(s), with both shares; raised inside the publish, so nothing is published.

A model whose dataset recorded no null shares (sharded before they were) is not compared, and
the job says so in one line; a dataset split is not counted (its stored values are the shard
job's, nulls already imputed). The shares go into ``_scores.json`` either way.
"""

from __future__ import annotations

import logging

from common.errors import InputDataError
from common.sql import quote_identifier as q

log = logging.getLogger("shardtrain.score")


def observe_nulls(frame, spec, encoded: bool):
    """(``frame`` counting its rows and each feature's nulls as any action reads it, the
    observation); the observation is None for stored encodings (a dataset split), where a null
    was imputed by the shard job and cannot be counted."""
    if encoded:
        return frame, None
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    counting = Observation("score_nulls")
    metrics = [F.count(F.lit(1)).alias("rows")]
    metrics += [F.count_if(F.expr(f"{q(name)} IS NULL")).alias(f"null_{i}") for i, name in enumerate(spec.columns)]
    return frame.observe(counting, *metrics), counting


def compare_null_shares(spec, counting, quality) -> dict:
    """The input's null shares (from ``counting``, filled by the scoring pass) against the model's
    (``spec``: its FeatureSpec), under ``quality`` (ScoreQualityConfig): warns, or raises
    InputDataError, as the module docstring says. Returns the ``_scores.json`` record."""
    found = None if counting is None else _input_null_shares(counting, spec)
    train = spec.null_shares or None
    if found is None:
        log.info("null shares are not compared for a dataset split: its stored values were imputed by the shard "
                 "job (the check applies to raw sources)")
        return _record(train, None, [])
    if train is None:
        log.info("null shares are not compared (quality.max_null_increase, quality.fail_null_increase): the model "
                 "records none, its dataset was sharded before they were recorded; re-shard the data and re-train "
                 "to get them")
        return _record(None, found, [])
    past = _increased(train, found, quality.max_null_increase)
    if past:
        log.warning("the input's share of null values is past quality.max_null_increase (%s) for %s; these values "
                    "are imputed row by row: check the input for an upstream schema change (quality."
                    "fail_null_increase refuses such input)", quality.max_null_increase, _describe(past, train, found))
    refused = [] if quality.fail_null_increase is None else _increased(train, found, quality.fail_null_increase)
    if refused:
        raise InputDataError(f"the input's share of null values is past quality.fail_null_increase "
                             f"({quality.fail_null_increase}) for {_describe(refused, train, found)}; nothing was "
                             "published: fix the input (an upstream schema change?) or raise "
                             "quality.fail_null_increase")
    return _record(train, found, past)


def _input_null_shares(counting, spec) -> dict[str, float]:
    """Each feature's nulls over the input rows the observation counted (0 for no rows)."""
    got = counting.get
    rows = int(got["rows"])
    return {name: int(got[f"null_{i}"]) / rows if rows else 0.0 for i, name in enumerate(spec.columns)}


def _record(train: dict | None, found: dict | None, past: list[str]) -> dict:
    """``_scores.json``'s ``null_share``: the model's train shares and the input's (null where not
    known: a model that records none, a dataset split), and the columns past
    quality.max_null_increase."""
    return {"train": train, "input": found, "past_max_null_increase": past}


def _increased(train: dict[str, float], found: dict[str, float], limit: float) -> list[str]:
    """The features whose input share exceeds their train share by more than ``limit``, in
    feature order (a feature the model records no share for is not compared)."""
    return [name for name, share in found.items() if name in train and share - train[name] > limit]


def _describe(names: list[str], train: dict[str, float], found: dict[str, float]) -> str:
    return ", ".join(f"column {name!r} ({found[name]:.1%} of the input rows null, {train[name]:.1%} on train)"
                     for name in names)


__all__ = ["compare_null_shares", "observe_nulls"]
