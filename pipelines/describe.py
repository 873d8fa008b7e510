"""``shardtrain inspect DATASET``: what a published dataset holds, read from its manifest only.

Reads no data files and needs no Spark, so it is instant on any size of dataset; except
``verify_report`` (``inspect --verify``), which reads every file to check its sha256. The report
is a few sections, each from its own function: header, label and features, per-split balance,
row-group advice, accounting and quarantine, sources.
"""

from __future__ import annotations

from common.dataset import Manifest, read_manifest, row_bytes


# Measured with benchmarks/loader_throughput.py (2 cores, tabular rows of 88 bytes): the training
# loader reaches ~0.99 of raw pyarrow with 16 MiB row groups, ~0.89 at 8 MiB and ~0.73 at 2 MiB,
# because petastorm pays a fixed cost per row group.
SMALL_ROW_GROUP_MIB = 8.0


def describe_dataset(uri) -> str:
    manifest = uri if isinstance(uri, Manifest) else read_manifest(uri)
    lines = _header(manifest) + _label_and_features(manifest.data)
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


def _label_and_features(data: dict) -> list[str]:
    label = data["label"]
    if label.get("task") == "classification":
        counts = label.get("train_class_counts") or []
        lines = [f"label     {label['name']}: classification, {label.get('num_classes')} classes; "
                 f"train class counts {counts}"]
    else:
        lines = [f"label     {label['name']}: regression; train mean {label.get('train_mean', float('nan')):.4g}, "
                 f"std {label.get('train_std', float('nan')):.4g}"]
    feats = data["features"]
    lines.append(f"features  {len(feats.get('numeric', []))} numeric, {len(feats.get('categorical', []))} categorical"
                 + "".join(f", {a['name']} {tuple(a['shape'])}" for a in feats.get("arrays", [])))
    for cat in feats.get("categorical", []):
        lines.append(f"          {cat['name']}: vocabulary of {len(cat['vocab'])} (+2 reserved: null, unseen)")
    return lines


def _split_balance(manifest: Manifest) -> list[str]:
    """One table row per split (rows, shards, smallest/largest shard, spread), then every file."""
    lines = [f"{'split':<8} {'rows':>12} {'shards':>6} {'min':>10} {'max':>10} {'spread':>6} "
             f"{'row groups':>10} {'MB':>9}"]
    for split in manifest.split_names:
        files = manifest.files(split)
        sizes = [f.rows for f in files]
        groups = sum(len(f.row_groups) for f in files)
        mb = sum(f.bytes for f in files) / 2 ** 20
        spread = (max(sizes) - min(sizes)) if sizes else 0
        lines.append(f"{split:<8} {manifest.rows(split):>12,} {len(files):>6} {min(sizes, default=0):>10,} "
                     f"{max(sizes, default=0):>10,} {spread:>6} {groups:>10} {mb:>9.2f}")
    for split in manifest.split_names:
        lines.append(f"  {split}: " + ", ".join(f"{f.path.rsplit('/', 1)[-1]}={f.rows}" +
                                                 (f" ({len(f.row_groups)} rg)" if len(f.row_groups) > 1 else "")
                                                 for f in manifest.files(split)))
    return lines


def _row_group_guidance(manifest: Manifest) -> list[str]:
    width = row_bytes(manifest.data["schema"])
    groups = [g for split in manifest.split_names for f in manifest.files(split) for g in f.row_groups]
    if not groups or not width:
        return []
    largest = max(groups)
    mib = largest * width / 2 ** 20
    line = f"row groups up to {largest:,} rows = {mib:.1f} MiB of stored data"
    split_by_size = any(len(f.row_groups) > 1 for split in manifest.split_names for f in manifest.files(split))
    if split_by_size and mib < SMALL_ROW_GROUP_MIB:
        line += (f"; below {SMALL_ROW_GROUP_MIB:g} MiB the training loader slows down (petastorm pays a fixed cost "
                 "per row group): re-shard with a larger output.row_group_mb (default 16)")
    return ["", line]


def _quarantine_summary(manifest: Manifest) -> list[str]:
    """input = published + quarantined, then the quarantined rows by reason, most frequent first."""
    quarantine = manifest.data.get("quarantine") or {}
    accounting = manifest.data.get("accounting") or {}
    lines = []
    if accounting:
        lines.append(f"accounting input {accounting['input_rows']:,} = published {accounting['published_rows']:,} "
                     f"+ quarantined {accounting['quarantined_rows']:,}")
    rows = quarantine.get("rows", 0)
    if not rows:
        return lines + ["quarantine none"]
    lines.append(f"quarantine {rows:,} rows at {manifest.root.join(quarantine.get('path', '_quarantine')).uri}")
    for reason, count in sorted(quarantine.get("by_reason", {}).items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  {reason:<28} {count:>10,}")
    return lines


def _sources(data: dict) -> list[str]:
    lines = []
    for name, src in (data.get("sources") or {}).items():
        files = src.get("files", [])
        lines.append(f"source    {name}: {src.get('format')} at {src.get('path')} "
                     f"({len(files)} files, {sum(f.get('size', 0) for f in files) / 2 ** 20:.1f} MB)")
    return lines


def verify_report(manifest: Manifest) -> tuple[str, int]:
    """``inspect --verify``: every split and quarantine file checked against the manifest's
    sha256; returns the report and the number of damaged files."""
    from common.dataset import verify_dataset

    problems = verify_dataset(manifest)
    files = sum(manifest.num_shards(split) for split in manifest.split_names)
    files += len((manifest.data.get("quarantine") or {}).get("files", []))
    if not problems:
        return f"\nverify    all {files} files match the manifest's sha256", 0
    return "\n".join([f"\nverify    {len(problems)} of {files} files do NOT match the manifest:",
                      *(f"  {line}" for line in problems)]), len(problems)
