"""A dataset's files against its manifest: every data file's bytes against the sha256 the shard job
recorded (``verify_file``, ``verify_dataset``), a file's version read cheaply to tell a rewrite
(``file_identity``), the manifest's current fingerprint, and the file entry a producer that writes
its own files records (``file_entry``). The manifest itself is ``common.dataset``'s."""

from __future__ import annotations

import hashlib
import json
import os

from common.commit_marker import is_committed
from common.dataset import MANIFEST_NAME, FileEntry, Manifest, _file_entry
from common.errors import DatasetError, StorageIOError
from common.storage import Location
from common.file_digest import verify_digest  # noqa: F401 - re-exported: readers import it from here


# --- integrity: every data file against the sha256 the shard job recorded ---------------------------

def verify_file(root: Location, entry: FileEntry) -> None:
    """Check a split or quarantine file against its manifest entry (size, then a streamed sha256);
    a DatasetError names the file and says to re-run the shard job."""
    verify_digest(root.join(entry.path), entry.sha256, entry.bytes)


# --- a file's version: what tells a rewrite cheaply, without reading the file ---------------------

# fsspec's info fields that change when an object is written again: GCS's generation, S3's
# VersionId and ETag, HDFS's mtime. The size always.
_VERSION_FIELDS = ("generation", "VersionId", "ETag", "etag", "mtime")


def file_identity(loc: Location) -> tuple:
    """``(field, value)`` pairs naming this version of the file: size and mtime_ns locally (a
    rewrite is a new file with a new mtime), the size and what fsspec's ``info`` reports of the
    generation, version id, ETag or mtime elsewhere. FileNotFoundError when it is gone."""
    if loc.scheme == "file":
        st = os.stat(loc.path)
        return (("size", st.st_size), ("mtime_ns", st.st_mtime_ns))
    info = loc.fs.info(loc.path)
    return (("size", int(info.get("size") or 0)),
            *((name, str(info[name])) for name in _VERSION_FIELDS if info.get(name) is not None))


def current_fingerprint(root: Location) -> str | None:
    """The fingerprint in the manifest at ``root`` now, or None when there is no committed,
    readable manifest there (being replaced, removed, damaged): a cheap re-read, no validation."""
    try:
        if not is_committed(root):
            return None
        record = json.loads(root.read_text(MANIFEST_NAME))
    except (OSError, ValueError):
        return None
    return record.get("fingerprint") if isinstance(record, dict) else None


def verify_dataset(manifest: Manifest) -> list[str]:
    """Every file the manifest lists (splits and quarantine), checked; returns the problems, one
    line each naming the file (empty when the dataset is intact)."""
    entries = [entry for split in manifest.split_names for entry in manifest.files(split)]
    quarantine = manifest.data.get("quarantine") or {}
    entries += [_file_entry(f) for f in quarantine.get("files", [])]
    problems = []
    for entry in entries:
        try:
            verify_file(manifest.root, entry)
        except DatasetError as exc:
            problems.append(str(exc))
    return problems


def file_entry(root: Location, rel: str) -> dict:
    """A split's file entry for a Parquet file already written under ``root``: rows, row groups,
    bytes and sha256 (for producers that write files themselves: tests, benchmarks)."""
    import pyarrow.parquet as pq

    loc = root.join(rel)
    digest = hashlib.sha256()
    with loc.fs.open(loc.path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
        size = fh.tell()
    with loc.fs.open(loc.path, "rb") as fh:
        meta = pq.ParquetFile(fh).metadata
        groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    return {"path": rel, "rows": sum(groups), "row_groups": groups, "bytes": size, "sha256": digest.hexdigest()}
