"""The shard job's checks on what its passes counted and wrote, before anything is published: pass
one's counts (few enough bad rows, ``quality.max_bad_fraction``; num_shards rows in every split;
the train rows without a label, the transfer set, only where ``label.unlabeled: transfer`` keeps
them), and pass two's files (each split's shards hold their planned sizes; input rows = published
+ quarantined). What a feature kind needs of the train split (a numeric feature with no value in
it) its kind checks as it fits (common/features).

Pure functions of the config, the counts and the written files' records: no Spark, no I/O; the
job (pipelines/shard_job.py) calls them inside its staging directory, so a refusal publishes nothing.
"""

from __future__ import annotations

from common.errors import AccountingError, InputDataError, QualityGateError
from pipelines.balance import check_split_rows, shard_sizes
from pipelines.shard_config import ShardConfig
from pipelines.shard_placement import RowCounts
from pipelines.summary import Summary


def check_counts(cfg: ShardConfig, counts: RowCounts) -> None:
    """Pass one's counts against what a dataset needs: few enough bad rows, num_shards rows in
    every split."""
    _quality_gate(cfg, counts)
    for i, name in enumerate(cfg.split.fractions):
        check_split_rows(name, counts.split_rows.get(i, 0), cfg.output.num_shards)


def _quality_gate(cfg: ShardConfig, counts: RowCounts) -> None:
    total = counts.input_rows
    if total == 0:
        raise InputDataError(f"the input has no rows (sources: {', '.join(s.location for s in cfg.sources.values())})")
    fraction = counts.quarantined / total
    if fraction > cfg.quality.max_bad_fraction:
        reasons = ", ".join(f"{r}={n}" for r, n in sorted(counts.by_reason.items(), key=lambda kv: (-kv[1], kv[0])))
        raise QualityGateError(
            f"{counts.quarantined} of {total} input rows ({fraction:.2%}) are bad, above "
            f"quality.max_bad_fraction={cfg.quality.max_bad_fraction:g}: {reasons}. Nothing was written; fix the "
            "input, or raise quality.max_bad_fraction to publish the good rows and quarantine the rest")


def count_transfer_rows(cfg: ShardConfig, train_rows: int, summary: Summary) -> int:
    """Train rows without a label (``label.unlabeled: transfer``): the train rows the summary's
    label statistics did not count (class counts, or a regression label's moments, skip nulls).
    Refuses a train split with no labelled row, and (a check on the row rules) any unlabelled
    row under ``quarantine``."""
    labelled = summary.label_rows if cfg.label.classification else summary.moments[-1][0]
    transfer = train_rows - labelled
    if cfg.label.unlabeled != "transfer" and transfer:
        raise AccountingError(f"{transfer} train rows have no label although label.unlabeled=quarantine should have "
                              "quarantined them; nothing was published")
    if cfg.label.unlabeled == "transfer" and labelled == 0:
        raise InputDataError(f"the train split has no labelled row (all {train_rows} are transfer rows, "
                             "label.unlabeled=transfer): there is nothing to learn the label from; check "
                             f"label.{'column' if cfg.label.column else 'expr'}")
    return transfer


def split_entries(split_names: list[str], files: list[dict], counts: RowCounts, num_shards: int) -> dict:
    by_path = {f["path"]: f for f in files}
    splits = {}
    for i, name in enumerate(split_names):
        entries = [by_path[f"{name}/part-{s:05d}.parquet"] for s in range(num_shards)]
        want = shard_sizes(counts.split_rows[i], num_shards)
        got = [f["rows"] for f in entries]
        if got != want:
            raise AccountingError(f"split {name!r}: shard sizes {got} differ from the planned {want}; nothing was published")
        splits[name] = {"rows": sum(got), "files": [
            {"path": f["path"], "rows": f["rows"], "row_groups": list(f["row_groups"]), "bytes": f["bytes"],
             "sha256": f["sha256"]} for f in entries]}
    return splits


def check_accounting(counts: RowCounts, splits: dict, qfiles: list[dict]) -> dict:
    published = sum(info["rows"] for info in splits.values())
    quarantined = sum(f["rows"] for f in qfiles)
    record = {"input_rows": counts.input_rows, "published_rows": published, "quarantined_rows": quarantined}
    if published + quarantined != counts.input_rows or quarantined != counts.quarantined:
        raise AccountingError(
            f"row accounting does not balance: input {counts.input_rows} != published {published} + quarantined "
            f"{quarantined} (counted {counts.quarantined} bad rows earlier). The input changed while the job ran, or "
            "a transform is not deterministic; nothing was published")
    return record


__all__ = ["check_accounting", "check_counts", "count_transfer_rows", "split_entries"]
