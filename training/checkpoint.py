"""Checkpoints: the save policy, the atomic write, and finding the newest good one to resume from.

The training loop calls ``manager.save(step, epoch, state_fn, last=...)`` after every optimizer
step; the manager decides whether this step is a checkpoint (``every_steps``, ``every_epochs``,
the last step; each independently of the other). Every rank calls it, because ``state_fn`` runs
collectives (the loop's non-finite check, which raises rather than let NaN weights be saved, and
the per-rank RNG gather); only the writer (rank 0) writes.

Layout: ``<path>/step-000000120/state.pt`` published with common.publish.publish (staging,
rename, ``_COMMITTED`` marker last, carrying the file's sha256 and ``kind: shardtrain.checkpoint``).
The kind is what lets a save replace only a checkpoint and ``check_checkpoint_root`` (on the
driver, before launching) refuse a ``checkpoint.path`` that holds another output. ``state.pt``
holds tensors and primitives only and is read with ``torch.load(weights_only=True)``: a checkpoint cannot run code.
On resume, a checkpoint without its marker (a crash mid-write) or whose bytes do not match the
marker (corruption) is reported and the previous complete one is used.
"""

from __future__ import annotations

import hashlib
import io
import logging
import posixpath
import re
from dataclasses import dataclass, field
from typing import Callable

from common.commit_marker import KIND_CHECKPOINT, MARKER, is_committed, output_kind, read_record
from common.errors import CorruptCheckpoint, OutputExistsError, StorageError
from common.publish import STAGING_TAG, parse_sibling, publish
from common.storage import list_names, remove_tree, resolve, storage_errors

log = logging.getLogger("shardtrain.checkpoint")

STATE_FILE = "state.pt"
_NAME = re.compile(r"^step-(\d{9})$")


@dataclass
class Restored:
    state: dict
    uri: str
    step: int
    problems: list[str] = field(default_factory=list)  # checkpoints skipped on the way, and why


def check_checkpoint_root(uri: str, key: str = "checkpoint.path") -> None:
    """Refuse (exit 2, naming the path and what it holds) a checkpoint directory that is another
    shardtrain output, or whose ``step-*`` entries are outputs of another kind: resuming would
    read them, and saving and pruning would write and delete inside them. Checkpoints written
    before markers carried a kind (no kind) are accepted."""
    root = resolve(uri)
    with storage_errors(f"checking what {key} holds", root.uri):
        if not root.exists():
            return
        ours, kind = output_kind(root)
        if ours:
            raise OutputExistsError(f"{root.uri} ({key}) holds a {kind or 'shardtrain output'}, not checkpoints; "
                                    f"choose another {key}")
        if not root.fs.isdir(root.path):
            raise OutputExistsError(f"{root.uri} ({key}) is a regular file, not a checkpoint directory; "
                                    f"choose another {key}")
        for path in root.fs.ls(root.path, detail=False):
            name = posixpath.basename(path.rstrip("/"))
            if not _NAME.match(name):
                continue
            try:
                ours, kind = output_kind(root.join(name))
            except StorageError:  # a damaged marker: restore_latest skips that step for an older one
                continue
            if ours and kind not in (None, KIND_CHECKPOINT):
                raise OutputExistsError(f"{root.uri}/{name} ({key}) holds a {kind}, not a checkpoint; "
                                        f"choose another {key}")


class CheckpointManager:
    def __init__(self, uri: str, steps_per_epoch: int, every_steps: int | None = None,
                 every_epochs: int | None = 1, keep: int = 2, is_writer: bool = True):
        self.uri = uri.rstrip("/")
        self.steps_per_epoch = steps_per_epoch
        self.every_steps, self.every_epochs, self.keep = every_steps, every_epochs, keep
        self.is_writer = is_writer

    def should_save(self, step: int, last: bool = False) -> bool:
        if last:
            return True
        if self.every_steps and step % self.every_steps == 0:
            return True
        if self.every_epochs and step % self.steps_per_epoch == 0:
            return (step // self.steps_per_epoch) % self.every_epochs == 0
        return False

    def save(self, step: int, epoch: int, state_fn: Callable[[], dict], last: bool = False) -> str | None:
        """Save if the policy says so; returns the checkpoint URI (on the writer) or None."""
        if not self.should_save(step, last):
            return None
        state = state_fn()  # every rank: it may run collectives
        if not self.is_writer:
            return None
        import torch

        buffer = io.BytesIO()
        torch.save({**state, "step": step, "epoch": epoch}, buffer)
        payload = buffer.getvalue()
        target = f"{self.uri}/step-{step:09d}"
        marker = {"kind": KIND_CHECKPOINT, "step": step, "epoch": epoch, "sha256": hashlib.sha256(payload).hexdigest()}
        with publish(target, mode="overwrite", marker=marker) as staging:
            with staging.open(STATE_FILE, "wb") as fh:
                fh.write(payload)
        self._prune()
        return target

    def restore_latest(self) -> Restored | None:
        """The newest complete, intact checkpoint, or None; skipped ones are logged and listed."""
        problems: list[str] = []
        for step, loc in reversed(self._list()):
            try:
                state = self._read(loc)
            except CorruptCheckpoint as exc:
                problems.append(str(exc))
                log.warning("%s; trying the previous checkpoint", exc)
                continue
            return Restored(state=state, uri=loc.uri, step=step, problems=problems)
        return Restored(state={}, uri="", step=0, problems=problems) if problems else None

    # -- internals --

    def _list(self):
        root = resolve(self.uri)
        if not root.exists():
            return []
        found = []
        for path in root.fs.ls(root.path, detail=False):
            match = _NAME.match(posixpath.basename(path.rstrip("/")))
            if match:
                found.append((int(match.group(1)), root.join(posixpath.basename(path.rstrip("/")))))
        return sorted(found, key=lambda item: item[0])

    def _read(self, loc) -> dict:
        import torch

        if not is_committed(loc):
            raise CorruptCheckpoint(f"checkpoint {loc.uri} is incomplete (no {MARKER} marker: a save was interrupted)")
        try:
            marker = read_record(loc, MARKER)
            with loc.open(STATE_FILE, "rb") as fh:
                payload = fh.read()
        except (OSError, StorageError) as exc:
            raise CorruptCheckpoint(f"checkpoint {loc.uri} cannot be read ({exc})") from None
        if marker.get("sha256") != hashlib.sha256(payload).hexdigest():
            raise CorruptCheckpoint(f"checkpoint {loc.uri} is corrupt ({STATE_FILE} does not match the sha256 "
                                    "recorded when it was written)")
        try:
            return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means "unusable"
            raise CorruptCheckpoint(f"checkpoint {loc.uri} cannot be loaded ({type(exc).__name__}: {exc})") from None

    def _prune(self) -> None:
        listed = [(step, loc, is_committed(loc)) for step, loc in self._list()]  # one listing, one check each
        complete = [(step, loc) for step, loc, committed in listed if committed]
        newest = complete[-1][0] if complete else 0
        for _, loc in complete[:-self.keep]:
            remove_tree(loc)
        for step, loc, committed in listed:
            if not committed and step < newest:
                remove_tree(loc)
        root = resolve(self.uri)
        for name in list_names(root):  # exact names: the root's own path may hold glob characters
            parsed = parse_sibling(name)
            match = _NAME.match(parsed[0]) if parsed else None
            if match is None:
                continue
            if parsed[1] == STAGING_TAG:
                remove_tree(root.join(name))  # left by a writer that died mid-save
            elif int(match.group(1)) <= newest:
                # A copy an interrupted re-save moved aside: dead once that step or a newer one is
                # complete (the newest complete checkpoint is committed by definition).
                remove_tree(root.join(name))


__all__ = ["CheckpointManager", "Restored", "check_checkpoint_root"]
