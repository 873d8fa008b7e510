"""A file's bytes against a recorded sha256, streamed (``verify_digest``): what a dataset's shard
files (``common.dataset_files``) and a feature kind's side files (``FeatureSpec.attach``) are
checked with. Its own module so that ``common.features`` can use it without importing the dataset
modules that import ``common.features``."""

from __future__ import annotations

import hashlib

from common.errors import DatasetError, StorageIOError


def verify_digest(loc: Location, sha256: str, size: int | None = None) -> None:
    """``loc``'s bytes must hash to ``sha256`` (and number ``size``, when given): streamed in 1 MiB
    blocks, so memory stays flat whatever the file size."""
    digest = hashlib.sha256()
    try:
        with loc.fs.open(loc.path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
            got_size = fh.tell()
    except FileNotFoundError:
        raise DatasetError(f"{loc.uri}: the file is missing, though the manifest lists it; re-run the shard job "
                           "to rebuild the dataset") from None
    except OSError as exc:
        raise StorageIOError(f"{loc.uri}: reading the file to verify it failed: {exc}") from None
    if size is not None and size >= 0 and got_size != size:
        raise DatasetError(f"{loc.uri}: the file holds {got_size} bytes, but the manifest recorded {size}; it changed "
                           "after the shard job wrote it (a damaged or replaced file): re-run the shard job")
    if digest.hexdigest() != sha256:
        raise DatasetError(f"{loc.uri}: sha256 {digest.hexdigest()[:16]}... does not match the manifest's "
                           f"{str(sha256)[:16]}...; the file changed after the shard job wrote it (a damaged or "
                           "replaced file): re-run the shard job")
