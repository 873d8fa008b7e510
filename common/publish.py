"""The atomic-publish protocol every shardtrain output follows, and the readers' half of it.

Publishing a directory: everything is written under a staging location beside the target, the
``_COMMITTED`` marker (common.commit_marker) last, then it is moved into place. Readers call
``require_committed`` and refuse a directory without the marker, so a job that dies at any point
leaves nothing a reader will accept. Overwrite is a swap (``commit``): the old output is moved
aside, the new one moved in, then the old one deleted, so a failure at any point leaves one of
them committed, and the next writer finishes a swap a dead job left half-done
(``clean_stale_staging``). What an overwrite may replace is checked by common.output_guard, and
all of it runs under the output's writer lock (common.writer_lock).

This module owns the staging and replaced-copy siblings (``.NAME._staging-<token>``,
``.NAME._replaced-<token>``: found by exact name, ``siblings``), the swap and its recovery. It
must not decide what a job does with an existing output (common.output_mode) or parse URIs
(common.storage). Spark- and torch-free: executors and training ranks publish through it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import time
import uuid
from typing import Iterator

from common.commit_marker import MARKER, PUBLISHING, is_committed, output_kind, read_record
from common.errors import OutputExistsError, StorageError, StorageIOError
from common.faults import fault_point
from common.output_guard import check_replaceable
from common.storage import Location, beside, list_names, objects_under, parent_uri, remove_tree, resolve, storage_errors
from common.writer_lock import output_lock

STAGING_TAG = "._staging-"
# Where an overwrite keeps the output it replaces until the new one is committed.
REPLACED_TAG = "._replaced-"
# A hidden sibling of output NAME: ``.NAME<tag><token>``. The token never holds a dot, so the name
# is everything before the last tag (``.a._staging-b._staging-T`` belongs to ``a._staging-b``).
_SIBLING = re.compile(r"^\.(?P<name>.+)(?P<tag>\._staging-|\._replaced-)(?P<token>[A-Za-z0-9-]+)$")

log = logging.getLogger("shardtrain.storage")


def _new_token() -> str:
    """A sortable, unique token for a staging directory (time first, then randomness)."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


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
    objects = objects_under(src)
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


def parse_sibling(name: str) -> tuple[str, str, str] | None:
    """(output name, tag, token) of a hidden sibling's base name (``.NAME<tag><token>``), or None."""
    match = _SIBLING.match(name)
    return (match.group("name"), match.group("tag"), match.group("token")) if match else None


def siblings(final: Location, tag: str) -> list[Location]:
    """``final``'s hidden siblings carrying ``tag`` (its staging directories), by exact name."""
    parent, name = posixpath.split(final.path.rstrip("/"))
    found = []
    for base in list_names(Location(uri=parent_uri(final.uri), scheme=final.scheme, path=parent)):
        parsed = parse_sibling(base)
        if parsed and parsed[0] == name and parsed[1] == tag:
            found.append(beside(final, tag + parsed[2]))
    return sorted(found, key=lambda loc: loc.path)
