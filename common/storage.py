"""Storage by URI, and the atomic-publish protocol every shardtrain output follows.

Supported: local paths and ``file://``, ``s3://`` (s3fs; ``s3a://`` is accepted as an alias),
``hdfs://`` (pyarrow's HDFS client), ``dbfs:/`` (the ``/dbfs`` FUSE mount on Databricks).

Publishing a directory: everything is written under a staging location beside the target,
then moved into place, and a ``_COMMITTED`` marker is written last. Readers call
``require_committed`` and refuse a directory without the marker, so a job that dies at any
point leaves nothing a reader will accept.

This module must stay free of Spark and torch: executors and training ranks import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import time
import uuid
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import urlparse

import fsspec

from common.errors import StorageError

MARKER = "_COMMITTED"
STAGING_TAG = "._staging-"
SCHEMES = ("file", "s3", "hdfs", "dbfs")
DBFS_MOUNT = os.environ.get("SHARDTRAIN_DBFS_MOUNT", "/dbfs")


@dataclass(frozen=True)
class Location:
    """A resolved URI: the fsspec file system and the path that file system understands."""

    uri: str
    scheme: str
    path: str

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return _filesystem(self.scheme, self.uri)

    def join(self, *parts: str) -> "Location":
        path = posixpath.join(self.path, *parts)
        return Location(uri=_join_uri(self.uri, *parts), scheme=self.scheme, path=path)

    def exists(self) -> bool:
        return self.fs.exists(self.path)

    def open(self, name: str, mode: str = "rb"):
        return self.fs.open(posixpath.join(self.path, name), mode)

    def read_text(self, name: str) -> str:
        with self.open(name, "rb") as fh:
            return fh.read().decode("utf-8")

    def write_text(self, name: str, text: str) -> None:
        self.fs.makedirs(self.path, exist_ok=True)
        with self.open(name, "wb") as fh:
            fh.write(text.encode("utf-8"))


def resolve(uri: str) -> Location:
    """Parse ``uri`` into a Location, or fail with a message naming the URI."""
    if not isinstance(uri, str) or not uri.strip():
        raise StorageError(f"empty storage URI: {uri!r}")
    uri = uri.strip()
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if len(scheme) == 1:  # a Windows drive letter is a local path, not a scheme
        scheme = ""
    if scheme in ("", "file"):
        path = parsed.path if scheme == "file" else uri
        path = os.path.abspath(os.path.expanduser(path))
        return Location(uri=path, scheme="file", path=path)
    if scheme in ("s3", "s3a"):
        if not parsed.netloc:
            raise StorageError(f"{uri}: an S3 URI needs a bucket, as in s3://bucket/prefix")
        path = f"{parsed.netloc}{parsed.path}".rstrip("/")
        return Location(uri=f"s3://{path}", scheme="s3", path=path)
    if scheme == "hdfs":
        return Location(uri=uri.rstrip("/"), scheme="hdfs", path=parsed.path.rstrip("/") or "/")
    if scheme == "dbfs":
        # dbfs:/a/b and dbfs:///a/b both name /dbfs/a/b on a Databricks driver or worker.
        rel = (parsed.netloc + parsed.path) if parsed.netloc else parsed.path
        path = posixpath.join(DBFS_MOUNT, rel.lstrip("/"))
        if not os.path.isdir(DBFS_MOUNT):
            raise StorageError(f"{uri}: dbfs:/ URIs need the {DBFS_MOUNT} mount, which exists only on Databricks")
        return Location(uri=path, scheme="file", path=path)
    raise StorageError(
        f"{uri}: unsupported URI scheme {parsed.scheme!r}; use a local path, file://, s3://, hdfs:// or dbfs:/")


def check_uri(uri: str) -> Location:
    """Resolve ``uri`` and set up its file system now (scheme, bucket, credentials), so a job can
    fail on a bad URI before it starts Spark or any other work."""
    loc = resolve(uri)
    loc.fs  # noqa: B018 - building the file system is the check (S3 credentials, HDFS connection)
    return loc


_FS_CACHE: dict[tuple, fsspec.AbstractFileSystem] = {}


def _filesystem(scheme: str, uri: str) -> fsspec.AbstractFileSystem:
    if scheme == "file":
        return fsspec.filesystem("file", auto_mkdir=True)
    if scheme == "s3":
        options = s3_options()
        key = ("s3", json.dumps(options, sort_keys=True), os.getpid())
        if key not in _FS_CACHE:
            _check_s3_credentials(uri, options)
            import s3fs  # imported here: only S3 users need it

            _FS_CACHE[key] = s3fs.S3FileSystem(**options)
        return _FS_CACHE[key]
    if scheme == "hdfs":
        parsed = urlparse(uri)
        key = ("hdfs", parsed.hostname, parsed.port, os.getpid())
        if key not in _FS_CACHE:
            from fsspec.implementations.arrow import HadoopFileSystem

            try:
                _FS_CACHE[key] = HadoopFileSystem(host=parsed.hostname or "default", port=parsed.port or 0)
            except OSError as exc:
                raise StorageError(f"{uri}: cannot connect to HDFS ({exc}); is HADOOP_HOME/CLASSPATH set?") from None
        return _FS_CACHE[key]
    raise StorageError(f"{uri}: unsupported URI scheme {scheme!r}")


def s3_options() -> dict:
    """s3fs options from the environment: AWS_ENDPOINT_URL (or SHARDTRAIN_S3_ENDPOINT) for
    S3-compatible stores and tests, SHARDTRAIN_S3_ANON=1 for public buckets."""
    options: dict = {}
    endpoint = os.environ.get("SHARDTRAIN_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    if os.environ.get("SHARDTRAIN_S3_ANON") == "1":
        options["anon"] = True
    return options


def _check_s3_credentials(uri: str, options: dict) -> None:
    if options.get("anon"):
        return
    import botocore.session

    if botocore.session.get_session().get_credentials() is None:
        raise StorageError(
            f"{uri}: no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, an instance role, or SHARDTRAIN_S3_ANON=1 for a public bucket")


def _join_uri(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *[p.strip("/") for p in parts if p]])


# --- atomic publish ---------------------------------------------------------------------------

def is_committed(uri: str | Location) -> bool:
    loc = uri if isinstance(uri, Location) else resolve(uri)
    return loc.fs.exists(posixpath.join(loc.path, MARKER))


def require_committed(uri: str | Location, what: str = "output") -> Location:
    """Return the Location if it holds a committed output; otherwise a StorageError that says why."""
    loc = uri if isinstance(uri, Location) else resolve(uri)
    if not loc.fs.exists(loc.path):
        raise StorageError(f"{loc.uri}: no such {what}")
    if not is_committed(loc):
        raise StorageError(
            f"{loc.uri}: {what} has no {MARKER} marker, so it is incomplete (a job died while writing it, "
            "or one is still writing); re-run the job that produces it")
    return loc


def read_marker(uri: str | Location) -> dict:
    loc = require_committed(uri)
    return json.loads(loc.read_text(MARKER))


@contextlib.contextmanager
def publish(uri: str, mode: str = "error", marker: dict | None = None) -> Iterator[Location]:
    """Stage an output directory and commit it on success.

    ``mode``: ``error`` refuses an existing output, ``overwrite`` replaces it. The caller writes
    everything under the yielded staging Location; on normal exit the staging directory is moved
    to ``uri`` and the marker is written last. On an exception the staging directory is removed
    and ``uri`` is untouched (``error``) or untouched-and-still-committed (``overwrite``).
    """
    from common.errors import OutputExistsError

    final = resolve(uri)
    fs = final.fs
    if mode not in ("error", "overwrite"):
        raise ValueError(f"publish mode must be error or overwrite, got {mode!r}")
    if mode == "error" and fs.exists(final.path):
        raise OutputExistsError(
            f"{final.uri} already exists; set output.mode=overwrite to replace it "
            "(or skip_if_exists to keep it)")
    parent, name = posixpath.split(final.path.rstrip("/"))
    token = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    staging = Location(uri=_join_uri(_parent_uri(final.uri), f".{name}{STAGING_TAG}{token}"),
                       scheme=final.scheme, path=posixpath.join(parent, f".{name}{STAGING_TAG}{token}"))
    fs.makedirs(staging.path, exist_ok=True)
    try:
        yield staging
    except BaseException:
        _remove(fs, staging.path)
        raise
    commit(staging, final, marker or {})


def commit(staging: Location, final: Location, marker: dict) -> None:
    fs = final.fs
    if fs.exists(final.path):
        # Unmark first: from here until the new marker lands, readers refuse the directory.
        marker_path = posixpath.join(final.path, MARKER)
        if fs.exists(marker_path):
            fs.rm(marker_path)
        _remove(fs, final.path)
    if final.scheme == "file":
        os.makedirs(os.path.dirname(final.path) or "/", exist_ok=True)
        os.replace(staging.path, final.path)  # atomic on one file system
    else:
        # Object stores have no directory rename: copy each object, then drop the staging prefix.
        # Readers still see nothing until the marker below lands.
        for src in fs.find(staging.path):
            fs.copy(src, final.path + src[len(staging.path):])
        _remove(fs, staging.path)
    record = {"committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **marker}
    final.write_text(MARKER, json.dumps(record, indent=2, sort_keys=True))


def clean_stale_staging(uri: str) -> list[str]:
    """Remove staging directories that dead jobs left beside ``uri``; returns what was removed."""
    final = resolve(uri)
    parent, name = posixpath.split(final.path.rstrip("/"))
    fs = final.fs
    pattern = posixpath.join(parent, f".{name}{STAGING_TAG}*")
    removed = []
    for path in fs.glob(pattern):
        _remove(fs, path)
        removed.append(path)
    return removed


def _parent_uri(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[0]


def _remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
