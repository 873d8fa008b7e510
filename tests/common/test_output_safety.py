"""Outputs replace only what they own, never an input; one writer at a time; storage errors are
one line naming the path. Storage-level tests (no Spark): real files, real processes, real
flock, and the loopback S3 endpoint for the conditional-create lock."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import posixpath
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from common.commit_marker import (KIND_CHECKPOINT, KIND_DATASET, KIND_MODEL, KIND_SCORES, MARKER, PUBLISHING,
                                  is_committed)
from common.errors import ConfigError, OutputExistsError, OutputLockedError, StorageError, StorageIOError
from common.faults import FAULT_ENV
from common.output_guard import check_disjoint, check_replaceable
from common.publish import (REPLACED_TAG, STAGING_TAG, clean_stale_staging, publish, read_marker, require_committed,
                            siblings)
from common.storage import beside, objects_under, resolve
from common.writer_lock import lock_location, output_lock


def _publish(uri: str, kind: str | None, files=("a.txt",), mode="overwrite"):
    with publish(uri, mode=mode, marker={"kind": kind} if kind else {}) as staging:
        for name in files:
            with staging.open(name, "wb") as fh:
                fh.write(name.encode())


# --- what overwrite may replace -----------------------------------------------------------------

def test_overwrite_replaces_an_output_of_the_same_kind(tmp_path):
    target = str(tmp_path / "ds")
    _publish(target, KIND_DATASET, ["old.txt"])
    _publish(target, KIND_DATASET, ["new.txt"])
    assert sorted(os.listdir(target)) == [MARKER, "new.txt"]
    assert read_marker(target)["kind"] == KIND_DATASET


def test_overwrite_refuses_a_regular_file(tmp_path):
    target = tmp_path / "model"
    target.write_bytes(b"precious")
    with pytest.raises(OutputExistsError, match=rf"{target} is a regular file, not a shardtrain {KIND_MODEL}") as err:
        _publish(str(target), KIND_MODEL)
    assert err.value.exit_code == 2
    assert target.read_bytes() == b"precious"


def test_overwrite_refuses_a_user_directory_even_one_that_looks_empty(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / ".keep").write_text("mine")  # `ls` shows nothing
    with pytest.raises(OutputExistsError, match=r"holds 1 entry that shardtrain did not publish \(\.keep\)"):
        _publish(str(target), KIND_DATASET)
    assert (target / ".keep").read_text() == "mine"
    # A truly empty directory holds nothing to lose: it is replaced.
    (target / ".keep").unlink()
    _publish(str(target), KIND_DATASET)
    assert is_committed(str(target))


def test_overwrite_refuses_an_output_of_another_kind(tmp_path):
    target = str(tmp_path / "ds")
    _publish(target, KIND_DATASET, ["part.parquet"])
    with pytest.raises(OutputExistsError, match=rf"holds a {KIND_DATASET}, not a {KIND_MODEL}"):
        _publish(target, KIND_MODEL)
    assert sorted(os.listdir(target)) == [MARKER, "part.parquet"]
    with pytest.raises(OutputExistsError, match=rf"holds a {KIND_DATASET}"):
        check_replaceable(target, KIND_MODEL)


def test_a_commit_that_died_half_way_is_ours_to_replace(tmp_path):
    # On an object store the commit copies file by file; a crash leaves files and _PUBLISHING.
    target = tmp_path / "ds"
    target.mkdir()
    (target / "part.parquet").write_bytes(b"half")
    (target / PUBLISHING).write_text(json.dumps({"kind": KIND_DATASET}))
    assert not is_committed(str(target))
    _publish(str(target), KIND_DATASET, ["new.txt"])
    assert sorted(os.listdir(target)) == [MARKER, "new.txt"]


@pytest.mark.parametrize("output, relation", [("src", "is the same path as"), ("src/out", "is inside"),
                                              (".", "contains")])
def test_outputs_never_overlap_inputs(tmp_path, output, relation):
    src = tmp_path / "src"
    src.mkdir()
    out = os.path.normpath(str(tmp_path / output))
    with pytest.raises(ConfigError, match=rf"output.path {out} {relation} source 'raw'") as err:
        check_disjoint(out, "output.path", {"source 'raw'": str(src)})
    assert err.value.exit_code == 2
    check_disjoint(str(tmp_path / "elsewhere"), "output.path", {"source 'raw'": str(src)})  # siblings are fine
    check_disjoint(str(tmp_path / "src2"), "output.path", {"source 'raw'": str(src)})  # a shared prefix is not nesting


def test_overlap_sees_through_globs_and_symlinks(tmp_path):
    (tmp_path / "raw").mkdir()
    os.symlink(tmp_path / "raw", tmp_path / "alias")
    with pytest.raises(ConfigError, match="is inside"):
        check_disjoint(str(tmp_path / "raw" / "out"), "output.path", {"source": str(tmp_path / "raw" / "*.csv")})
    with pytest.raises(ConfigError, match="is the same path as"):
        check_disjoint(str(tmp_path / "alias"), "output.path", {"source": str(tmp_path / "raw")})


# --- one writer at a time -------------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import sys, time
    from common.writer_lock import output_lock
    with output_lock(sys.argv[1]):
        print("held", flush=True)
        sys.stdin.readline()  # held until the test closes stdin (or kills us)
""")


def _start_holder(uri: str, env=None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, uri], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    line = proc.stdout.readline()  # blocks until the lock is held (or the process died)
    assert line.strip() == "held", f"holder did not take the lock (rc={proc.poll()})"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL  # the holder is dead


@pytest.mark.process
def test_second_writer_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(tmp_path):
    uri = str(tmp_path / "ds")
    holder = _start_holder(uri)
    try:
        with pytest.raises(OutputLockedError, match=rf"{uri} is being written by pid {holder.pid} on host "
                                                    rf"{os.uname().nodename}") as err:
            _publish(uri, KIND_DATASET)
        assert err.value.exit_code == 1
        assert not os.path.exists(uri)
    finally:
        _kill(holder)
    # The dead holder's lock file is still there, with its record; the next writer takes it over.
    lock = lock_location(uri).path
    assert json.loads(open(lock).read())["pid"] == holder.pid
    with output_lock(uri) as record:
        assert json.loads(open(lock).read())["token"] == record["token"]
        _publish(uri, KIND_DATASET)  # re-entrant: publish inside the job's own lock
    assert is_committed(uri)
    assert not os.path.exists(lock)  # released


@pytest.mark.process
def test_staging_left_by_a_killed_writer_is_removed_by_the_next_run_but_not_while_a_writer_lives(tmp_path):
    uri = str(tmp_path / "ds")
    stale = tmp_path / f".ds{STAGING_TAG}20260101-dead"
    stale.mkdir()
    (stale / "part.parquet").write_bytes(b"x")
    holder = _start_holder(uri)
    try:
        with pytest.raises(OutputLockedError):
            clean_stale_staging(uri)  # a live writer may own it
        assert stale.exists()
    finally:
        _kill(holder)
    _publish(uri, KIND_DATASET)
    assert not stale.exists()
    assert sorted(os.listdir(tmp_path)) == ["ds"]


# --- paths are data, never patterns -----------------------------------------------------------------

STAGER = textwrap.dedent("""
    import sys
    from common.publish import publish
    with publish(sys.argv[1], mode="overwrite", marker={"kind": sys.argv[2]}) as staging:
        with staging.open("part-0", "wb") as fh:
            fh.write(b"neighbour")
        print(staging.uri, flush=True)
        sys.stdin.readline()  # staged, under the output's lock, until the test closes stdin
""")


class _Stager:
    """A real process writing ``uri``: its staging directory exists and its lock is held until
    ``finish()``, which lets it commit and returns its exit status."""

    def __init__(self, uri: str, kind: str):
        self.proc = subprocess.Popen([sys.executable, "-c", STAGER, uri, kind], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        assert line, f"the neighbour's writer did not stage (rc={self.proc.poll()})"
        self.staging = resolve(line)

    def staged_bytes(self) -> bytes:
        return self.staging.fs.cat_file(posixpath.join(self.staging.path, "part-0"))

    def finish(self) -> int:
        self.proc.stdin.close()
        return self.proc.wait(timeout=60)


def _old_glob(final_uri: str, name: str) -> str:
    """The pattern the stale-staging cleanup used to glob for ``final_uri`` (``parent/.NAME._staging-*``)."""
    parent = resolve(final_uri).path.rsplit("/", 1)[0]
    return f"{parent}/.{name}{STAGING_TAG}*"


def _check_a_glob_named_output_spares_a_live_neighbour(base: str, name: str, neighbour: str) -> None:
    target, other = f"{base}/{name}", f"{base}/{neighbour}"
    _publish(target, KIND_SCORES, ["old.txt"])
    final = resolve(target)
    dead = beside(final, f"{STAGING_TAG}20260101T000000-dead")  # left by a killed writer of target
    dead.write_text("part-0", "dead")
    stager = _Stager(other, KIND_SCORES)
    try:
        # The neighbour's writer is alive, holds its lock, and its staging is what a glob of the
        # target's name would have matched.
        assert stager.proc.poll() is None and stager.staged_bytes() == b"neighbour"
        assert fnmatch.fnmatchcase(stager.staging.path, _old_glob(target, name.rsplit("/", 1)[-1]))
        neighbour_lock = lock_location(other)
        assert neighbour_lock.fs.exists(neighbour_lock.path)

        assert clean_stale_staging(target) == [dead.path]  # its own dead staging, and only that
        _publish(target, KIND_SCORES, ["new.txt"])  # overwrite: cleans again, then commits
        assert is_committed(target) and read_marker(target)["kind"] == KIND_SCORES
        assert sorted(p.rsplit("/", 1)[-1] for p in final.fs.find(final.path)) == [MARKER, "new.txt"]

        assert stager.proc.poll() is None and stager.staged_bytes() == b"neighbour"
        assert neighbour_lock.fs.exists(neighbour_lock.path)
    finally:
        rc = stager.finish()
    assert rc == 0  # the neighbour's job then committed its own output
    assert is_committed(other) and resolve(other).fs.cat_file(resolve(other).path + "/part-0") == b"neighbour"


GLOB_NAMES = [("scores[0-9]", "scores2"), ("run[12]/scores", "run1/scores"), ("s*", "scores"), ("sc?res", "scores"),
              ("my scores ü[ab]", "my scores üa")]


@pytest.mark.process
@pytest.mark.parametrize("name, neighbour", GLOB_NAMES)
def test_a_glob_named_output_never_touches_a_live_neighbours_staging(tmp_path, name, neighbour):
    _check_a_glob_named_output_spares_a_live_neighbour(str(tmp_path), name, neighbour)


@pytest.mark.process
@pytest.mark.s3
@pytest.mark.parametrize("name, neighbour", GLOB_NAMES[:2])
def test_a_glob_named_output_never_touches_a_live_neighbours_staging_on_s3(s3_bucket, name, neighbour):
    _check_a_glob_named_output_spares_a_live_neighbour(f"{s3_bucket}/glob", name, neighbour)


def test_checkpoint_pruning_beside_a_glob_named_directory_spares_a_live_neighbour(tmp_path):
    import torch

    from training.checkpoint import CheckpointManager

    root, neighbour = tmp_path / "ckpt[12]", tmp_path / "ckpt1"
    dead = root / f".step-000000001{STAGING_TAG}20260101T000000-dead"  # a save of ours that died
    dead.mkdir(parents=True)
    (root / f".step-000000001{REPLACED_TAG}20260101T000000-dead").mkdir()  # a re-save of ours that died
    stager = _Stager(str(neighbour / "step-000000005"), KIND_CHECKPOINT)
    try:
        assert stager.proc.poll() is None and stager.staged_bytes() == b"neighbour"
        assert fnmatch.fnmatchcase(stager.staging.path, str(root / f".step-*{STAGING_TAG}*"))  # the old glob
        manager = CheckpointManager(str(root), steps_per_epoch=1, every_epochs=1, keep=1)
        for step in (1, 2, 3):
            manager.save(step, step, lambda: {"w": torch.zeros(2)})
        assert sorted(os.listdir(root)) == ["step-000000003"]  # pruned to keep=1, its dead copies removed
        assert stager.proc.poll() is None and stager.staged_bytes() == b"neighbour"
    finally:
        rc = stager.finish()
    assert rc == 0 and is_committed(str(neighbour / "step-000000005"))


def test_a_checkpoint_whose_marker_is_damaged_is_skipped_for_the_previous_one(tmp_path):
    import torch

    from training.checkpoint import CheckpointManager, check_checkpoint_root

    manager = CheckpointManager(str(tmp_path / "ckpt"), steps_per_epoch=1, every_epochs=1, keep=3)
    for step in (1, 2):
        manager.save(step, step, lambda: {"w": torch.zeros(2)})
    damaged = tmp_path / "ckpt" / "step-000000002" / MARKER
    damaged.write_text("[1, 2]")  # a JSON list where the marker's object belongs
    check_checkpoint_root(str(tmp_path / "ckpt"))  # a run may start: it resumes from the step before
    restored = manager.restore_latest()
    assert restored.step == 1
    assert restored.problems == [f"checkpoint {damaged.parent} cannot be read ({damaged} holds a JSON array, not an "
                                 f"object: the marker is damaged; restore it, or move {damaged.parent} away and re-run "
                                 "the job that produces it)"]


# --- overwrite swaps: the old output is never destroyed before the new one is complete --------------

OLD_FILES = ("old-a.txt", "sub/old-b.txt")
# A real job's commit, through the command line's error path (one line, the error's exit status).
OVERWRITER = textwrap.dedent("""
    import sys
    from common.cli import run_command
    from common.publish import publish

    def overwrite(_args):
        kind = sys.argv[2] if len(sys.argv) > 2 else "shardtrain.scores"
        with publish(sys.argv[1], mode="overwrite", marker={"kind": kind}) as staging:
            with staging.open("new.txt", "wb") as fh:
                fh.write(b"the new output")

    sys.exit(run_command(overwrite, None))
""")


def _digests(loc) -> dict[str, str]:
    """sha256 of every file of an output (the marker included), by path inside it."""
    loc = resolve(loc) if isinstance(loc, str) else loc
    loc.fs.invalidate_cache()  # S3: another process changed it; list and read it afresh
    return {path[len(loc.path) + 1:]: hashlib.sha256(loc.fs.cat_file(path)).hexdigest()
            for path in objects_under(loc)}


def _overwriter(uri: str, fault: str | None = None, kind: str = KIND_SCORES) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.Popen([sys.executable, "-c", OVERWRITER, uri, kind], env=env, stderr=subprocess.PIPE, text=True)


def _check_new_output(uri: str) -> None:
    resolve(uri).fs.invalidate_cache()
    final = require_committed(uri)
    assert sorted(_digests(final)) == [MARKER, "new.txt"] and read_marker(uri)["kind"] == KIND_SCORES
    assert not siblings(final, STAGING_TAG) and not siblings(final, REPLACED_TAG)  # nothing left beside it


def _check_killed_overwrite(base: str, step: str) -> None:
    target = f"{base}/scores"
    _publish(target, KIND_SCORES, OLD_FILES)
    old = _digests(target)
    proc = _overwriter(target, f"commit:{step}")
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL  # it died by the signal, at the fault point
    final = resolve(target)
    final.fs.invalidate_cache()
    staged, aside = siblings(final, STAGING_TAG), siblings(final, REPLACED_TAG)
    if step == "before-aside":  # the new output was staged complete; the old one untouched and committed
        assert len(staged) == 1 and is_committed(staged[0]) and not aside
        assert _digests(require_committed(target)) == old
    elif step == "after-aside":  # the old output is aside, committed and intact; nothing at the path
        assert len(aside) == 1 and _digests(aside[0]) == old and not final.exists()
        with pytest.raises(StorageError, match=r"an overwrite of it was interrupted, and the previous output is kept"):
            require_committed(target)
        assert clean_stale_staging(target)  # what the next job writing it does first, under its lock
        assert _digests(require_committed(target)) == old
    else:  # after-swap: the new output is committed; the replaced one is removed by the next writer
        assert len(aside) == 1 and _digests(aside[0]) == old
        assert sorted(_digests(require_committed(target))) == [MARKER, "new.txt"]
    # The retry: the next writer (this process; the killed one's lock is taken over, its pid dead).
    _publish(target, KIND_SCORES, ["new.txt"])
    _check_new_output(target)


@pytest.mark.process
@pytest.mark.parametrize("step", ["before-aside", "after-aside", "after-swap"])
def test_an_overwrite_killed_at_any_step_leaves_an_output_committed_and_a_retry_succeeds(tmp_path, step):
    _check_killed_overwrite(str(tmp_path), step)


@pytest.mark.process
@pytest.mark.s3
@pytest.mark.parametrize("step", ["before-aside", "after-aside", "after-swap"])
def test_an_overwrite_killed_at_any_step_on_s3_leaves_an_output_committed(s3_bucket, step):
    _check_killed_overwrite(f"{s3_bucket}/swap", step)


def _wait_stopped(proc: subprocess.Popen) -> None:
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"the overwriting job did not reach its fault point (status {status})"


def _deny_rename(path) -> callable:
    """Make renaming ``path`` fail for real; returns what undoes it. Root ignores permissions, so
    there the directory is made immutable (chattr +i: EPERM even for root); otherwise its parent
    is made read-only (EACCES)."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("running as root on a file system without chattr +i: no real way to make a rename fail")
        return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)
    parent = os.path.dirname(path)
    os.chmod(parent, 0o555)
    return lambda: os.chmod(parent, 0o755)


@pytest.mark.process
@pytest.mark.parametrize("rename", ["old output aside", "new output in"])
def test_a_rename_the_file_system_refuses_leaves_the_old_output_and_a_retry_succeeds(tmp_path, rename):
    target = str(tmp_path / "out" / "scores")
    _publish(target, KIND_SCORES, OLD_FILES)
    old = _digests(target)
    final = resolve(target)
    proc = _overwriter(target, "commit:before-aside:stop" if rename == "old output aside" else "commit:after-aside:stop")
    try:
        _wait_stopped(proc)
        if rename == "old output aside":
            victim = final.path
        else:  # the old output really was moved aside before the refused rename
            assert not final.exists() and _digests(siblings(final, REPLACED_TAG)[0]) == old
            victim = siblings(final, STAGING_TAG)[0].path
        undo = _deny_rename(victim)
        try:
            os.kill(proc.pid, signal.SIGCONT)
            stderr = proc.communicate(timeout=120)[1]
        finally:
            undo()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    error = stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in stderr
    assert re.fullmatch(rf"shardtrain: error: {re.escape(target)}: committing the output failed: PermissionError: .*",
                        error)
    if not final.exists():  # non-root: the read-only parent refused the move back too; the old output is aside
        assert _digests(siblings(final, REPLACED_TAG)[0]) == old
        clean_stale_staging(target)  # what the next job writing it does first
    assert _digests(require_committed(target)) == old  # the old output, committed and intact
    _publish(target, KIND_SCORES, ["new.txt"])  # the retry is not refused, and replaces it
    _check_new_output(target)


@pytest.mark.process
def test_a_model_moved_aside_by_an_interrupted_overwrite_counts_as_existing_and_is_never_lost(tmp_path):
    """An overwrite of a model killed between its two renames leaves nothing at the path and the
    old model aside. A train with output.mode=error is refused before it trains (not at its
    publish, after the work), and a publish whose restore of the aside copy fails refuses to
    publish rather than commit beside a model it would then delete."""
    from training.api import check_outputs

    model = str(tmp_path / "model")
    _publish(model, KIND_MODEL, OLD_FILES)
    old = _digests(model)
    proc = _overwriter(model, "commit:after-aside", kind=KIND_MODEL)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL and not resolve(model).exists()  # killed with the model aside
    (aside,) = siblings(resolve(model), REPLACED_TAG)
    assert _digests(aside) == old

    cfg = _train_cfg(tmp_path)  # output.mode: error
    with pytest.raises(OutputExistsError, match="already exists"):
        check_outputs(cfg, {"the training dataset (data.path)": cfg.data.path})

    undo = _deny_rename(aside.path)  # the next writer's restore fails for real
    try:
        with pytest.raises(StorageIOError, match=r"moving it back failed"):
            _publish(model, KIND_MODEL, ["new.txt"], mode="error")
    finally:
        undo()
    assert _digests(siblings(resolve(model), REPLACED_TAG)[0]) == old and not resolve(model).exists()
    with pytest.raises(OutputExistsError, match="already exists"):  # restored, then refused: mode error
        _publish(model, KIND_MODEL, ["new.txt"], mode="error")
    assert _digests(require_committed(model)) == old


@pytest.mark.process
def test_overwrite_through_a_symlink_replaces_its_target_and_the_link_stays_a_link(tmp_path):
    real, alias = tmp_path / "real_scores", tmp_path / "alias"
    _publish(str(real), KIND_SCORES, OLD_FILES)
    os.symlink(real, alias)
    check_replaceable(str(alias), KIND_SCORES)  # the check sees what the link points at
    _publish(str(alias), KIND_SCORES, ["new.txt"])
    assert alias.is_symlink() and os.readlink(alias) == str(real)
    assert sorted(_digests(str(real))) == [MARKER, "new.txt"] and read_marker(str(alias))["kind"] == KIND_SCORES
    assert sorted(os.listdir(tmp_path)) == ["alias", "real_scores"]  # nothing left beside either
    holder = _start_holder(str(alias))  # one output, one lock, whichever way it is spelt
    try:
        with pytest.raises(OutputLockedError, match=rf"{real} is being written by pid {holder.pid}"):
            _publish(str(real), KIND_SCORES)
    finally:
        _kill(holder)


def test_storage_errors_are_one_line_naming_the_path(tmp_path):
    # A path under a regular file cannot be created: the OSError becomes one line with the path.
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageIOError, match=rf"^{tmp_path}/file/.*failed: (FileExistsError|NotADirectoryError)") as err:
        _publish(str(tmp_path / "file" / "ds"), KIND_DATASET)
    assert "\n" not in str(err.value) and err.value.exit_code == 1


@pytest.mark.s3
def test_s3_lock_is_a_conditional_create(s3_bucket, s3_endpoint):
    uri = f"{s3_bucket}/ds"
    env = dict(os.environ)
    holder = _start_holder(uri, env=env)
    lock = lock_location(uri)
    try:
        assert json.loads(lock.fs.cat_file(lock.path))["pid"] == holder.pid
        with pytest.raises(OutputLockedError, match=rf"{uri} is being written by pid {holder.pid}"):
            _publish(uri, KIND_DATASET)
        assert not resolve(uri).exists()
    finally:
        _kill(holder)
    # Same host, pid gone: taken over.
    _publish(uri, KIND_DATASET)
    assert is_committed(uri)
    assert not lock.fs.exists(lock.path)
    # A holder on another host cannot be checked: refused, with how to clear it.
    with lock.fs.open(lock.path, "wb") as fh:
        fh.write(json.dumps({"host": "elsewhere", "pid": 1, "started_at": "then", "token": "t"}).encode())
    with pytest.raises(OutputLockedError, match=rf"pid 1 on host elsewhere.*delete {lock.uri}"):
        _publish(uri, KIND_DATASET)
    lock.fs.rm(lock.path)


# --- the training and run configs: checked before anything starts ---------------------------------

def _train_cfg(tmp_path, *extra):
    from train_configs import train_config

    return train_config(tmp_path / "ds", tmp_path / "model", *extra, ranks=None)


@pytest.mark.parametrize("override, message", [
    ("output.model_path={tmp}/ds/model", r"output.model_path .*/ds/model is inside the training dataset \(data.path\)"),
    ("output.run_dir={tmp}/ds", r"output.run_dir .*/ds is the same path as the training dataset"),
    ("checkpoint.path={tmp}/model/ckpt", r"checkpoint.path .*/model/ckpt is inside output.model_path"),
    ("output.run_dir={tmp}", r"output.run_dir .* contains the training dataset"),
])
def test_training_outputs_never_overlap_the_dataset_or_the_model(tmp_path, override, message):
    from training.api import check_outputs

    cfg = _train_cfg(tmp_path, override.format(tmp=tmp_path))
    with pytest.raises(ConfigError, match=message):
        check_outputs(cfg, {"the training dataset (data.path)": cfg.data.path})


def test_training_outputs_may_hold_a_colon_which_only_spark_written_outputs_may_not(tmp_path):
    """Models, run directories and checkpoints are written by fsspec and torch, not Spark: a run
    directory named by a timestamp is fine (the shard and score jobs refuse ':', test_storage)."""
    from training.api import check_outputs

    cfg = _train_cfg(tmp_path, f"output.run_dir={tmp_path}/runs/2026-12-02T10:00:00",
                     f"checkpoint.path={tmp_path}/ckpt:v2")
    check_outputs(cfg, {"the training dataset (data.path)": cfg.data.path})


def test_run_refuses_a_model_path_inside_a_shard_source_before_spark_starts(tmp_path, monkeypatch):
    from common import spark as spark_module
    from shardtrain.run import load_run_config, run

    def no_spark(*args, **kwargs):
        raise AssertionError("Spark was started")

    monkeypatch.setattr(spark_module, "get_or_create_session", no_spark)
    (tmp_path / "raw").mkdir()
    cfg = load_run_config("conf/run.yaml", [f"shard.sources.raw.path={tmp_path / 'raw'}",
                                            f"shard.output.path={tmp_path / 'shards'}",
                                            f"train.output.model_path={tmp_path / 'raw' / 'model'}"])
    with pytest.raises(ConfigError, match=r"output.model_path .*/raw/model is inside shard source 'raw'"):
        run(cfg)
    assert os.listdir(tmp_path / "raw") == []


def test_a_report_written_onto_a_full_disk_keeps_the_previous_one_whole(small_disk):
    """A disk that fills mid-write: the file keeps its previous content whole (no report without its
    closing tags), the error is one line naming the file, and no temporary file is left behind."""
    from common.html_report import write_page

    report = str(small_disk.path / "sweep.html")
    write_page(report, "<html>the previous report</html>")
    small_disk.fill()
    with pytest.raises(StorageIOError, match=rf"^{report}: writing the report failed: OSError: No space left") as err:
        write_page(report, "<html>" + "x" * 200_000 + "</html>")
    assert "\n" not in str(err.value)
    assert open(report).read() == "<html>the previous report</html>"
    assert sorted(os.listdir(small_disk.path)) == ["filler", "sweep.html"]
