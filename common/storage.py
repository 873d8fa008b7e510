"""Storage by URI, and the atomic-publish protocol every shardtrain output follows.

Supported: local paths and ``file://``, ``s3://`` (s3fs; ``s3a://`` is accepted as an alias),
``hdfs://`` (pyarrow's HDFS client), ``dbfs:/`` (the ``/dbfs`` FUSE mount on Databricks), and Unity
Catalog volumes: ``/Volumes/<catalog>/<schema>/<volume>/...`` and ``dbfs:/Volumes/...`` both name the
volume path, which every Databricks compute type mounts at ``/Volumes`` (no ``/dbfs`` needed).

Publishing a directory: everything is written under a staging location beside the target, the
``_COMMITTED`` marker last, then it is moved into place. Readers call ``require_committed`` and
refuse a directory without the marker, so a job that dies at any point leaves nothing a reader
will accept. Overwrite is a swap (``commit``): the old output is moved aside, the new one moved
in, then the old one deleted, so a failure at any point leaves one of them committed, and the
next writer finishes a swap a dead job left half-done (``clean_stale_staging``). A local path
is used with its symlinks resolved: a linked output is replaced at its target. A config's relative
paths are made absolute when it is loaded (``absolute_uri``, from common.config), so executors in
other working directories read the same place; ``is_local_path`` says which paths only this machine
can read.

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

Paths are data, never patterns: staging directories, locks and checkpoints are found by listing
the parent and comparing names exactly (``siblings``, ``list_names``) and removed by exact path
(``remove_tree``); only source paths (common.sources) are globbed.

This module must stay free of Spark and torch: executors and training ranks import it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import posixpath
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import urlparse

import fsspec

from common.errors import ConfigError, OutputExistsError, OutputLockedError, StorageError, StorageIOError, first_line
from common.model_registry import is_registry_uri, parse_registry_uri
from common.faults import fault_point

MARKER = "_COMMITTED"
# Written with the files and removed after the marker: a directory holding it is our own output
# whose commit died half-way (object stores copy file by file), so overwrite may replace it.
PUBLISHING = "_PUBLISHING"
STAGING_TAG = "._staging-"
# Where an overwrite keeps the output it replaces until the new one is committed.
REPLACED_TAG = "._replaced-"
LOCK_TAG = ".shardtrain-lock"
# A file being written whole (``write_whole``): ``.NAME<tag><token>`` beside NAME until it is renamed.
WRITING_TAG = ".writing-"
# A hidden sibling of output NAME: ``.NAME<tag><token>``. The token never holds a dot, so the name
# is everything before the last tag (``.a._staging-b._staging-T`` belongs to ``a._staging-b``).
_SIBLING = re.compile(r"^\.(?P<name>.+)(?P<tag>\._staging-|\._replaced-)(?P<token>[A-Za-z0-9-]+)$")
KIND_DATASET = "shardtrain.dataset"
KIND_MODEL = "shardtrain.model"
KIND_CHECKPOINT = "shardtrain.checkpoint"
KIND_SCORES = "shardtrain.scores"
SCHEMES = ("file", "s3", "hdfs", "dbfs")
DBFS_MOUNT = os.environ.get("SHARDTRAIN_DBFS_MOUNT", "/dbfs")
VOLUMES_ROOT = "/Volumes"  # Unity Catalog volumes, on every Databricks compute type


def is_volume_path(path: str) -> bool:
    """``/Volumes/...``: a Unity Catalog volume path."""
    return path == VOLUMES_ROOT or path.startswith(VOLUMES_ROOT + "/")

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


def _new_token() -> str:
    """A sortable, unique token for a staging directory (time first, then randomness)."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


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
        replaced = siblings(loc, REPLACED_TAG)
        if replaced:
            raise StorageError(f"{loc.uri}: no such {what} now: an overwrite of it was interrupted, and the previous "
                               f"{what} is kept at {replaced[-1].uri}; the next job writing this path restores it "
                               "first (or re-run the job that produces it)")
        raise StorageError(f"{loc.uri}: no such {what}")
    if not is_committed(loc):
        raise StorageError(
            f"{loc.uri}: {what} has no {MARKER} marker, so it is incomplete (a job died while writing it, "
            "or one is still writing); re-run the job that produces it")
    return loc


def read_marker(uri: str | Location) -> dict:
    return read_record(require_committed(uri), MARKER)


def read_record(loc: Location, name: str) -> dict:
    """The JSON object in marker file ``name`` of ``loc``; a damaged one (not UTF-8, not JSON, not an
    object) is a StorageError (exit 2) naming the file."""
    with storage_errors(f"reading {name}", loc.uri):
        raw = loc.fs.cat_file(posixpath.join(loc.path, name))
    try:
        record = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError included
        problem = f"is not valid JSON ({first_line(exc)})"
    else:
        if isinstance(record, dict):
            return record
        problem = f"holds a JSON {_JSON_TYPES.get(type(record), type(record).__name__)}, not an object"
    raise StorageError(f"{loc.join(name).uri} {problem}: the marker is damaged; restore it, or move {loc.uri} away "
                       "and re-run the job that produces it")


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


@contextlib.contextmanager
def publish(uri: str, mode: str = "error", marker: dict | None = None) -> Iterator[Location]:
    """Stage an output directory and commit it on success.

    ``mode``: ``error`` refuses an existing output, ``overwrite`` replaces it if it is an output of
    the same kind (``marker["kind"]``; see ``check_replaceable``). The caller writes everything
    under the yielded staging Location; on normal exit ``commit`` swaps it in (see there). On an
    exception the staging directory is removed and ``uri`` is untouched. The output's lock is held
    throughout (re-entrant: a job holding it already, as the shard job does, keeps it); under it,
    an overwrite that a dead job left half-done is finished first (``clean_stale_staging``).
    """
    final = resolve(uri)
    fs = final.fs
    marker = dict(marker or {})
    kind = marker.get("kind")
    if mode not in ("error", "overwrite"):
        raise ValueError(f"publish mode must be error or overwrite, got {mode!r}")
    with output_lock(final.uri):
        _clean_beside(final)  # left by writers of this output that died (we hold its lock)
        kept = replaced_copy(final)
        if kept is not None:  # the restore above failed: publishing now would lose that output
            raise StorageIOError(f"{final.uri}: an interrupted overwrite left the previous output at {kept.uri}, and "
                                 "moving it back failed (see the warning above); move it back to the output path "
                                 "by hand, or fix what stopped the move, then re-run")
        if mode == "error" and fs.exists(final.path):
            raise OutputExistsError(
                f"{final.uri} already exists; set output.mode=overwrite to replace it "
                "(or skip_if_exists to keep it)")
        check_replaceable(final.uri, kind)
        staging = beside(final, STAGING_TAG + _new_token())
        with storage_errors("creating the staging directory", staging.uri):
            fs.makedirs(staging.path, exist_ok=True)
        try:
            # What the caller writes fails as one line naming the output (a full disk, say).
            with storage_errors("writing the output", final.uri):
                yield staging
        except BaseException:
            remove_tree(staging)
            raise
        with storage_errors("committing the output", final.uri):
            commit(staging, final, marker, kind)


def commit(staging: Location, final: Location, marker: dict, kind: str | None = None) -> None:
    """Swap the staged output in at ``final``; a failure at any point leaves the old output
    committed or the new one, and never destroys the old one before the new one is complete:

    1. the marker is written into the staging directory: the new output is complete;
    2. a committed old output is moved aside, to the hidden ``.NAME._replaced-<token>`` beside it
       (anything else there, an empty directory or our own half-done commit, holds nothing to keep
       and is removed);
    3. the staging directory is moved to ``final``: from here the new output is committed there;
    4. the aside copy is removed.

    A move is a rename on local disk and HDFS (atomic, so after 3 the marker is already in place).
    Object stores have no rename and a reader takes the marker as the output: a move copies every
    object, the marker last (so a copy is committed only once complete), then removes the source,
    which holds ``_PUBLISHING`` until its last object goes, so a cut-short removal is still known as
    ours. Between 2 and 3 nothing is committed at ``final`` (an instant locally; the copy on S3).
    If 2 or 3 fails, the old output is moved back before the error is raised; if the job dies
    there (or the move back fails too), the next writer of ``final`` restores it under the lock
    before anything else (``_recover_swap``). The new output is not installed then: its job did
    not finish, and its retry publishes again.
    """
    check_replaceable(final.uri, kind)  # again: the staged work took time
    record = {"committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **marker}
    staging.write_text(MARKER, json.dumps(record, indent=2, sort_keys=True))
    fault_point("commit", "before-aside")
    aside = beside(final, REPLACED_TAG + _new_token()) if is_committed(final) else None
    if aside is None:
        _remove_output(final)  # nothing committed there: nothing to keep
    try:
        if aside is not None:
            _move(final, aside)
            fault_point("commit", "after-aside")
        _move(staging, final)
    except BaseException:
        if aside is not None:
            _restore(aside, final)
        raise
    fault_point("commit", "after-swap")
    if aside is not None:
        try:
            remove_tree(aside)
        except Exception as exc:  # noqa: BLE001 - the new output is committed; the next writer removes it
            log.warning("%s: could not remove the replaced output %s (%s); the next job writing this output "
                        "removes it", final.uri, aside.uri, exc)


def _move(src: Location, dst: Location) -> None:
    """Move an output directory (see ``commit``): a rename where the file system has one, else a
    copy (the marker last) and a removal of the source."""
    if src.scheme == "file":
        os.makedirs(os.path.dirname(dst.path) or "/", exist_ok=True)
        os.rename(src.path, dst.path)
    elif src.scheme == "hdfs":
        src.fs.makedirs(posixpath.dirname(dst.path), exist_ok=True)
        src.fs.mv(src.path, dst.path)  # pyarrow's move: an HDFS rename, exact path
    else:
        _copy_objects(src, dst)
        _remove_output(src)


def _copy_objects(src: Location, dst: Location) -> None:
    """Copy every object of ``src`` under ``dst``, the marker last; ``dst`` holds ``_PUBLISHING``
    meanwhile, so a copy cut short is ours to replace and is never read."""
    fs = src.fs
    dst.write_text(PUBLISHING, json.dumps({"kind": output_kind(src)[1]}))
    marker, publishing = posixpath.join(src.path, MARKER), posixpath.join(src.path, PUBLISHING)
    objects = _objects(src)
    for path in objects:
        if path not in (marker, publishing):
            fs.cp_file(path, dst.path + path[len(src.path):])
    if marker in objects:
        fs.cp_file(marker, posixpath.join(dst.path, MARKER))
    fs.rm_file(posixpath.join(dst.path, PUBLISHING))


def _remove_output(loc: Location) -> None:
    """Remove our output at ``loc``: unmarked first, ``_PUBLISHING`` until its last file goes, so a
    removal cut short leaves nothing a reader accepts and something overwrite still knows as ours."""
    fs = loc.fs
    names = list_names(loc)
    if not names:
        remove_tree(loc)
        return
    if PUBLISHING not in names:
        loc.write_text(PUBLISHING, json.dumps({"kind": output_kind(loc)[1]}))
    if MARKER in names:
        fs.rm_file(posixpath.join(loc.path, MARKER))
    for name in names:
        if name not in (MARKER, PUBLISHING):
            remove_tree(loc.join(name))
    remove_tree(loc)


def _restore(aside: Location, final: Location) -> bool:
    """Move the committed output kept at ``aside`` back to ``final``, if nothing committed is there
    and what is there is ours (or nothing); a copy that is not complete is dropped instead (the
    output it copied was never touched). Failing that, the next writer of ``final`` tries again."""
    try:
        if not is_committed(aside):
            remove_tree(aside)
            return False
        if is_committed(final) or not _holds_nothing_to_keep(final):
            return False
        _remove_output(final)
        _move(aside, final)
        log.warning("%s: restored the output an interrupted overwrite had moved aside (%s)", final.uri, aside.uri)
        return True
    except Exception as exc:  # noqa: BLE001 - the caller's own error is the one to report
        log.warning("%s: could not move the previous output back from %s (%s); the next job writing this output "
                    "restores it", final.uri, aside.uri, exc)
        return False


def _holds_nothing_to_keep(loc: Location) -> bool:
    """Nothing at ``loc``, an empty directory, or our own output half-done (``_PUBLISHING``)."""
    if not loc.fs.isdir(loc.path):
        return not loc.fs.exists(loc.path)
    names = list_names(loc)
    return not names or PUBLISHING in names


# --- what an output may replace, and what it must not touch ---------------------------------------

def output_kind(uri: str | Location) -> tuple[bool, str | None]:
    """(is a shardtrain output, its kind): from the marker, or from a commit that died half-way."""
    loc = uri if isinstance(uri, Location) else resolve(uri)
    for name in (MARKER, PUBLISHING):
        if loc.fs.exists(posixpath.join(loc.path, name)):
            record = read_record(loc, name)  # a damaged marker is named, not taken for someone's file
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
    out = _comparable(output_uri)
    for what, uri in inputs.items():
        if not uri or is_registry_uri(uri):  # a registered model is no path an output could overlap
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


def check_output_uri(uri: str, key: str) -> Location:
    """Refuse (exit 2, naming ``key``) an output path Spark cannot write: one holding ':', which a
    Hadoop path cannot (Spark's writers and HDFS fail on it deep inside a job). For the outputs
    Spark writes (datasets, scores, soft targets); models, run directories and checkpoints are
    written by fsspec and may hold ':'."""
    loc = resolve(uri)
    if ":" in loc.path:
        raise ConfigError(f"{key} {uri} holds ':', which a Hadoop path cannot (Spark's writers and HDFS reject it); "
                          "choose a path without ':'")
    return loc


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
    return beside(final, LOCK_TAG)


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
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
    except OSError:  # a full disk: no lock, and no lock file left behind holding nobody's record
        os.unlink(lock.path)
        os.close(fd)
        raise

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
            if holder and holder.get("host") == socket.gethostname() and not pid_alive(holder.get("pid")):
                log.warning("%s: removing the writer lock of pid %s (started %s), which has exited",
                            lock.uri, holder.get("pid"), holder.get("started_at"))
                fs.rm_file(lock.path)
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
            fs.rm_file(lock.path)

    return release


def _parse_holder(raw: bytes) -> dict | None:
    try:
        holder = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # another user's process, or no pid recorded: assume alive
    return True


def clean_stale_staging(uri: str) -> list[str]:
    """Finish what dead writers left beside ``uri``; returns the paths removed or restored.

    Staging directories are removed. An overwrite that died half-way is finished
    (``_recover_swap``): with a committed output at ``uri`` the replaced copies beside it are
    removed; with none, the newest replaced copy is moved back. Runs under ``output_lock(uri)``
    (re-entrant): every writer of ``uri`` stages and swaps under that lock, so while we hold it
    nothing beside ``uri`` belongs to a live job.
    """
    final = resolve(uri)
    with output_lock(final.uri):
        return _clean_beside(final)


def _clean_beside(final: Location) -> list[str]:
    final.fs.invalidate_cache()  # we just took the lock: see what earlier holders did, not old listings
    return _recover_swap(final) + _remove_staging(final)


def _recover_swap(final: Location) -> list[str]:
    """See ``clean_stale_staging``. A ``final`` that holds something not ours keeps its replaced
    copies too (check_replaceable then refuses the path, naming what it holds)."""
    done = []
    with storage_errors("finishing an interrupted overwrite", final.uri):
        asides = siblings(final, REPLACED_TAG)
        if asides and not is_committed(final):
            committed = [aside for aside in asides if is_committed(aside)]
            if committed and _restore(committed[-1], final):  # the newest: tokens sort by time
                done.append(committed[-1].path)
        if asides and is_committed(final):
            for aside in asides:
                if aside.path not in done:
                    remove_tree(aside)
                    done.append(aside.path)
                    log.info("%s: removed %s, an output it replaced", final.uri, aside.uri)
    return done


def _remove_staging(final: Location) -> list[str]:
    removed = []
    with storage_errors("removing staging left by an earlier job", final.uri):
        for staging in siblings(final, STAGING_TAG):
            remove_tree(staging)
            removed.append(staging.path)
    if removed:
        log.info("%s: removed %d staging director%s left by earlier jobs", final.uri, len(removed),
                 "y" if len(removed) == 1 else "ies")
    return removed


# --- paths are data, never patterns -------------------------------------------------------------
# A user's path may hold ``[``, ``*``, ``?``: every listing and removal here compares names
# exactly (list the parent, then filter), never hands a path to glob() or to an fsspec call that
# expands patterns (on S3, ``rm`` and ``copy`` glob their argument).

def parse_sibling(name: str) -> tuple[str, str, str] | None:
    """(output name, tag, token) of a hidden sibling's base name (``.NAME<tag><token>``), or None."""
    match = _SIBLING.match(name)
    return (match.group("name"), match.group("tag"), match.group("token")) if match else None


def replaced_copy(uri: str | Location) -> Location | None:
    """The committed output an interrupted overwrite moved aside, when nothing committed is at
    ``uri`` (the next writer restores it, see ``clean_stale_staging``); else None. A job that
    refuses an existing output checks this too, so it does not run to the end and then find the
    restored output in its way."""
    final = uri if isinstance(uri, Location) else resolve(uri)
    with storage_errors("checking for an interrupted overwrite", final.uri):
        if is_committed(final):
            return None
        kept = [aside for aside in siblings(final, REPLACED_TAG) if is_committed(aside)]
    return kept[-1] if kept else None


def siblings(final: Location, tag: str) -> list[Location]:
    """``final``'s hidden siblings carrying ``tag`` (its staging directories), by exact name."""
    parent, name = posixpath.split(final.path.rstrip("/"))
    found = []
    for base in list_names(Location(uri=_parent_uri(final.uri), scheme=final.scheme, path=parent)):
        parsed = parse_sibling(base)
        if parsed and parsed[0] == name and parsed[1] == tag:
            found.append(beside(final, tag + parsed[2]))
    return sorted(found, key=lambda loc: loc.path)


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
            for path in _objects(loc):
                fs.rm_file(path)
            fs.invalidate_cache(loc.path)
        elif fs.exists(loc.path):
            fs.rm(loc.path, recursive=True)  # pyarrow's HDFS client deletes the path it is given
    except FileNotFoundError:
        pass


def _objects(loc: Location) -> list[str]:
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
    return Location(uri=_join_uri(_parent_uri(final.uri), base), scheme=final.scheme, path=posixpath.join(parent, base))


def _parent_uri(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[0]
