"""A pipeline stage's rank that stops, on real torch.distributed ranks under real Spark
(TorchDistributor on local[2], 2 stages): the rank process is stopped (SIGSTOP) by pid mid-run.
Its neighbour blocks in a point-to-point receive; the supervisor ends the launch naming the
stopped rank with its stage and kills it; ``launch.max_restarts`` relaunches the ranks, which
resume from the newest checkpoint and publish the same weights as an uninterrupted run. That
relaunched run is also this suite's run of stages through ``training.train`` on TorchDistributor,
checked end to end. A rank killed (SIGKILL) by someone else, on TorchDistributor: test_connect.py's
test_a_killed_rank_is_restarted_and_resumes[classic] (the barrier stage fails whatever the other
ranks wait in).

The rank records its pid as it builds the model (``pipeline_ranks.pid_recording_mlp``), so the
test signals only processes its own launch started, and proves the signal landed before it
checks the outcome."""

import os
import signal
import threading

import psutil
import pytest
import torch
from safetensors.torch import load_file

from polling import wait_for
from tabular_data import write_dataset
from torch_ranks import run_loop
from train_configs import train_overrides
from training import load_train_config, train

HERE = os.path.dirname(os.path.abspath(__file__))
# 50 steps per epoch: the stop lands mid-run, after the first checkpoint (step 20), with more than 70
# steps to spare (the saboteur knows stage 1's pid, recorded as it built the model, before that checkpoint).
LAYOUT = {"train": [[400, 400], [400]], "val": [[200]]}

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900), pytest.mark.ranks]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("pp-failures") / "ds"), LAYOUT)


def _cfg(ds, out, pids, *extra):
    return load_train_config(None, train_overrides(
        ds, f"{out}/model", "launch.backend=torch", "launch.start_timeout=120", f"launch.env.PYTHONPATH={HERE}",
        "train.pipeline.stages=2", "train.pipeline.microbatches=4", "train.batch_size=24", "train.epochs=2",
        "train.log_every_steps=100", "data.shuffle_buffer_rows=200", "data.reader=arrow",
        "model.name=pipeline_ranks:pid_recording_mlp", f"model.kwargs.pid_dir={pids}", "model.kwargs.hidden=[16, 8]",
        "checkpoint.every_steps=20", "checkpoint.keep=3", *extra, ranks=2))


def _pids(pid_dir, rank: int) -> list[int]:
    """The pids rank ``rank`` had in each launch so far, in no particular order."""
    if not os.path.isdir(pid_dir):
        return []
    return [int(name.split("-")[1]) for name in os.listdir(pid_dir) if name.startswith(f"rank{rank}-")]


def _committed_checkpoint(run_dir) -> bool:
    root = os.path.join(run_dir, "checkpoints")
    return os.path.isdir(root) and any(os.path.exists(os.path.join(root, d, "_COMMITTED")) for d in os.listdir(root)
                                       if d.startswith("step-"))


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


class Saboteur(threading.Thread):
    """Once a checkpoint is committed, sends ``sig`` to the first launch's rank 1 (stage 1)."""

    def __init__(self, pid_dir, run_dir, sig: int):
        super().__init__(daemon=True)
        self.pid_dir, self.run_dir, self.sig = pid_dir, run_dir, sig
        self.pid, self.error, self.proved = None, None, False
        self.job_ended = threading.Event()

    def finish(self):
        self.job_ended.set()
        self.join()

    def run(self):
        try:
            wait_for(lambda: _committed_checkpoint(self.run_dir), "the first checkpoint", timeout=400,
                     abort=self.job_ended)
            (self.pid,) = _pids(self.pid_dir, 1)
            os.kill(self.pid, self.sig)
            if self.sig == signal.SIGSTOP:  # proof: state 'T' in /proc/<pid>/stat
                wait_for(lambda: _state(self.pid) == "T", "rank 1 to be stopped", timeout=30)
            else:
                wait_for(lambda: _gone(self.pid), "rank 1 to die", timeout=30)
            self.proved = True
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_a_stopped_stage_is_named_by_its_stage_then_relaunched_to_the_uninterrupted_weights(spark, two_ranks, dataset,
                                                                                            tmp_path, caplog):
    """Stage 1's process is stopped (SIGSTOP) mid-run: stage 0 blocks in a receive from it, the
    supervisor names the stopped rank with its stage and kills it (a stopped process cannot read
    "abort"), and launch.max_restarts relaunches the ranks, which resume from the newest checkpoint
    to the weights and metrics of an uninterrupted run."""
    caplog.set_level("INFO", logger="shardtrain")
    # The uninterrupted run on the session's two bare Gloo ranks (no Spark job): the same rank loop
    # and arithmetic.
    reference = run_loop(_cfg(dataset, tmp_path / "reference", tmp_path / "reference-pids"), two_ranks)

    stall, out, pids = 5, tmp_path / "restarted", tmp_path / "restarted-pids"  # a step takes milliseconds
    saboteur = Saboteur(pids, f"{out}/model.run", signal.SIGSTOP)
    saboteur.start()
    try:
        result = train(_cfg(dataset, out, pids, f"launch.stall_timeout_s={stall}", "launch.max_restarts=1"), spark)
        saboteur.finish()
        assert saboteur.error is None and saboteur.proved  # stage 1's process really was stopped
        wait_for(lambda: _gone(saboteur.pid), "the stopped rank to be removed", timeout=60)
        assert len(_pids(pids, 1)) == 2 and saboteur.pid in _pids(pids, 1)  # and a second launch started it again
    finally:
        for pid in _pids(pids, 0) + _pids(pids, 1):  # only after a failure above: leave no strays behind
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
    # Why the ranks were relaunched, in the RankStalledError's words: the stopped rank and its stage.
    # (With no restart left that error is raised: test_supervisor.py's test_relaunches_up_to_max_restarts;
    # its exit status 1: test_failures.py's stopped-rank tests.)
    (why,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ranks failed: ")]
    assert why.startswith("ranks failed: rank 1 (pipeline stage 1 of train.pipeline.stages=2, replica 0) stalled"), why
    assert "rank 1 sent nothing" in why
    assert "rank 0 " in why  # stage 0 is alive (its heartbeat goes on) but blocked in a receive from stage 1
    assert any("restarting the ranks" in r.getMessage() for r in caplog.records)

    resumed = result.ranks[0]["resumed_step"]
    assert 0 < resumed < 2 * result.steps_per_epoch  # resumed from a checkpoint taken mid-run
    assert result.steps_per_rank == reference.steps_per_rank
    # The stages through training.train on TorchDistributor, end to end: both read the whole split
    # (one replica) in equal steps, and the run learned.
    assert result.steps_per_epoch == sum(map(sum, LAYOUT["train"])) // 24
    assert result.steps_per_rank == [2 * result.steps_per_epoch] * 2
    assert result.metrics[-1]["train_loss"] < result.metrics[0]["train_loss"]
    assert result.final["val_accuracy"] > result.final["baseline_accuracy"]
    ours = load_file(os.path.join(result.model_uri, "model.safetensors"))
    theirs = load_file(os.path.join(reference.model_uri, "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    for ours_epoch, theirs_epoch in zip(result.metrics, reference.metrics, strict=True):
        for key in ("train_loss", "val_loss", "val_accuracy"):
            assert ours_epoch[key] == theirs_epoch[key], (key, ours_epoch, theirs_epoch)
