"""One writer at a time: the writer lock every job holds on its output.

``output_lock`` holds a lock file beside the output for the whole job (``common.publish.publish``
takes it too, re-entrantly; ``writing_under`` lets another process of the same job, such as a
training rank, write under the lock its driver holds). Locally it is an ``flock`` on the file,
which the kernel releases when the holder dies, so a dead holder's lock is taken over without
guessing. On S3 the lock is a conditional create (``If-None-Match: *``); a lock whose holder is on
this host and whose pid is gone is taken over; a holder on another host cannot be checked, so its
lock is reported and must be removed by hand if that job is dead. HDFS (and a local mount without
flock) has no conditional create: there the lock is checked, then written (two writers starting
in the same instant may both pass).

This module owns the lock file, its holder's record (host, pid, started_at, token) and
``pid_alive`` (common.leases asks it about readers too); readers never take it (their leases are
common.leases'). Spark- and torch-free, like common.storage.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from typing import Iterator

from common.errors import OutputLockedError
from common.storage import Location, beside, parent_uri, resolve, storage_errors

LOCK_TAG = ".shardtrain-lock"

log = logging.getLogger("shardtrain.storage")

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
    parent = parent_uri(lock.uri)
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
