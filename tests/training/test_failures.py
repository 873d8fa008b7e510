"""A rank that dies or stops, on real Horovod ranks under real Spark: the rank's process is
killed (SIGKILL) by pid while it trains, stopped (SIGSTOP) by pid while it validates, or kills
itself just after publishing the model, and the job must name the rank and the cause, never hang,
and (with restarts) finish with the same model as an uninterrupted run, never publishing twice.

Rank processes are found by a marker in their environment (``launch.env``), so a test only ever
signals the processes its own launch started."""

import logging
import os
import re
import signal
import threading
import time
import uuid
from types import SimpleNamespace

import psutil
import pytest
import torch
from safetensors.torch import load_file

from common.errors import EXIT_RUNTIME, OutputExistsError, RankStalledError
from common.faults import FAULT_ENV, FAULT_ONCE_ENV
from polling import wait_for
from run_report_checks import assert_run_report
from stopped_rank import stopped_rank_killed
from tabular_data import write_dataset
from torch_ranks import run_loop, values
from train_configs import train_overrides
from training import load_model, load_train_config, train
from training.export import published_by
from training.plan import build_plan

HERE = os.path.dirname(os.path.abspath(__file__))
# 46 steps per rank and epoch at batch 32: a kill lands mid-run, after the first checkpoint (with
# DiLoCo's overlap, epoch 1's end; in the one-epoch elastic run, step 10), with more than 30 steps
# to spare (the saboteur has found rank 1's process before that checkpoint and polls every 50 ms).
LAYOUT = {"train": [[800, 600], [600], [600, 400]], "val": [[300]]}
MARKER = "SHARDTRAIN_TEST_RANKS"

pytestmark = [pytest.mark.timeout(600)]


def on_horovod(test):
    """Every test here but the DiLoCo resume on two bare Gloo ranks runs Horovod ranks on Spark, and
    kills or stops a rank's process by pid (or has it kill itself)."""
    return pytest.mark.spark(pytest.mark.horovod(pytest.mark.process(test)))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("failures") / "ds"), LAYOUT)


def _overrides(ds, out, marker, *extra) -> list[str]:
    return train_overrides(ds, f"{out}/model", "launch.start_timeout=120", f"launch.env.PYTHONPATH={HERE}",
                           f"launch.env.{MARKER}={marker}", "train.batch_size=32", "train.epochs=2",
                           "train.log_every_steps=100", "data.shuffle_buffer_rows=200", "model.hidden=[16]",
                           "checkpoint.every_steps=20", "checkpoint.keep=3", *extra, ranks=2)


def _cfg(ds, out, marker, *extra):
    return load_train_config(None, _overrides(ds, out, marker, *extra))


def rank_process(marker: str, rank: int, exclude: frozenset = frozenset()) -> psutil.Process | None:
    """The Python process running ``rank`` of the launch tagged ``marker`` (not its shell)."""
    for proc in psutil.process_iter(["pid", "name"]):
        if proc.pid in exclude:
            continue
        try:
            env = proc.environ()
            if env.get(MARKER) == marker and env.get("HOROVOD_RANK") == str(rank) and \
                    "gloo_exec_fn" in " ".join(proc.cmdline()) and proc.name().startswith("python"):
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return None


def marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def committed_checkpoints(run_dir) -> dict[str, int]:
    """Each committed checkpoint's name and its marker's mtime (ns): a checkpoint written again
    (every save is staged and swapped in) has a new one."""
    root = os.path.join(run_dir, "checkpoints")
    found = {}
    for name in os.listdir(root) if os.path.isdir(root) else ():
        if not name.startswith("step-"):  # a save's hidden staging directory or lock file (.step-...)
            continue
        try:
            found[name] = os.stat(os.path.join(root, name, "_COMMITTED")).st_mtime_ns
        except FileNotFoundError:
            continue
    return found


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Saboteur(threading.Thread):
    """Once a checkpoint is committed, sends ``sig`` to rank 1's process (the first launch's only).
    The process is found first, while the ranks start (a scan of every process's environment,
    every 0.25 s: seconds before the first checkpoint): the signal then follows the checkpoint by
    one 50 ms poll of the checkpoint directory. ``checkpoints``: the committed ones at the signal."""

    def __init__(self, marker: str, run_dir: str, sig: int):
        super().__init__(daemon=True)
        self.marker, self.run_dir, self.sig = marker, run_dir, sig
        self.proc, self.error, self.signalled_at, self.stopped = None, None, None, False
        self.checkpoints: dict[str, int] = {}
        self.job_ended = threading.Event()

    def finish(self):
        """The job returned or raised: stop waiting for it (a job that failed before its first
        checkpoint then fails the test in seconds, not after the waits' timeouts), and join."""
        self.job_ended.set()
        self.join()

    def run(self):
        try:
            proc = wait_for(lambda: rank_process(self.marker, 1), "rank 1's process", timeout=240,
                            abort=self.job_ended, interval=0.25)
            self.checkpoints = wait_for(lambda: committed_checkpoints(self.run_dir), "the first checkpoint",
                                        timeout=240, abort=self.job_ended)
            self.proc = proc
            self.proc.send_signal(self.sig)
            self.signalled_at = time.monotonic()
            if self.sig == signal.SIGSTOP:  # proof it is stopped: state 'T' in /proc/<pid>/stat
                wait_for(lambda: _proc_state(self.proc.pid) == "T", "rank 1 to be stopped", timeout=30)
                self.stopped = True
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


# One kill-and-resume on Horovod, in the sync mode with the most to restore: DiLoCo with its average
# in flight during the next round (overlap), whose checkpoints carry each replica's own optimizer
# state and the outer optimizer's, resumed from an epoch end after a relaunch. The kill also shows how
# a killed rank is named (the launch error the restart is logged with is the one raised with
# launch.max_restarts=0: test_supervisor.py's test_relaunches_up_to_max_restarts). What the other
# sync modes add is carried by cheaper runs: every-step averaging resumed mid-epoch on Horovod
# ranks, bit for bit, by test_horovod_spark.py's
# test_two_ranks_resumed_mid_epoch_after_a_nan_equal_an_uninterrupted_run (a relaunch resumes
# through the same TrainState.resume as that rerun); DiLoCo without overlap resumed at a mid-epoch
# sync step by test_diloco_resumed_at_a_mid_epoch_sync_step_equals_the_uninterrupted_replicas below. local SGD
# shares all of its per-rank state with DiLoCo (training.strategies.periodic).
DILOCO_OVERLAP = ["train.sync.mode=diloco", "train.sync.every=10", "train.sync.overlap=true",
                  "checkpoint.every_steps=null"]


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def restarted_run(spark, dataset, tmp_path_factory):
    """One DiLoCo (overlap) run that two failures interrupt, each answered by a relaunch
    (launch.max_restarts=2): rank 1 is SIGKILLed by pid once epoch 1's checkpoint is committed, and
    the relaunched ranks resume from it and train to the end; their rank 0 then SIGKILLs itself just
    after publishing (once; its pid in ``flag``), and the second relaunch must finish without
    publishing again. Its three launches serve the kill-and-resume test and the published-then-killed
    test (once two runs of two launches each, one of them the other's uninterrupted reference)."""
    out = tmp_path_factory.mktemp("restarted")
    marker, flag = uuid.uuid4().hex, out / "killed-after-publish.pid"
    cfg = _cfg(dataset, out, marker, *DILOCO_OVERLAP, "output.mode=error", "launch.max_restarts=2",
               "launch.env.SHARDTRAIN_FAULT=rank0:after-run", f"launch.env.SHARDTRAIN_FAULT_ONCE={flag}")
    logger, handler = logging.getLogger("shardtrain"), _Messages()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    saboteur = Saboteur(marker, f"{out}/model.run", signal.SIGKILL)
    saboteur.start()
    try:
        result = train(cfg, spark)
    finally:
        saboteur.finish()
        logger.removeHandler(handler)
        logger.setLevel(level)
    return SimpleNamespace(cfg=cfg, result=result, model=out / "model", run_dir=out / "model.run", flag=flag,
                           marker=marker, messages=handler.messages, saboteur=saboteur)


@on_horovod
@pytest.mark.ranks  # the uninterrupted reference on the session's two Gloo ranks
def test_a_killed_rank_is_restarted_and_the_model_equals_an_uninterrupted_run(dataset, tmp_path, restarted_run,
                                                                              two_ranks):
    run, result, saboteur = restarted_run, restarted_run.result, restarted_run.saboteur
    assert saboteur.error is None and gone(saboteur.proc)  # rank 1 of the first launch really died
    spe = result.steps_per_epoch

    restarts = [m for m in run.messages if "restarting the ranks" in m]
    assert len(restarts) == 2  # after the kill, and after the publish (the test below)
    failed = [m for m in run.messages if m.startswith("ranks failed:")]
    assert len(failed) == 2, failed
    killed = failed[0]
    assert killed.startswith("ranks failed: training failed on rank 1: its process exited with status"), killed
    assert "killed by SIGKILL" in killed and "task slot" not in killed  # not a capacity problem
    died = re.search(r"rank 1 died at step (\d+)", killed)
    assert died and 0 < int(died.group(1)) < 2 * spe, killed  # the kill landed mid-run
    # The relaunch resumed from the checkpoint committed before the kill: a relaunch that trained
    # again from step 0 would have written that checkpoint again (a new marker).
    assert saboteur.checkpoints, "no checkpoint before the kill"
    now = committed_checkpoints(run.run_dir)
    assert all(now.get(name) == mtime for name, mtime in saboteur.checkpoints.items()), (saboteur.checkpoints, now)
    assert all(0 < int(name.split("-")[1]) < 2 * spe for name in saboteur.checkpoints)

    # The same training never interrupted, through the rank loop on two bare Gloo ranks (no Spark
    # job): the backends' arithmetic is the same bit for bit (test_torch_backend's
    # test_horovod_and_torch_train_identically), and DiLoCo is one strategy class on both.
    reference = run_loop(_cfg(dataset, tmp_path, uuid.uuid4().hex, *DILOCO_OVERLAP, "launch.backend=torch"),
                         pool=two_ranks)
    assert result.steps_per_rank == reference.steps_per_rank == [2 * spe] * 2
    ours = load_file(os.path.join(result.model_uri, "model.safetensors"))
    theirs = load_file(os.path.join(reference.model_uri, "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    for ours_epoch, theirs_epoch in zip(result.metrics, reference.metrics, strict=True):
        for key in ("train_loss", "val_loss", "val_accuracy"):
            assert ours_epoch[key] == theirs_epoch[key], (key, ours_epoch, theirs_epoch)
    report = assert_run_report(result.run_dir, dataset.manifest["fingerprint"], 2, result.metrics, restarts=2)
    assert "killed by SIGKILL" in report  # the restart log names why the ranks were relaunched
    wait_for(lambda: not marked_processes(run.marker), "no rank process left", timeout=60)


def _diloco_run_and_resume(group, resume_at: int, steps: int, spe: int) -> dict:
    """On one of two real Gloo ranks (tests/training/torch_ranks.py): DiLoCo (every 3 steps, momentum
    inside and Nesterov outside) for ``steps`` on this rank's own rows, uninterrupted; then, in fresh
    objects built from another seed, resumed from what a checkpoint holds at ``resume_at`` (a
    mid-epoch sync step), restored in TrainState.resume's order, and trained to the end again; and
    once more without this rank's own state, to show that state is what the resume needed."""
    import io
    from types import SimpleNamespace

    from common.dataset import LabelSpec
    from plugin_models import Wrap
    from training.config import LaunchConfig, TrainConfig, TrainLoopConfig
    from training.launchers import launcher_for
    from training.tasks import Objective
    from training.precision import Precision
    from training.strategies import strategy_class, technique
    from training.strategies.periodic import SyncConfig, flatten

    config = TrainConfig(train=TrainLoopConfig(batch_size=16, sync=SyncConfig(mode="diloco", every=3)),
                         launch=LaunchConfig(backend="torch", num_proc=2))
    objective = Objective(LabelSpec(name="label", task="classification", num_classes=2))
    plan = SimpleNamespace(steps_per_epoch=spe)
    rows = torch.Generator().manual_seed(100 + group.rank)  # each replica its own rows
    batches = []
    for _ in range(steps):
        x = torch.randn(16, 4, generator=rows)
        batches.append({"numeric": x, "label": (x[:, 0] + (group.rank - 0.5) * x[:, 1] > 0).long()})

    def build(seed):
        strategy = strategy_class(technique(config.train), launcher_for(config.launch))(group, Precision("fp32", "cpu"),
                                                                                        config)
        torch.manual_seed(seed)
        model = Wrap(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)))
        step_model = strategy.wrap(model)
        optimizer = strategy.optimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), model, 1)
        return strategy, model, step_model, optimizer

    def train_steps(strategy, model, step_model, optimizer, first):
        weights, saved = [], None
        for step in range(first, steps + 1):
            strategy.train_step(step_model, [batches[step - 1]], optimizer, objective, None)
            strategy.after_step(step, model, optimizer)
            weights.append(flatten(model))
            if step == resume_at:  # as TrainState.checkpoint: rank 0's model and optimizer, each rank's own state
                shared = group.allgather_object({"model": strategy.model_state_dict(model),
                                                 "optimizer": strategy.optimizer_state_dict(model, optimizer)})[0]
                buffer = io.BytesIO()  # through bytes, as a checkpoint file holds it
                torch.save({**shared, "rank": strategy.rank_state(model, optimizer)}, buffer)
                saved = buffer.getvalue()
        return weights, saved

    strategy, model, step_model, optimizer = build(seed=0)
    strategy.broadcast_initial_state(model, optimizer)
    strategy.begin(plan, 0, model)
    uninterrupted, saved = train_steps(strategy, model, step_model, optimizer, 1)

    def resumed(with_rank_state: bool):
        checkpoint = torch.load(io.BytesIO(saved), weights_only=False)
        strategy, model, step_model, optimizer = build(seed=1)
        strategy.load_state_dicts(model, optimizer, checkpoint["model"], checkpoint["optimizer"])
        strategy.load_rank_state(checkpoint["rank"] if with_rank_state else {}, model, optimizer)
        strategy.broadcast_initial_state(model, optimizer)
        strategy.begin(plan, resume_at, model)
        return train_steps(strategy, model, step_model, optimizer, resume_at + 1)[0]

    return {"uninterrupted": uninterrupted[resume_at:], "resumed": resumed(True),
            "without_rank_state": resumed(False), "rank_state": sorted(strategy.rank_state(model, optimizer))}


@pytest.mark.ranks  # the session's two Gloo ranks (torch_ranks.RankPool)
def test_diloco_resumed_at_a_mid_epoch_sync_step_equals_the_uninterrupted_replicas(two_ranks):
    """DiLoCo without overlap, resumed mid-epoch from a sync step (the property its kill-and-resume
    run carried, now carried here, by the DiLoCo kill-and-resume run above and by
    test_horovod_spark.py's mid-epoch resume after a NaN): each replica's
    inner optimizer state and the outer optimizer's come back from the checkpoint, and every later
    step's weights equal the uninterrupted run's on both ranks, bit for bit."""
    resume_at, steps, spe = 9, 15, 6  # 9: a sync step (every 3) inside the second epoch of 6 steps
    outcomes = two_ranks.run_calls([(_diloco_run_and_resume, (resume_at, steps, spe))])[0]
    for rank, result in enumerate(values(outcomes)):
        assert result["rank_state"] == ["optimizer", "outer", "scaler"], result["rank_state"]
        assert len(result["resumed"]) == len(result["uninterrupted"]) == steps - resume_at
        for step, (ours, theirs) in enumerate(zip(result["resumed"], result["uninterrupted"]), resume_at + 1):
            assert torch.equal(ours, theirs), (rank, step)
        # Without the rank's own state (inner momentum, the outer optimizer's) the resume goes astray.
        assert not torch.equal(result["without_rank_state"][-1], result["uninterrupted"][-1]), rank


@on_horovod
def test_a_rank_stopped_during_validation_ends_the_job_naming_it(spark, dataset, tmp_path, caplog):
    """Rank 1 SIGSTOPped by pid inside a validation pass (its first validation forward writes its pid
    to ``flag``; each of its batches takes a second, so the stop lands inside the pass) while rank 0
    validates or waits in the pass's allreduce: the supervisor names the silent rank first, ends the
    job (no relaunch at launch.max_restarts=0), cancels Horovod's Spark job and removes both rank
    processes. One launch for a stop in either phase: the supervisor names a rank that sends nothing
    by the same rule inside an epoch (test_supervisor.py's
    test_a_silent_rank_is_named_and_live_ranks_are_told_to_abort, over real sockets), and the kill,
    the cancelled job and the removed processes do not depend on the phase."""
    caplog.set_level("INFO", logger="shardtrain")
    marker = uuid.uuid4().hex
    flag = tmp_path / "validating.pid"  # rank 1's pid, written by its first validation forward
    stall = 5  # waited out in full; a rank reports every 0.25 s at this timeout, so 5 s leaves a loaded machine room
    stopped: dict = {}

    def stop_rank_1_in_validation():
        try:
            pid = int(wait_for(lambda: flag.exists() and flag.read_text().strip(), "rank 1 to validate", timeout=240))
            os.kill(pid, signal.SIGSTOP)
            stopped.update(pid=pid, at=time.monotonic())
            wait_for(lambda: _proc_state(pid) == "T", "rank 1 to be stopped", timeout=30)  # proof: state 'T'
            stopped["proved"] = True
        except Exception as exc:  # noqa: BLE001 - reported by the test
            stopped["error"] = exc
    thread = threading.Thread(target=stop_rank_1_in_validation, daemon=True)
    thread.start()
    try:
        with pytest.raises(RankStalledError) as info:
            train(_cfg(dataset, tmp_path, marker, f"launch.stall_timeout_s={stall}", "launch.max_restarts=0",
                       "train.epochs=1", "model.name=plugin_models:slow_validation", f"model.kwargs.flag={flag}",
                       "model.kwargs.seconds=1"), spark)
        ended = time.monotonic()
        thread.join()
        assert "error" not in stopped and stopped.get("proved"), stopped
        message = str(info.value)
        assert message.startswith("rank 1 stalled"), message
        assert "rank 1 sent nothing" in message and "at step" in message
        assert "rank 0 " in message  # the other rank's step, whether it was waiting or named too
        assert info.value.exit_code == EXIT_RUNTIME
        assert ended - stopped["at"] < stall + 60
        # Horovod's job runs on a thread of its own, under its own job group, which the launch adopted.
        cancelled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cancelled Spark job")]
        assert len(cancelled) == 1, cancelled
        # The supervisor itself removed the stopped rank and the waiting one: nothing is resumed here.
        wait_for(lambda: not marked_processes(marker), "no rank process left", timeout=60)
        assert not psutil.pid_exists(stopped["pid"]) or gone(psutil.Process(stopped["pid"]))
    finally:
        for proc in marked_processes(marker):  # only after a failure above: leave no strays behind
            proc.send_signal(signal.SIGKILL)
            proc.send_signal(signal.SIGCONT)


@on_horovod
def test_ranks_failing_after_the_publish_finish_the_run_without_publishing_again(spark, restarted_run):
    run = restarted_run
    result, model = run.result, run.model
    killed = int(run.flag.read_text())
    assert not psutil.pid_exists(killed) or gone(psutil.Process(killed))
    failed = [m for m in run.messages if m.startswith("ranks failed:")]
    assert len(failed) == 2, failed  # the first: rank 1 killed mid-run (the test above)
    assert "rank 0" in failed[1] and "killed by SIGKILL" in failed[1], failed
    assert result.ranks[0]["published"] is False
    assert any("finished after 2 restart" in m and "already published by this run" in m for m in run.messages)
    # The relaunch published nothing (the marker is older than the kill) and retrained nothing (it
    # resumed at the last step).
    assert (model / "_COMMITTED").stat().st_mtime_ns <= run.flag.stat().st_mtime_ns
    assert result.resumed_from.endswith(f"step-{2 * result.steps_per_epoch:09d}")
    assert result.ranks[0]["resumed_step"] == 2 * result.steps_per_epoch
    assert result.steps_per_rank == [2 * result.steps_per_epoch] * 2
    assert load_model(result.model_uri).metrics == result.metrics
    # Another run's model at that path is still refused, before it starts and at the publish.
    with pytest.raises(OutputExistsError, match="already exists"):
        train(run.cfg, spark)
    assert published_by(str(model), build_plan(run.cfg).provenance()) is None  # a new run: a run id of its own
    wait_for(lambda: not marked_processes(run.marker), "no rank process left", timeout=60)


@on_horovod
def test_elastic_the_survivor_goes_on_without_a_relaunch_in_equal_steps_for_the_new_world_size(dataset, tmp_path,
                                                                                             mlflow_store):
    """launch.elastic: 2 ranks, one epoch, rank 1 killed (SIGKILL by pid) mid-epoch: its process
    stops itself at the start of step 13 of 46 (plugin_models.stops_itself, after the checkpoint at
    step 10), and the test proves it stopped and a checkpoint committed, kills it and proves it dead
    (a kill raced from outside could land after rank 1 had finished, on a loaded machine). Rank 0
    goes on at world size 1 without a relaunch, repeating the interrupted epoch in the steps of a
    1-rank plan (a second epoch would add nothing here). Its own process with local[2,4]: Horovod
    elastic needs Spark task retries (the shared session has none: the dead rank's failed task would
    fail the Spark job). If Spark re-runs the task in time, the rank rejoins (and trains on: the
    stop is once) and the run finishes at world size 2; either way every rank ran the steps of the
    final world size's plan. (3 -> 2 ranks on local[3,4]: benchmarks/elastic_probe.py.)"""
    import json
    import subprocess
    import sys

    from training.epoch_steps import steps_per_epoch

    marker = uuid.uuid4().hex
    tracking = mlflow_store(tmp_path)  # an empty, migrated store: the session migrates one for all
    once = tmp_path / "stopped.pid"
    with stopped_rank_killed(once, lambda proc: {"rank": proc.environ().get("HOROVOD_RANK"),
                                                 "ours": proc.environ().get(MARKER) == marker,
                                                 "committed": committed_checkpoints(f"{tmp_path}/model.run")},
                             what="rank 1 (at step 13)") as killed:
        job = subprocess.run(
            [sys.executable, "-c", "import sys\nfrom training import load_train_config, train\n"
                                   "train(load_train_config(None, sys.argv[1:]))\n",
             *_overrides(dataset, tmp_path, marker, "train.epochs=1", "checkpoint.every_steps=10",
                         "launch.elastic=true", "launch.max_restarts=0", "model.name=plugin_models:stops_itself",
                         f"launch.env.{FAULT_ENV}=rank1:step-13:stop", f"launch.env.{FAULT_ONCE_ENV}={once}",
                         "spark.master=local[2,4]", f"tracking.mlflow.tracking_uri={tracking}",
                         "tracking.mlflow.experiment=elastic")],
            capture_output=True, text=True, timeout=540)
    # Rank 1 of this launch really stopped after a committed checkpoint, and died.
    assert "error" not in killed and killed["dead"], (killed, job.stderr[-3000:])
    assert killed["rank"] == "1" and killed["ours"] and killed["committed"], killed
    assert job.returncode == 0, job.stderr[-3000:]

    said = job.stderr[-6000:]
    assert "rank 1 left: its process died at step" in job.stderr, said
    assert "elastic reset: world size 2 -> 1" in job.stderr, said
    assert "restarting the ranks" not in job.stderr, said  # no relaunch
    summary = json.load(open(tmp_path / "model.run" / "summary.json"))
    world = summary["world_size"]
    per_rank = steps_per_epoch(sum(map(sum, LAYOUT["train"])), world, 32)
    assert summary["steps_per_epoch"] == per_rank
    assert summary["steps_per_rank"] == [per_rank] * world  # equal on every rank, in the final size's steps
    assert len(summary["metrics"]) == 1
    assert load_model(str(tmp_path / "model")).metrics == summary["metrics"]
    # Like any other run: report.html, and every epoch in MLflow.
    assert_run_report(tmp_path / "model.run", dataset.manifest["fingerprint"], world, summary["metrics"])
    _assert_epochs_tracked(tracking, "elastic", summary["metrics"])
    wait_for(lambda: not marked_processes(marker), "no rank process left", timeout=60)


def _assert_epochs_tracked(tracking_uri: str, experiment: str, metrics: list[dict]) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "FINISHED"
    history = sorted(client.get_metric_history(run.info.run_id, "val_loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(e["step"], pytest.approx(e["val_loss"])) for e in metrics]
