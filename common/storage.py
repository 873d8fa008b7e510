"""Storage by URI, and the atomic-publish protocol every shardtrain output follows.

Supported: local paths and ``file://``, ``s3://`` (s3fs; ``s3a://`` is accepted as an alias),
``hdfs://`` (pyarrow's HDFS client), ``dbfs:/`` (the ``/dbfs`` FUSE mount on Databricks).

Publishing a directory: everything is written under a staging location beside the target,
then moved into place, and a ``_COMMITTED`` marker is written last. Readers call
``require_committed`` and refuse a directory without the marker, so a job that dies at any
point leaves nothing a reader will accept.

What an output may replace: the marker records the output's ``kind`` (``shardtrain.dataset``,
``shardtrain.model``, ``shardtrain.checkpoint``, ``shardtrain.scores``); ``overwrite`` replaces only an empty directory or
a shardtrain output of the same kind (``check_replaceable``), never a user's file or directory.
``check_disjoint`` refuses an output equal to, inside or containing an input.

One writer at a time: ``output_lock`` holds a lock file beside the output for the whole job
(``publish`` takes it too, re-entrantly; ``writing_under`` lets another process of the same job,
such as a training rank, write under the lock its driver holds). Locally it is an ``flock`` on the file, which the
kernel releases when the holder dies, so a dead holder's lock is taken over without guessing.
On S3 the lock is a conditional create (``If-None-Match: *``); a lock whose holder is on this
host and whose pid is gone is taken over; a holder on another host cannot be checked, so its lock
is reported and must be removed by hand if that job is dead. HDFS (and a local mount without
flock) has no conditional create: there the lock is checked, then written (two writers starting
in the same instant may both pass).

This module must stay free of Spark and torch: executors and training ranks import it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import urlparse

import fsspec

from common.errors import OutputExistsError, OutputLockedError, StorageError, StorageIOError

MARKER = "_COMMITTED"
# Written with the files and removed after the marker: a directory holding it is our own output
# whose commit died half-way (object stores copy file by file), so overwrite may replace it.
PUBLISHING = "_PUBLISHING"
STAGING_TAG = "._staging-"
LOCK_TAG = ".shardtrain-lock"
KIND_DATASET = "shardtrain.dataset"
KIND_MODEL = "shardtrain.model"
KIND_CHECKPOINT = "shardtrain.checkpoint"
KIND_SCORES = "shardtrain.scores"
SCHEMES = ("file", "s3", "hdfs", "dbfs")
DBFS_MOUNT = os.environ.get("SHARDTRAIN_DBFS_MOUNT", "/dbfs")

log = logging.getLogger("shardtrain.storage")


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
        with storage_errors(f"writing {name}", self.uri):
            self.fs.makedirs(self.path, exist_ok=True)
            with self.open(name, "wb") as fh:
                fh.write(text.encode("utf-8"))


@contextlib.contextmanager
def storage_errors(what: str, uri: str) -> Iterator[None]:
    """Turn an OSError from the file system into one line naming the path (exit status 1)."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        if exc.filename and str(exc.filename) not in reason:
            reason += f": {exc.filename}"  # the file inside ``uri`` that failed, when the error knows it
        raise StorageIOError(f"{uri}: {what} failed: {type(exc).__name__}: {reason}") from None


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

    ``mode``: ``error`` refuses an existing output, ``overwrite`` replaces it if it is an output of
    the same kind (``marker["kind"]``; see ``check_replaceable``). The caller writes everything
    under the yielded staging Location; on normal exit the staging directory is moved to ``uri``
    and the marker is written last. On an exception the staging directory is removed and ``uri``
    is untouched. The output's lock is held throughout (re-entrant: a job holding it already,
    as the shard job does, keeps it).
    """
    final = resolve(uri)
    fs = final.fs
    marker = dict(marker or {})
    kind = marker.get("kind")
    if mode not in ("error", "overwrite"):
        raise ValueError(f"publish mode must be error or overwrite, got {mode!r}")
    with output_lock(final.uri):
        if mode == "error" and fs.exists(final.path):
            raise OutputExistsError(
                f"{final.uri} already exists; set output.mode=overwrite to replace it "
                "(or skip_if_exists to keep it)")
        check_replaceable(final.uri, kind)
        _remove_staging(final)  # left by writers of this output that died (we hold its lock)
        parent, name = posixpath.split(final.path.rstrip("/"))
        token = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        staging = Location(uri=_join_uri(_parent_uri(final.uri), f".{name}{STAGING_TAG}{token}"),
                           scheme=final.scheme, path=posixpath.join(parent, f".{name}{STAGING_TAG}{token}"))
        with storage_errors("creating the staging directory", staging.uri):
            fs.makedirs(staging.path, exist_ok=True)
        try:
            yield staging
        except BaseException:
            _remove(fs, staging.path)
            raise
        with storage_errors("committing the output", final.uri):
            commit(staging, final, marker, kind)


def commit(staging: Location, final: Location, marker: dict, kind: str | None = None) -> None:
    fs = final.fs
    check_replaceable(final.uri, kind)  # again: the staged work took time
    pending = json.dumps({"kind": kind})
    if fs.exists(final.path):
        # Unmark first: from here until the new marker lands, readers refuse the directory.
        marker_path = posixpath.join(final.path, MARKER)
        if fs.exists(marker_path):
            fs.rm(marker_path)
        _remove(fs, final.path)
    if final.scheme == "file":
        staging.write_text(PUBLISHING, pending)
        os.makedirs(os.path.dirname(final.path) or "/", exist_ok=True)
        os.replace(staging.path, final.path)  # atomic on one file system
    else:
        # Object stores have no directory rename: copy each object, then drop the staging prefix.
        # Readers still see nothing until the marker below lands.
        final.write_text(PUBLISHING, pending)
        for src in fs.find(staging.path):
            fs.copy(src, final.path + src[len(staging.path):])
        _remove(fs, staging.path)
    record = {"committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **marker}
    final.write_text(MARKER, json.dumps(record, indent=2, sort_keys=True))
    fs.rm(posixpath.join(final.path, PUBLISHING))


# --- what an output may replace, and what it must not touch ---------------------------------------

def output_kind(uri: str | Location) -> tuple[bool, str | None]:
    """(is a shardtrain output, its kind): from the marker, or from a commit that died half-way."""
    loc = uri if isinstance(uri, Location) else resolve(uri)
    for name in (MARKER, PUBLISHING):
        if loc.fs.exists(posixpath.join(loc.path, name)):
            try:
                record = json.loads(loc.read_text(name))
            except (OSError, ValueError):
                return False, None
            if not isinstance(record, dict):
                return False, None
            # Models published before markers carried a kind recorded it as "format".
            return True, record.get("kind") or record.get("format")
    return False, None


def check_replaceable(uri: str, kind: str | None) -> None:
    """Refuse (exit 2, naming the path and what it holds) to replace anything at ``uri`` but
    nothing, an empty directory, or a shardtrain output of the same ``kind``."""
    loc = resolve(uri)
    fs = loc.fs
    with storage_errors("checking what the output path holds", loc.uri):
        if not fs.exists(loc.path):
            return
        what = kind or "output of this kind"
        if not fs.isdir(loc.path):
            raise OutputExistsError(
                f"{loc.uri} is a regular file, not a shardtrain {what}; output.mode=overwrite replaces only "
                "what shardtrain published there: move the file away or choose another output path")
        entries = sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(loc.path, detail=False))
        if not entries:
            return
        ours, found = output_kind(loc)
        if not ours:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise OutputExistsError(
                f"{loc.uri} holds {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} that shardtrain did not "
                f"publish ({shown}); output.mode=overwrite replaces only a shardtrain {what}: move them away or "
                "choose another output path")
        if found != kind:
            raise OutputExistsError(
                f"{loc.uri} holds a {found or 'shardtrain output of another kind'}, not a {what}; "
                "output.mode=overwrite replaces only an output of the same kind: choose another output path")


def check_disjoint(output_uri: str, output_key: str, inputs: dict[str, str]) -> None:
    """Refuse (exit 2) an output equal to, inside or containing an input; ``inputs`` maps a
    description (naming the config key) to the input's URI."""
    from common.errors import ConfigError

    out = _comparable(output_uri)
    for what, uri in inputs.items():
        if not uri:
            continue
        inp = _comparable(uri)
        if out[0] != inp[0]:
            continue
        if out[1] == inp[1]:
            relation = "is the same path as"
        elif out[1].startswith(inp[1].rstrip("/") + "/"):
            relation = "is inside"
        elif inp[1].startswith(out[1].rstrip("/") + "/"):
            relation = "contains"
        else:
            continue
        raise ConfigError(f"{output_key} {output_uri} {relation} {what} ({uri}); writing the output there would "
                          "replace or mix with that input: choose an output path outside it")


def _comparable(uri: str) -> tuple[str, str]:
    """(file system, normalized path without glob parts) for comparing locations."""
    loc = resolve(uri)
    parts = []
    for part in loc.path.split("/"):
        if any(ch in part for ch in "*?["):
            break
        parts.append(part)
    path = "/".join(parts) or "/"
    if loc.scheme == "file":
        return "file", os.path.realpath(path)
    host = urlparse(loc.uri).netloc if loc.scheme == "hdfs" else ""
    return f"{loc.scheme}://{host}", posixpath.normpath("/" + path)


# --- one writer at a time ----------------------------------------------------------------------

_HELD: dict[str, object] = {}  # lock path -> what releases it, for the locks this process holds


def lock_location(uri: str | Location) -> Location:
    """The lock file of an output: beside it, hidden (Spark and source listings skip dot-files)."""
    final = uri if isinstance(uri, Location) else resolve(uri)
    parent, name = posixpath.split(final.path.rstrip("/"))
    return Location(uri=_join_uri(_parent_uri(final.uri), f".{name}{LOCK_TAG}"), scheme=final.scheme,
                    path=posixpath.join(parent, f".{name}{LOCK_TAG}"))


@contextlib.contextmanager
def output_lock(uri: str) -> Iterator[dict]:
    """Hold ``uri``'s writer lock; a second writer gets OutputLockedError (exit 1) naming the holder.
    Re-entrant within a process. Yields this holder's record (host, pid, started_at, token)."""
    lock = lock_location(uri)
    if lock.path in _HELD:
        yield _HELD[lock.path][0]
        return
    record = {"host": socket.gethostname(), "pid": os.getpid(), "uri": resolve(uri).uri,
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "token": uuid.uuid4().hex}
    with storage_errors("taking the writer lock", lock.uri):
        release = _lock_file(lock, record) if lock.scheme == "file" else _lock_object(lock, record)
    _HELD[lock.path] = (record, release)
    try:
        yield record
    finally:
        del _HELD[lock.path]
        with storage_errors("releasing the writer lock", lock.uri):
            release()


@contextlib.contextmanager
def writing_under(uri: str, record: dict) -> Iterator[dict]:
    """Write ``uri`` under the writer lock another process of the same job holds (``record``: what
    that holder's ``output_lock`` yielded; training's driver holds a model path's lock while rank 0
    publishes from an executor). The lock must still hold ``record``'s token, else
    OutputLockedError names who holds it now; inside, ``output_lock(uri)`` (and so ``publish``) in
    this process goes on under it, and leaving releases nothing: the holder does that."""
    lock = lock_location(uri)
    if lock.path in _HELD:  # this process holds it itself (in-process training)
        yield _HELD[lock.path][0]
        return
    with storage_errors("checking the writer lock", lock.uri):
        try:
            holder = _parse_holder(lock.fs.cat_file(lock.path))
        except FileNotFoundError:
            holder = None
    if holder and lock.scheme == "file" and _flock_free(lock.path):
        holder = None  # the record is the holder's, but its holder has died (the kernel let go)
    if not holder or holder.get("token") != record.get("token"):
        mine = f"pid {record.get('pid')} on host {record.get('host')}"
        if holder:
            raise _locked_error(lock, holder, f"; the lock this job took ({mine}) is no longer held")
        raise OutputLockedError(f"{_output_of(lock)}: the writer lock this job took ({mine}, lock {lock.uri}) is no "
                                "longer held (its holder died?); nothing was written")
    _HELD[lock.path] = (holder, lambda: None)
    try:
        yield holder
    finally:
        del _HELD[lock.path]


def _flock_free(path: str) -> bool:
    """Whether no process holds the flock on the local lock file ``path`` (probed, then let go)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return False  # no flock here (some FUSE mounts): the record is all there is to go by
    finally:
        os.close(fd)  # closing drops a lock the probe took
    return True


def _locked_error(lock: Location, holder: dict | None, extra: str = "") -> OutputLockedError:
    if holder:
        who = (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started_at')}")
    else:
        who = "another process (its record is still being written)"
    return OutputLockedError(f"{_output_of(lock)} is being written by {who} (lock {lock.uri}); wait for that job "
                             f"to finish{extra}")


def _output_of(lock: Location) -> str:
    parent = _parent_uri(lock.uri)
    name = lock.uri.rsplit("/", 1)[-1][1:-len(LOCK_TAG)]
    return f"{parent}/{name}"


def _lock_file(lock: Location, record: dict):
    """flock on a local lock file: the kernel drops it when the holder dies, so a dead holder's
    file is simply locked again (its record is logged as taken over)."""
    import fcntl

    os.makedirs(os.path.dirname(lock.path) or "/", exist_ok=True)
    while True:
        existed = os.path.exists(lock.path)
        fd = os.open(lock.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _parse_holder(os.pread(fd, 65536, 0))
            os.close(fd)
            raise _locked_error(lock, holder) from None
        except OSError:  # no flock on this file system (some FUSE mounts): check, then write
            os.close(fd)
            if not existed:
                os.unlink(lock.path)
            return _lock_object(lock, record)
        # The holder may have released (unlinked) the file between our open and flock: then we
        # locked an orphan inode, and must start over on the file now at the path.
        try:
            current = os.stat(lock.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    previous = _parse_holder(os.pread(fd, 65536, 0))
    if previous:
        log.warning("%s: taking over the writer lock of pid %s on host %s (started %s), which has exited",
                    lock.uri, previous.get("pid"), previous.get("host"), previous.get("started_at"))
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)

    def release() -> None:
        try:
            os.unlink(lock.path)  # while still locked: the next writer finds no file, or a new one
        finally:
            os.close(fd)

    return release


def _lock_object(lock: Location, record: dict):
    """A lock object created only if absent (S3 If-None-Match); HDFS: check, then write."""
    fs = lock.fs
    payload = json.dumps(record).encode()
    for _ in range(2):  # the second try follows the removal of a dead holder's lock
        try:
            if lock.scheme == "s3":
                with fs.open(lock.path, "xb") as fh:  # s3fs: PutObject with If-None-Match: *
                    fh.write(payload)
            else:
                if fs.exists(lock.path):
                    raise FileExistsError(lock.path)
                with fs.open(lock.path, "wb") as fh:
                    fh.write(payload)
            break
        except FileExistsError:
            try:
                holder = _parse_holder(fs.cat_file(lock.path))
            except FileNotFoundError:
                continue  # released between our create and our read: try again
            if holder and holder.get("host") == socket.gethostname() and not _pid_alive(holder.get("pid")):
                log.warning("%s: removing the writer lock of pid %s (started %s), which has exited",
                            lock.uri, holder.get("pid"), holder.get("started_at"))
                fs.rm(lock.path)
                continue
            raise _locked_error(lock, holder, "; if it is dead (another host cannot be checked from here), "
                                              f"delete {lock.uri}") from None
    else:
        raise _locked_error(lock, None)

    def release() -> None:
        try:
            holder = _parse_holder(fs.cat_file(lock.path))
        except FileNotFoundError:
            return
        if holder and holder.get("token") == record["token"]:
            fs.rm(lock.path)

    return release


def _parse_holder(raw: bytes) -> dict | None:
    try:
        holder = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # another user's process, or no pid recorded: assume alive
    return True


def clean_stale_staging(uri: str) -> list[str]:
    """Remove staging directories that dead jobs left beside ``uri``; returns what was removed.

    Runs under ``output_lock(uri)`` (re-entrant): every writer of ``uri`` stages under that lock,
    so while we hold it no live job owns a staging directory there.
    """
    final = resolve(uri)
    with output_lock(final.uri):
        return _remove_staging(final)


def _remove_staging(final: Location) -> list[str]:
    parent, name = posixpath.split(final.path.rstrip("/"))
    fs = final.fs
    pattern = posixpath.join(parent, f".{name}{STAGING_TAG}*")
    removed = []
    with storage_errors("removing staging left by an earlier job", final.uri):
        for path in fs.glob(pattern):
            _remove(fs, path)
            removed.append(path)
    if removed:
        log.info("%s: removed %d staging director%s left by earlier jobs", final.uri, len(removed),
                 "y" if len(removed) == 1 else "ies")
    return removed


def _parent_uri(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[0]


def _remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
