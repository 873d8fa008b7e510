"""A split's shard files as the driver planned on them (``SplitLayout``, ``ShardFile``: plain,
picklable values built from the manifest), and the checks that the rows a rank reads are still
those files' rows: integrity and pinning.

Integrity: before a reader opens shard files it calls ``SplitLayout.verify_files`` with them,
which checks each file against the manifest's sha256 the first time this rank opens it in the
run (``data.verify``); any reader of shard files must call it.

Pinning: the driver records each file's version (``common.dataset_files.file_identity``: size and
mtime_ns locally, generation / ETag elsewhere) in the layout when it plans, beside the manifest's
fingerprint. ``verify_files`` compares it on every open (a stat per file, every rank, both
readers), a pass compares it again once it has read its rows (``check_unchanged``), and
``check_manifest_unchanged`` re-reads the manifest's fingerprint (each epoch start, before
publishing): a dataset rewritten while the run reads it is a ``DatasetChangedError`` (exit 1)
naming it, never rows of two datasets in one model.

This module reads file metadata, digests and the manifest's fingerprint, never rows; it imports
neither torch nor petastorm, so the driver uses it too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from common.errors import DatasetChangedError, DatasetError
from common.dataset import Manifest
from common.dataset_files import current_fingerprint, file_identity, verify_digest
from common.storage import resolve

# The data path's logger, kept when this moved out of training.data: the same records under the same name.
log = logging.getLogger("shardtrain.data")


@dataclass(frozen=True)
class ShardFile:
    uri: str
    first_row: int  # the `_row` of its first row
    rows: int
    sha256: str = ""  # from the manifest; checked before the file's rows are used
    bytes: int = -1
    # The version the driver planned on (``file_identity``); () when unknown: not compared.
    identity: tuple = ()


@dataclass(frozen=True)
class SplitLayout:
    name: str
    rows: int
    files: tuple[ShardFile, ...]
    verify: bool = True  # data.verify: first_read (True) or never
    dataset_uri: str = ""  # the dataset the files belong to (named when one was rewritten)
    # Files this process has checked. A layout is unpickled once per rank per run, so this is
    # "first read of each file in a run"; on the driver it stays empty.
    verified: set = field(default_factory=set, compare=False, repr=False)

    @classmethod
    def from_manifest(cls, manifest: Manifest, split: str, verify: bool = True) -> "SplitLayout":
        files, first = [], 0
        for entry, uri in zip(manifest.files(split), manifest.file_uris(split)):
            files.append(ShardFile(uri=uri, first_row=first, rows=entry.rows, sha256=entry.sha256, bytes=entry.bytes,
                                   identity=_planned_identity(uri)))
            first += entry.rows
        rows = manifest.rows(split)
        if first != rows:
            raise DatasetError(f"{manifest.root.uri}: field 'splits.{split}.rows' is {rows} but its files hold "
                               f"{first} rows; the manifest is inconsistent, re-shard the data")
        return cls(name=split, rows=rows, files=tuple(files), verify=verify, dataset_uri=manifest.root.uri)

    def verify_files(self, files) -> None:
        """The integrity hook: every reader calls it with the files it is about to open. Each file
        must still be the version planned on (``check_unchanged``: every call); then it is checked
        against the manifest's sha256 the first time (a DatasetError, exit 2, names a damaged
        file); ``data.verify: never`` turns the sha256 check off."""
        self.check_unchanged(files)
        if not self.verify:
            return
        for shard in files:
            if shard.uri in self.verified or not shard.sha256:
                continue
            verify_digest(resolve(shard.uri), shard.sha256, shard.bytes)
            self.verified.add(shard.uri)

    def check_unchanged(self, files=None) -> None:
        """``files`` (default: all of the split's) are the versions the driver planned on, or a
        DatasetChangedError (exit 1) names the dataset and the first file that differs."""
        for shard in self.files if files is None else files:
            if not shard.identity:
                continue
            try:
                now = file_identity(resolve(shard.uri))
            except FileNotFoundError:
                raise rewritten(self.dataset_uri, f"{shard.uri} is gone") from None
            except OSError as exc:
                # Unreadable metadata is a storage failure, said as such by the reader's own error.
                log.warning("%s: cannot read the file's size and version (%s); not compared", shard.uri, exc)
                continue
            if now != shard.identity:
                raise rewritten(self.dataset_uri, f"{shard.uri} is now {_shown(now)}, planned on "
                                                  f"{_shown(shard.identity)}")

    def files_overlapping(self, lo: int, hi: int) -> list[ShardFile]:
        return [f for f in self.files if f.rows and f.first_row < hi and f.first_row + f.rows > lo]


def _planned_identity(uri: str) -> tuple:
    try:
        return file_identity(resolve(uri))
    except OSError:
        return ()  # gone or unreadable now: the sha256 check (or the reader) names the file


def _shown(identity: tuple) -> str:
    return ", ".join(f"{name} {value}" for name, value in identity)


def rewritten(dataset_uri: str, detail: str) -> DatasetChangedError:
    """The one message for a dataset replaced under a run (docs/troubleshooting.md)."""
    return DatasetChangedError(
        f"dataset {dataset_uri}: it was rewritten while training read it ({detail}); the run stopped and published "
        "nothing: train again on the dataset as it is now (a shard job's overwrite of a dataset that a training "
        "holds needs output.ignore_readers=true)")


def check_manifest_unchanged(dataset_uri: str, fingerprint: str) -> None:
    """The manifest at ``dataset_uri`` still has ``fingerprint`` (a committed, readable one), or a
    DatasetChangedError (exit 1). One small read: each epoch start, and before publishing."""
    now = current_fingerprint(resolve(dataset_uri))
    if now != fingerprint:
        detail = (f"its manifest's fingerprint is now {now[:12]}, planned on {fingerprint[:12]}" if now else
                  "its committed manifest is gone or unreadable")
        raise rewritten(dataset_uri, detail)


__all__ = ["ShardFile", "SplitLayout", "check_manifest_unchanged", "rewritten"]
