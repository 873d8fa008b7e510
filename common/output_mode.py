"""``output.mode``: what a job about to publish does with an output already at its path.

One rule for every job that publishes under an input fingerprint (the shard job's datasets, the
score job's scores), decided before any work, under the output's writer lock:

* nothing there: go on;
* ``error``: refuse (exit 2);
* ``overwrite`` and ``skip_if_exists``: only an output of the job's own kind may be there
  (``output_guard.check_replaceable``: never a user's files, another kind of output, or a regular
  file);
* ``overwrite``: go on (``publish.publish`` replaces it atomically);
* ``skip_if_exists``: the output must be committed and its marker must record the same input
  fingerprint; then the job returns what is there without work, else it refuses (exit 2).

The job owns what its fingerprint covers and what it returns when it skips; this module owns
the decision and its messages, and must not read anything but the marker.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.commit_marker import is_committed
from common.errors import OutputExistsError
from common.output_guard import check_replaceable
from common.publish import read_marker
from common.storage import Location


@dataclass(frozen=True)
class OutputWords:
    """How a job's output is named in the mode check's messages."""

    kind: str  # the marker's kind (common.commit_marker.KIND_*): what overwrite may replace
    identical: str  # "an identical dataset": what skip_if_exists keeps
    committed: str  # "a committed dataset"
    other: str  # "a different dataset": what is there when the fingerprints differ
    inputs: str  # what the input fingerprint covers: "the config or the source files"
    plural: bool = False  # "scores": "publishing them", "since they were written"


ABSENT, REPLACE, SAME = "absent", "replace", "same"


def existing_output(out: Location, mode: str, words: OutputWords, input_fingerprint: str) -> str:
    """What is at ``out`` for a job in ``mode``: ABSENT (nothing), REPLACE (``overwrite``, and it
    may be replaced), or SAME (``skip_if_exists`` and it holds the output of ``input_fingerprint``:
    the caller returns it without work). Anything else is an OutputExistsError (exit 2) naming the
    path and the mode to set."""
    if not out.exists():
        return ABSENT
    if mode == "error":
        raise OutputExistsError(f"{out.uri} already exists; set output.mode=overwrite to replace it "
                                f"(or skip_if_exists to keep {words.identical})")
    check_replaceable(out.uri, words.kind)
    if mode == "overwrite":
        return REPLACE
    it, it_was = ("them", "they were") if words.plural else ("it", "it was")
    if not is_committed(out):
        raise OutputExistsError(f"{out.uri} exists but is not {words.committed} (a job died while publishing {it}?); "
                                "set output.mode=overwrite to replace it")
    if read_marker(out).get("input_fingerprint") != input_fingerprint:
        raise OutputExistsError(f"{out.uri} holds {words.other} ({words.inputs} changed since {it_was} written); "
                                f"set output.mode=overwrite to replace {it}")
    return SAME


__all__ = ["ABSENT", "REPLACE", "SAME", "OutputWords", "existing_output"]
