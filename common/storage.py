"""Storage by URI: what a URI names, its file system, and the few file operations every output is
built from.

Supported: local paths and ``file://``, ``s3://`` (s3fs; ``s3a://`` is accepted as an alias),
``hdfs://`` (pyarrow's HDFS client), ``dbfs:/`` (the ``/dbfs`` FUSE mount on Databricks), and Unity
Catalog volumes: ``/Volumes/<catalog>/<schema>/<volume>/...`` and ``dbfs:/Volumes/...`` both name the
volume path, which every Databricks compute type mounts at ``/Volumes`` (no ``/dbfs`` needed).

A local path is used with its symlinks resolved: a linked output is replaced at its target. A
config's relative paths are made absolute when it is loaded (``absolute_uri``, from common.config),
so executors in other working directories read the same place; ``is_local_path`` says which paths
only this machine can read. A file is written whole or not at all (``write_whole``), and a file
system's OSError, or an S3 endpoint that does not answer, becomes one line naming the path
(``storage_errors``).

Paths are data, never patterns: staging directories, locks and checkpoints are found by listing
the parent and comparing names exactly (``list_names``; ``common.publish.siblings``) and removed by
exact path (``remove_tree``); only source paths (common.sources) are globbed. ``beside`` names an
output's hidden siblings (its staging directories, replaced copies, writer lock, reader leases).

Built on this module, each in its own: the commit marker that makes a directory an output
(common.commit_marker), publishing one atomically (common.publish), one writer per output
(common.writer_lock), and what an output path may replace or overlap (common.output_guard). This
module knows none of them.

This module must stay free of Spark and torch: executors and training ranks import it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import shutil
import uuid
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import urlparse

import fsspec

from common.errors import StorageError, StorageIOError, first_line
from common.model_registry import is_registry_uri, parse_registry_uri

# A file being written whole (``write_whole``): ``.NAME<tag><token>`` beside NAME until it is renamed.
WRITING_TAG = ".writing-"
SCHEMES = ("file", "s3", "hdfs", "dbfs")
DBFS_MOUNT = os.environ.get("SHARDTRAIN_DBFS_MOUNT", "/dbfs")
VOLUMES_ROOT = "/Volumes"  # Unity Catalog volumes, on every Databricks compute type


def is_volume_path(path: str) -> bool:
    """``/Volumes/...``: a Unity Catalog volume path."""
    return path == VOLUMES_ROOT or path.startswith(VOLUMES_ROOT + "/")


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
        """``name`` under this directory, whole or not at all (``write_whole``)."""
        with storage_errors(f"writing {name}", self.uri):
            write_whole(self.join(name), text.encode("utf-8"))


def write_whole(loc: Location, payload: bytes) -> None:
    """Write the file at ``loc`` so that it is either its old self or all of ``payload``, never a
    part: a job that dies, or a disk that fills, mid-write leaves the previous file (or none), not
    a report without its closing tags. Local disk, the DBFS and volume mounts and HDFS write a hidden
    sibling and rename it over the file; an object store's single PUT is already all-or-nothing.
    Crash-atomic, not power-loss durable: no fsync (these are reports and records, not the data)."""
    fs = loc.fs
    if loc.scheme == "s3":
        fs.pipe_file(loc.path, payload)
        return
    parent, base = posixpath.split(loc.path)
    fs.makedirs(parent, exist_ok=True)
    temporary = posixpath.join(parent, f".{base}{WRITING_TAG}{uuid.uuid4().hex}")
    try:
        with fs.open(temporary, "wb") as fh:
            fh.write(payload)
        if loc.scheme == "file":
            os.replace(temporary, loc.path)
        else:  # HDFS: a rename does not replace an existing file
            if fs.exists(loc.path):
                fs.rm_file(loc.path)
            fs.mv(temporary, loc.path)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm_file(temporary)
        raise


@contextlib.contextmanager
def storage_errors(what: str, uri: str) -> Iterator[None]:
    """Turn an OSError from the file system, or an S3 endpoint that does not answer, into one
    line naming the path (exit status 1)."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        # botocore's timeouts are OSErrors too: the endpoint is named before the generic line.
        unreachable = _unreachable_endpoint(uri, exc)
        if unreachable is not None:
            raise unreachable from None
        if not isinstance(exc, OSError):
            raise
        reason = exc.strerror or str(exc) or type(exc).__name__
        if exc.filename and str(exc.filename) not in reason:
            reason += f": {exc.filename}"  # the file inside ``uri`` that failed, when the error knows it
        raise StorageIOError(f"{uri}: {what} failed: {type(exc).__name__}: {reason}") from None


def _unreachable_endpoint(uri: str, exc: BaseException) -> StorageIOError | None:
    """The one-line error for an S3 endpoint that refused, timed out or could not be resolved
    (botocore's own error, after its retries), or None for any other error."""
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError, ConnectTimeoutError, ReadTimeoutError
    except ImportError:  # no S3 support installed, so no S3 error either
        return None
    if not isinstance(exc, (BotoConnectionError, ConnectTimeoutError, ReadTimeoutError)):
        return None
    endpoint = s3_options().get("client_kwargs", {}).get("endpoint_url")
    if not endpoint:  # AWS itself: botocore's error carries the URL it tried
        tried = urlparse(str(getattr(exc, "kwargs", {}).get("endpoint_url", "")))
        endpoint = f"{tried.scheme}://{tried.netloc}" if tried.netloc else "of AWS"
    reason = first_line(exc)
    return StorageIOError(f"{uri}: cannot reach the S3 endpoint {endpoint}: {reason} (check SHARDTRAIN_S3_ENDPOINT "
                          "or AWS_ENDPOINT_URL, and the network)")


def _scheme(uri: str) -> str:
    """``uri``'s scheme, lower case; "" for a plain path."""
    scheme = urlparse(uri).scheme.lower()
    return "" if len(scheme) == 1 else scheme  # a Windows drive letter is a local path, not a scheme


def absolute_uri(uri: str) -> str:
    """``uri`` as it names the same place from any process, whatever its working directory: a
    relative local path made absolute from this one's (``~`` expanded); a URI with a scheme (s3://,
    hdfs://, dbfs:/, models:/, file:///...) and an absolute path (/Volumes/... too) as they are.
    Symlinks stay in it: ``resolve`` follows them where the path is used."""
    if not isinstance(uri, str) or not uri.strip() or _scheme(uri.strip()) or os.path.isabs(uri.strip()):
        return uri  # an empty one is left for resolve to refuse, naming it
    return os.path.abspath(os.path.expanduser(uri.strip()))


def is_local_path(uri: str) -> bool:
    """Whether ``uri`` names this machine's own files (a plain path or file://), which another
    machine cannot read: not S3, HDFS, DBFS, a Unity Catalog volume (/Volumes/..., mounted on every
    Databricks compute) or a models:/ URI."""
    scheme = _scheme(uri.strip())
    if scheme not in ("", "file"):
        return False
    return not is_volume_path(urlparse(uri.strip()).path if scheme == "file" else uri.strip())


def resolve(uri: str) -> Location:
    """Parse ``uri`` into a Location, or fail with a message naming the URI."""
    if not isinstance(uri, str) or not uri.strip():
        raise StorageError(f"empty storage URI: {uri!r}")
    uri = uri.strip()
    parsed = urlparse(uri)
    scheme = _scheme(uri)
    if scheme in ("", "file"):
        if scheme == "file":
            _check_file_uri(uri, parsed.netloc)
        path = parsed.path if scheme == "file" else uri
        path = _real_local_path(uri, os.path.abspath(os.path.expanduser(path)))
        return Location(uri=path, scheme="file", path=path)
    # An S3 key or HDFS path may hold '?' and '#' (and '?' is a glob character in a source
    # path): everything after the authority is the path, never a query or a fragment to drop.
    authority, _, rest = uri.split("://", 1)[1].partition("/") if "://" in uri else ("", "", "")
    if scheme in ("s3", "s3a"):
        if not authority:
            raise StorageError(f"{uri}: an S3 URI needs a bucket, as in s3://bucket/prefix")
        path = f"{authority}/{rest}".rstrip("/")
        return Location(uri=f"s3://{path}", scheme="s3", path=path)
    if scheme == "hdfs":
        return Location(uri=uri.rstrip("/"), scheme="hdfs", path=("/" + rest).rstrip("/") or "/")
    if scheme == "dbfs":
        # dbfs:/a/b and dbfs:///a/b both name /dbfs/a/b on a Databricks driver or worker.
        # dbfs:/Volumes/x is the volume path /Volumes/x, not /dbfs/Volumes/x: standard and serverless
        # compute have no /dbfs mount, and volumes are mounted at /Volumes everywhere.
        rel = (parsed.netloc + parsed.path) if parsed.netloc else parsed.path
        if is_volume_path("/" + rel.lstrip("/")):
            return resolve("/" + rel.lstrip("/"))
        path = posixpath.join(DBFS_MOUNT, rel.lstrip("/"))
        if not os.path.isdir(DBFS_MOUNT):
            raise StorageError(f"{uri}: dbfs:/ URIs need the {DBFS_MOUNT} mount, which exists only on Databricks")
        return Location(uri=path, scheme="file", path=path)
    if is_registry_uri(uri):
        raise StorageError(f"{uri}: a models:/ URI names a model in an MLflow registry, not a storage path; only model "
                           "URIs take it (score.model, teacher.model, load_model)")
    raise StorageError(
        f"{uri}: unsupported URI scheme {parsed.scheme!r}; use a local path, file://, s3://, hdfs:// or dbfs:/")


def _check_file_uri(uri: str, host: str) -> None:
    """A file:// URI names a local path and nothing else: a host, a ?query or a #fragment would be
    silently dropped, so they are refused (exit 2), naming the URI."""
    extra = [f"a host ({host!r})" if host not in ("", "localhost") else "",
             "a ?query" if "?" in uri else "", "a #fragment" if "#" in uri else ""]
    extra = [e for e in extra if e]
    if extra:
        raise StorageError(f"{uri}: a file:// URI names a local path only, and this one has {' and '.join(extra)}, "
                           "which would be ignored; write the path itself (/abs/path or file:///abs/path; a "
                           "'?' or '#' in a file name needs the plain path form)")


def _real_local_path(uri: str, path: str) -> str:
    """``path`` with every symlink resolved: an output reached through a link is checked and
    replaced at its target (the link stays a link), and two spellings of one directory share one
    lock. A link loop fails here, naming the URI, before any work."""
    try:
        return os.path.realpath(path, strict=True)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StorageError(f"{uri}: is a symlink loop (following its links leads back to them); point the link at "
                               "a real directory, or choose another path") from None
        return os.path.realpath(path)  # not there yet (an output to create, a glob): resolve what exists


def check_uri(uri: str) -> Location | None:
    """Resolve ``uri`` and set up its file system now (scheme, bucket, credentials), so a job can
    fail on a bad URI before it starts Spark or any other work. A ``models:/`` URI is checked
    for its form only (its registry is asked when the model is loaded); the result is then None."""
    if is_registry_uri(uri):
        parse_registry_uri(uri)
        return None
    loc = resolve(uri)
    loc.fs  # noqa: B018 - building the file system is the check (S3 credentials, HDFS connection)
    if loc.scheme == "s3":
        _check_s3_reachable(loc)
    return loc


def _check_s3_reachable(loc: Location) -> None:
    """One cheap request, so an S3 endpoint that does not answer fails the job now, in one line
    naming it (exit 1). Any other answer (a missing key, no permission) is left to the job's own
    first access, which names what it needed."""
    try:
        loc.fs.exists(loc.path)
    except Exception as exc:  # noqa: BLE001 - only an unreachable endpoint is this check's business
        unreachable = _unreachable_endpoint(loc.uri, exc)
        if unreachable is not None:
            raise unreachable from None


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


# --- paths are data, never patterns -------------------------------------------------------------
# A user's path may hold ``[``, ``*``, ``?``: every listing and removal here compares names
# exactly (list the parent, then filter), never hands a path to glob() or to an fsspec call that
# expands patterns (on S3, ``rm`` and ``copy`` glob their argument).

def list_names(loc: Location) -> list[str]:
    """The base names of the entries directly under ``loc`` ([] if it does not exist)."""
    fs = loc.fs
    fs.invalidate_cache(loc.path)  # another process may have just added or removed an entry
    try:
        if not fs.isdir(loc.path):
            return []
        paths = fs.ls(loc.path, detail=False)
    except FileNotFoundError:
        return []
    own = loc.path.rstrip("/")  # an object store may list the prefix itself
    return [posixpath.basename(p.rstrip("/")) for p in paths if p.rstrip("/") != own]


def remove_tree(loc: Location) -> None:
    """Remove ``loc`` and everything under it, naming exactly that path (no pattern expansion)."""
    fs = loc.fs
    try:
        if loc.scheme == "file":
            if os.path.isdir(loc.path) and not os.path.islink(loc.path):
                shutil.rmtree(loc.path)
            elif os.path.lexists(loc.path):
                os.remove(loc.path)
        elif loc.scheme == "s3":
            for path in objects_under(loc):
                fs.rm_file(path)
            fs.invalidate_cache(loc.path)
        elif fs.exists(loc.path):
            fs.rm(loc.path, recursive=True)  # pyarrow's HDFS client deletes the path it is given
    except FileNotFoundError:
        pass


def objects_under(loc: Location) -> list[str]:
    """Every object (file) under ``loc``, by exact prefix ``loc/`` (plus ``loc`` itself if a file)."""
    fs = loc.fs
    try:
        found = fs.find(loc.path)
    except FileNotFoundError:
        return []
    prefix = loc.path.rstrip("/") + "/"
    return sorted(p for p in found if p.startswith(prefix) or p == loc.path)


def beside(final: Location, suffix: str) -> Location:
    """The hidden sibling ``.NAME<suffix>`` of ``final`` (staging, lock, replaced copy, reader leases)."""
    parent, name = posixpath.split(final.path.rstrip("/"))
    base = f".{name}{suffix}"
    return Location(uri=_join_uri(parent_uri(final.uri), base), scheme=final.scheme, path=posixpath.join(parent, base))


def parent_uri(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[0]
