"""A test's checkpoint to resume from, taken from a run the module already made: the checkpoint a
run wrote at the end of its first epoch is the one a run of that one epoch would have written (the
state after the same steps on the same rows), so a test of resuming copies it instead of
launching the one-epoch run again."""

from __future__ import annotations

import os
import shutil


def copy_checkpoint(run_dir: str, step: int, into: str) -> str:
    """Copy ``run_dir``'s committed checkpoint of ``step`` (checkpoints/step-NNNNNNNNN, marker and
    all) into the empty checkpoint root ``into``; returns the copy's path."""
    source = os.path.join(str(run_dir), "checkpoints", f"step-{step:09d}")
    assert os.path.exists(os.path.join(source, "_COMMITTED")), f"{source} is not a committed checkpoint"
    assert not os.path.exists(into) or not os.listdir(into), f"{into} must be an empty checkpoint root"
    return shutil.copytree(source, os.path.join(str(into), os.path.basename(source)))
