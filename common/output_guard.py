"""What an output path may replace, and what it must not touch: the refusals a job makes about
its output path before any work, each exit 2 naming the path (and the config key).

* ``check_replaceable``: ``overwrite`` replaces only nothing, an empty directory or a shardtrain
  output of the same kind (the commit marker's ``kind``, common.commit_marker), never a user's
  file or directory, nor another kind of output;
* ``check_disjoint``: an output equal to, inside or containing an input;
* ``check_output_uri``: a path Spark's writers cannot write (one holding ':').

What a job does in each ``output.mode`` is common.output_mode's; the swap itself is
common.publish's (which checks ``check_replaceable`` again before it commits). This module reads
markers and lists paths, and must not write anything. Spark- and torch-free, like common.storage.
"""

from __future__ import annotations

import os
import posixpath
from urllib.parse import urlparse

from common.commit_marker import output_kind
from common.errors import ConfigError, OutputExistsError
from common.model_registry import is_registry_uri
from common.storage import Location, resolve, storage_errors


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
