"""Reader leases: a training run's claim on the dataset it reads, so that a shard job does not
replace the dataset under the run (``pipelines.shard_job`` refuses to overwrite a dataset with a
live lease unless ``output.ignore_readers: true``).

A lease is one small JSON file per reader in a hidden directory beside the dataset,
``.<name>._readers/<token>.json``: host, pid, started_at, heartbeat_at, token, uri. Several
training runs may read one dataset at once, each holding its own lease; the writer lock
(``common.writer_lock.output_lock``) is another file and is not involved. The holder rewrites its
``heartbeat_at`` every ``HEARTBEAT_S`` seconds while it runs and removes its file when it ends.

Which leases count (``active_readers``), without guessing where it can be checked:

* a holder on this host is live while its pid runs; a dead holder's lease (killed with SIGKILL,
  say) is ignored and removed;
* a holder on another host (an object store, a shared mount) cannot be checked by pid: its lease
  is live while its heartbeat is younger than ``STALE_S`` seconds (10 minutes), and ignored and
  removed once older;
* a lease file that cannot be parsed (being written, damaged) counts as live when it is younger
  than ``STALE_S``, by its modification time where the store gives one.

Like ``common.storage``, this module must stay free of Spark and torch.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from typing import Iterator

from common.storage import Location, beside, remove_tree, resolve, storage_errors, write_whole
from common.writer_lock import pid_alive

READERS_TAG = "._readers"
HEARTBEAT_S = 60.0
STALE_S = 600.0

log = logging.getLogger("shardtrain.storage")


def readers_location(uri: str | Location) -> Location:
    """The hidden directory of ``uri``'s reader leases: beside it, ``.<name>._readers``."""
    return beside(uri if isinstance(uri, Location) else resolve(uri), READERS_TAG)


def describe_reader(record: dict) -> str:
    """A lease's holder as a person reads it: pid, host and start time."""
    return f"pid {record.get('pid')} on host {record.get('host')}, started {record.get('started_at')}"


@contextlib.contextmanager
def reader_lease(uri: str) -> Iterator[dict]:
    """Hold a reader lease on the dataset at ``uri`` for the block (heartbeat included); yields
    this lease's record. Where no lease can be written (a read-only location, a public bucket)
    the reader goes on without one, with a warning: a shard job cannot see it then, but a run
    still fails if its dataset changes (training pins it), so the lease only saves it the wasted run."""
    readers = readers_location(uri)
    now = _utc_now()
    record = {"host": socket.gethostname(), "pid": os.getpid(), "uri": resolve(uri).uri, "started_at": now,
              "heartbeat_at": now, "token": uuid.uuid4().hex}
    lease = readers.join(f"{record['token']}.json")
    try:
        _write(lease, record)
    except OSError as exc:
        log.warning("%s: cannot write a reader lease (%s: %s); a shard job overwriting the dataset will not know "
                    "this run reads it", lease.uri, type(exc).__name__, exc)
        yield record
        return
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(lease, record, stop), name="shardtrain-reader-lease",
                            daemon=True)
    beat.start()
    try:
        yield record
    finally:
        stop.set()
        beat.join()
        with storage_errors("releasing the reader lease on the dataset", lease.uri):
            remove_tree(lease)
            _remove_empty_dir(readers)


def active_readers(uri: str) -> list[dict]:
    """The live reader leases on the dataset at ``uri`` (records, oldest first); dead ones (see
    the module doc) are removed on the way, each with a log line."""
    readers = readers_location(uri)
    fs = readers.fs
    with storage_errors("listing the dataset's reader leases", readers.uri):
        fs.invalidate_cache(readers.path)  # object stores cache listings; a new lease must show
        try:
            entries = fs.ls(readers.path, detail=True)
        except FileNotFoundError:
            return []
        live = []
        for entry in entries:
            path = entry["name"]
            if entry.get("type") != "file" or not path.endswith(".json"):
                continue  # a lease's temporary file, or something that is not ours
            lease = Location(uri=f"{readers.uri}/{posixpath.basename(path)}", scheme=readers.scheme, path=path)
            record = _read(lease)
            why = _dead(record, entry)
            if why is None:
                live.append(record or {"lease": lease.uri})
                continue
            log.warning("%s: removing the reader lease of %s, which %s", lease.uri,
                        describe_reader(record or {}), why)
            remove_tree(lease)
    return sorted(live, key=lambda r: str(r.get("started_at")))


def _dead(record: dict | None, entry: dict) -> str | None:
    """Why a lease no longer counts, or None while it does (rules: the module doc)."""
    if record is None:
        age = _age_s(entry.get("mtime") or entry.get("LastModified"))
        return None if age is None or age < STALE_S else f"cannot be read and is {age:.0f}s old"
    if record.get("host") == socket.gethostname():
        return None if pid_alive(record.get("pid")) else "has exited"
    age = _age_s(record.get("heartbeat_at"))
    return None if age is None or age < STALE_S else f"sent no heartbeat for {age:.0f}s (over {STALE_S:.0f}s)"


def _heartbeat(lease: Location, record: dict, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        record["heartbeat_at"] = _utc_now()
        try:
            _write(lease, record)
        except OSError as exc:  # a missed beat only ages the lease; the run goes on
            log.warning("%s: could not renew the reader lease: %s", lease.uri, exc)


def _write(lease: Location, record: dict) -> None:
    # Whole or absent: a shard job listing the leases never reads half a record.
    write_whole(lease, json.dumps(record).encode())


def _read(lease: Location) -> dict | None:
    try:
        record = json.loads(lease.fs.cat_file(lease.path).decode("utf-8"))
    except (FileNotFoundError, UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _remove_empty_dir(readers: Location) -> None:
    if readers.scheme == "file":  # object stores have no directories to leave behind
        try:
            os.rmdir(readers.path)
        except OSError:
            pass  # another reader's lease is still there (or it is gone already)


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _age_s(stamp) -> float | None:
    """Seconds since ``stamp`` (our ISO UTC text, a datetime, or epoch seconds), None if unknown."""
    if stamp is None:
        return None
    try:
        if isinstance(stamp, (int, float)):
            then = float(stamp)
        elif isinstance(stamp, _dt.datetime):
            then = stamp.timestamp()
        else:
            then = _dt.datetime.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc).timestamp()
    except (TypeError, ValueError, OSError):
        return None
    return time.time() - then


__all__ = ["HEARTBEAT_S", "STALE_S", "active_readers", "describe_reader", "reader_lease", "readers_location"]
