"""``shardtrain inspect DATASET``: what a published dataset holds, read from its manifest only.

Reads no data files and needs no Spark, so it is instant on any size of dataset; except
``verify_report`` (``inspect --verify``), which reads every file to check its sha256, and the
HTML report's samples of a kind that shows them (an image feature's thumbnails per class: the
first row groups of one train file, ``SAMPLE_ROWS`` rows at most). The report
is a few sections, each from its own function: header, label and features, per-split balance,
row-group advice, accounting and quarantine, sources. ``dataset_report_html`` (``inspect --html``)
shows the same with charts: rows per shard and split, quarantine counts by reason, feature statistics,
and thumbnails of image features by class.
"""

from __future__ import annotations

from common.dataset import LabelSpec, Manifest, read_manifest
from common.manifest_builder import row_bytes
from common.features import FeatureSpec


# Measured with benchmarks/loader_throughput.py (2 cores, tabular rows of 88 bytes): the training
# loader reaches ~0.99 of raw pyarrow with 16 MiB row groups, ~0.89 at 8 MiB and ~0.73 at 2 MiB,
# because petastorm pays a fixed cost per row group.
SMALL_ROW_GROUP_MIB = 8.0


def describe_dataset(uri) -> str:
    manifest = uri if isinstance(uri, Manifest) else read_manifest(uri)
    lines = _header(manifest) + _label_and_features(manifest.label, manifest.features.spec)
    lines += ["", *_split_balance(manifest)]
    lines += _row_group_guidance(manifest)
    lines += ["", *_quarantine_summary(manifest)]
    lines += _sources(manifest.data)
    return "\n".join(lines)


def _header(manifest: Manifest) -> list[str]:
    data = manifest.data
    return [f"dataset   {manifest.root.uri}",
            f"format    {data['format']} v{data['format_version']}, written by shardtrain "
            f"{data.get('shardtrain_version', '?')} at {data.get('created_at', '?')}",
            f"fingerprint {manifest.fingerprint[:16]}"]


def _label_and_features(label: LabelSpec, feats: dict) -> list[str]:
    if label.classification:
        counts = list(label.train_class_counts or [])
        shown = counts if label.classes is None else dict(zip(label.classes, counts))
        lines = [f"label     {label.name}: {label.task}, {label.num_classes} classes; train class counts {shown}"]
    else:
        lines = [f"label     {label.name}: regression; train mean {_or_nan(label.train_mean):.4g}, "
                 f"std {_or_nan(label.train_std):.4g}"]
    spec = FeatureSpec(feats)
    lines.append(f"features  {spec.summary()}")
    lines += [f"          {line}" for kind in spec.kinds for line in kind.detail_lines()]
    return lines


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _split_stats(manifest: Manifest, split: str) -> dict:
    files = manifest.files(split)
    sizes = [f.rows for f in files]
    return {"rows": manifest.rows(split), "shards": len(files), "min": min(sizes, default=0),
            "max": max(sizes, default=0), "spread": (max(sizes) - min(sizes)) if sizes else 0,
            "row_groups": sum(len(f.row_groups) for f in files), "mb": sum(f.bytes for f in files) / 2 ** 20}


def _split_balance(manifest: Manifest) -> list[str]:
    """One table row per split (rows, shards, smallest/largest shard, spread), then every file."""
    lines = [f"{'split':<8} {'rows':>12} {'shards':>6} {'min':>10} {'max':>10} {'spread':>6} "
             f"{'row groups':>10} {'MB':>9}"]
    for split in manifest.split_names:
        st = _split_stats(manifest, split)
        lines.append(f"{split:<8} {st['rows']:>12,} {st['shards']:>6} {st['min']:>10,} {st['max']:>10,} "
                     f"{st['spread']:>6} {st['row_groups']:>10} {st['mb']:>9.2f}")
    for split in manifest.split_names:
        lines.append(f"  {split}: " + ", ".join(f"{f.path.rsplit('/', 1)[-1]}={f.rows}" +
                                                 (f" ({len(f.row_groups)} rg)" if len(f.row_groups) > 1 else "")
                                                 for f in manifest.files(split)))
    return lines


def _row_group_line(manifest: Manifest) -> str | None:
    width = row_bytes(manifest.data["schema"], manifest.data["features"])
    groups = [g for split in manifest.split_names for f in manifest.files(split) for g in f.row_groups]
    if not groups or not width:
        return None
    largest = max(groups)
    mib = largest * width / 2 ** 20
    line = f"row groups up to {largest:,} rows = {mib:.1f} MiB of stored data"
    split_by_size = any(len(f.row_groups) > 1 for split in manifest.split_names for f in manifest.files(split))
    if split_by_size and mib < SMALL_ROW_GROUP_MIB:
        line += (f"; below {SMALL_ROW_GROUP_MIB:g} MiB the training loader slows down (petastorm pays a fixed cost "
                 "per row group): re-shard with a larger output.row_group_mb (default 16)")
    return line


def _row_group_guidance(manifest: Manifest) -> list[str]:
    line = _row_group_line(manifest)
    return ["", line] if line else []


def _quarantine_summary(manifest: Manifest) -> list[str]:
    """input = published + quarantined, then the quarantined rows by reason, most frequent first."""
    quarantine = manifest.data.get("quarantine") or {}
    accounting = manifest.data.get("accounting") or {}
    lines = []
    if accounting:
        lines.append(f"accounting input {accounting['input_rows']:,} = published {accounting['published_rows']:,} "
                     f"+ quarantined {accounting['quarantined_rows']:,}")
        if "transfer_rows" in accounting:
            lines.append(f"transfer {accounting['transfer_rows']:,} of the published train rows have no label "
                         "(label.unlabeled=transfer: they learn from the teacher's soft targets only)")
    rows = quarantine.get("rows", 0)
    if not rows:
        return lines + ["quarantine none"]
    lines.append(f"quarantine {rows:,} rows at {manifest.root.join(quarantine.get('path', '_quarantine')).uri}")
    for reason, count in _quarantine_reasons(manifest):
        lines.append(f"  {reason:<28} {count:>10,}")
    return lines


def _quarantine_reasons(manifest: Manifest) -> list[tuple[str, int]]:
    """(reason, rows), most frequent first."""
    by_reason = (manifest.data.get("quarantine") or {}).get("by_reason", {})
    return sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0]))


def _sources(data: dict) -> list[str]:
    lines = []
    for name, src in (data.get("sources") or {}).items():
        files = src.get("files", [])
        lines.append(f"source    {name}: {src.get('format')} at {src.get('path')} "
                     f"({len(files)} files, {sum(f.get('size', 0) for f in files) / 2 ** 20:.1f} MB)")
    return lines


# --- inspect --html ------------------------------------------------------------------------------

def write_dataset_report(uri, output: str) -> str:
    """``inspect --html``: the dataset report as one self-contained HTML file at ``output``; its URI."""
    from common.html_report import write_page

    manifest = uri if isinstance(uri, Manifest) else read_manifest(uri)
    return write_page(output, dataset_report_html(manifest))


def dataset_report_html(manifest: Manifest) -> str:
    from common.html_report import Page, key_values, preformatted

    data = manifest.data
    page = Page(f"shardtrain dataset: {manifest.root.uri}")
    page.add("Dataset", key_values([
        ("dataset", manifest.root.uri), ("format", f"{data['format']} v{data['format_version']}"),
        ("written by", f"shardtrain {data.get('shardtrain_version', '?')} at {data.get('created_at', '?')}"),
        ("fingerprint", manifest.fingerprint), ("label", manifest.label.name), ("task", manifest.label.task)]))
    page.add("Rows per split and shard", *_html_splits(manifest))
    page.add("Quarantine", *_html_quarantine(manifest))
    page.add("Label", *_html_label(manifest.label))
    page.add("Feature statistics (from the train split)", *_html_features(data["features"]))
    samples = _html_samples(manifest)
    if samples:
        page.add("Samples (from the train split)", *samples)
    if data.get("sources"):
        page.add("Sources", preformatted("\n".join(_sources(data))))
    return page.render()


def _html_splits(manifest: Manifest) -> list[str]:
    from common.html_report import bar_chart, paragraph, table

    parts = [table(["split", "rows", "shards", "smallest shard", "largest shard", "spread", "row groups", "MB"],
                   [[split, *_split_stats(manifest, split).values()] for split in manifest.split_names])]
    for split in manifest.split_names:
        files = manifest.files(split)
        names = [f.path.rsplit("/", 1)[-1] for f in files]
        parts.append(bar_chart(f"Rows per shard: {split}", names, [f.rows for f in files], "rows"))
        parts.append(table(["file", "rows", "row groups", "rows per row group", "MB"],
                           [[f.path, f.rows, len(f.row_groups), ", ".join(map(str, f.row_groups)),
                             f.bytes / 2 ** 20] for f in files]))
    line = _row_group_line(manifest)
    return parts + ([paragraph(line, note=True)] if line else [])


def _html_quarantine(manifest: Manifest) -> list[str]:
    from common.html_report import bar_chart, key_values, paragraph, table

    accounting = manifest.data.get("accounting") or {}
    parts = [key_values([("input rows", accounting.get("input_rows")),
                         ("published rows", accounting.get("published_rows")),
                         ("quarantined rows", accounting.get("quarantined_rows")),
                         *([("transfer rows (train, no label)", accounting["transfer_rows"])]
                           if "transfer_rows" in accounting else [])])] if accounting else []
    reasons = _quarantine_reasons(manifest)
    if not reasons:
        return parts + [paragraph("No row was quarantined.")]
    quarantine = manifest.data["quarantine"]
    parts.append(paragraph(f"Quarantined rows are kept, with their reason and raw record, at "
                           f"{manifest.root.join(quarantine.get('path', '_quarantine')).uri}"))
    return parts + [table(["reason", "rows"], reasons),
                    bar_chart("Quarantined rows by reason", [r for r, _ in reasons], [c for _, c in reasons], "rows")]


def _html_label(label: LabelSpec) -> list[str]:
    from common.html_report import bar_chart, key_values

    if label.classification:
        counts = list(label.train_class_counts or [])
        parts = [key_values([("classes", label.num_classes), ("train class counts", counts)])]
        if counts:
            names = list(label.classes) if label.classes is not None else [str(i) for i in range(len(counts))]
            parts.append(bar_chart("Train rows per class", names, counts, "rows"))
        return parts
    return [key_values([("train mean", label.train_mean), ("train std", label.train_std)])]


def _html_features(features: dict) -> list[str]:
    from common.html_report import paragraph

    parts = [part for kind in FeatureSpec(features).kinds if (part := kind.html_table()) is not None]
    return parts or [paragraph("No feature columns.", note=True)]


SAMPLE_ROWS = 512  # stored train rows inspect --html reads, at most, for the kinds' samples


def _html_samples(manifest: Manifest) -> list[str]:
    """The kinds' samples (an image feature's thumbnails per class), from the first row groups of
    the train split's first file, up to SAMPLE_ROWS rows; nothing is read for kinds that show none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kinds = [kind for kind in FeatureSpec(manifest.data["features"]).kinds if kind.names and kind.shows_samples]
    split = "train" if "train" in manifest.split_names else manifest.split_names[0]
    files = manifest.files(split)
    if not kinds or not files:
        return []
    label = manifest.label
    columns = [n for kind in kinds for n in kind.names] + [label.name]
    with manifest.root.open(files[0].path) as fh:
        reader = pq.ParquetFile(fh)
        batches, rows = [], 0
        for group in range(reader.num_row_groups):
            batches.append(reader.read_row_group(group, columns=columns))
            rows += batches[-1].num_rows
            if rows >= SAMPLE_ROWS:
                break
    table = pa.concat_tables(batches).slice(0, SAMPLE_ROWS)
    values = table.column(label.name).to_pylist()
    names = list(label.classes) if label.classes is not None else None
    labels = [names[v] if names else v for v in values] if label.classification else [None] * len(values)
    return [part for kind in kinds for part in kind.html_samples(table, labels)]


def verify_report(manifest: Manifest) -> tuple[str, int]:
    """``inspect --verify``: every split and quarantine file checked against the manifest's
    sha256; returns the report and the number of damaged files."""
    from common.dataset_files import verify_dataset

    problems = verify_dataset(manifest)
    files = sum(manifest.num_shards(split) for split in manifest.split_names)
    files += len((manifest.data.get("quarantine") or {}).get("files", []))
    if not problems:
        return f"\nverify    all {files} files match the manifest's sha256", 0
    return "\n".join([f"\nverify    {len(problems)} of {files} files do NOT match the manifest:",
                      *(f"  {line}" for line in problems)]), len(problems)
