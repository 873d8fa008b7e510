"""The commit marker: what makes a directory a shardtrain output, and of which kind.

``_COMMITTED`` (``MARKER``) is the last file written into a published directory
(common.publish): a directory without it is not an output, and readers refuse it. It records
the output's ``kind`` (``shardtrain.dataset``, ``shardtrain.model``, ``shardtrain.checkpoint``,
``shardtrain.scores``: what ``overwrite`` may replace, common.output_guard) beside what its job
adds (an input fingerprint, counts). ``_PUBLISHING`` marks our own output while a commit or a
removal of it is under way file by file (object stores), so a cut-short one is still known as ours.

This module owns those names and reading them back (``is_committed``, ``read_record``,
``output_kind``): a damaged marker is named (exit 2), never taken for a user's file. It writes
nothing; publishing, and the readers' ``require_committed``, are common.publish's. Spark- and
torch-free, like common.storage.
"""

from __future__ import annotations

import json
import posixpath

from common.errors import StorageError, first_line
from common.storage import Location, resolve, storage_errors

MARKER = "_COMMITTED"
# Written with the files and removed after the marker: a directory holding it is our own output
# whose commit died half-way (object stores copy file by file), so overwrite may replace it.
PUBLISHING = "_PUBLISHING"
KIND_DATASET = "shardtrain.dataset"
KIND_MODEL = "shardtrain.model"
KIND_CHECKPOINT = "shardtrain.checkpoint"
KIND_SCORES = "shardtrain.scores"


def is_committed(uri: str | Location) -> bool:
    loc = uri if isinstance(uri, Location) else resolve(uri)
    return loc.fs.exists(posixpath.join(loc.path, MARKER))


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


def output_kind(uri: str | Location) -> tuple[bool, str | None]:
    """(is a shardtrain output, its kind): from the marker, or from a commit that died half-way."""
    loc = uri if isinstance(uri, Location) else resolve(uri)
    for name in (MARKER, PUBLISHING):
        if loc.fs.exists(posixpath.join(loc.path, name)):
            record = read_record(loc, name)  # a damaged marker is named, not taken for someone's file
            # Models published before markers carried a kind recorded it as "format".
            return True, record.get("kind") or record.get("format")
    return False, None
