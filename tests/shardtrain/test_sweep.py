"""``shardtrain sweep``: Optuna trials over one sharded dataset, each a real training run.

Real parts: published Parquet datasets, real training runs (in-process, and torch_tasks ranks on
local[2] for trials running two at a time; TorchDistributor launches for the job-tag cancel), a
real Optuna journal file, a real sweep process killed with SIGKILL mid-trial, then the same command
run again (in this process).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from common.errors import EXIT_RUNTIME, EXIT_USAGE, ConfigError, TrainingError
from common.publish import read_marker

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, os.path.join(TESTS, "training"))  # tabular_data, plugin_models
sys.path.insert(0, HERE)  # sweep_models
# MLflow starts usage telemetry, which calls out to the network, when imported outside a running test.
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"

from polling import wait_for  # noqa: E402
from tabular_data import write_dataset  # noqa: E402

LR = {"type": "float", "low": 0.003, "high": 0.03, "log": True}


@pytest.fixture(scope="module", autouse=True)
def _torch_settled():
    """torch sets TORCHINDUCTOR_CACHE_DIR on its first optimizer step (torch's doing, not a test's
    leak; tests/training/conftest.py says more): take that step before the environment guard looks."""
    import torch

    layer = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(torch.ones(1, 1)).sum().backward()
    optimizer.step()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("sweep") / "ds"), {"train": [[600], [600]], "val": [[300]]})


def sweep_yaml(dataset, out, space, *, trials, parallel=1, pruner="none", enqueue=(), epochs=2, launch=None,
               **sections) -> dict:
    """A sweep config as a user writes it: tiny 1-rank trials (in-process unless ``launch`` says)."""
    return {
        "sweep": {"trials": trials, "parallel_trials": parallel, "seed": 0, "space": space, "enqueue": list(enqueue),
                  "objective": {"metric": "val_accuracy"}, "pruner": {"type": pruner, "startup_trials": 2}},
        "output": {"path": str(out / "sweep"), "model_path": str(out / "best")},
        "train": {"data": {"path": dataset.uri}, "model": {"hidden": [8]},
                  "train": {"epochs": epochs, "batch_size": 64, "log_every_steps": 1000},
                  "launch": launch or {"mode": "in_process", "num_proc": 1}, **sections},
    }


def load(data: dict, *overrides: str):
    from common.config import from_dict
    from common.config import apply_overrides
    from shardtrain.sweep_config import SweepConfig

    return from_dict(SweepConfig, apply_overrides(data, list(overrides)))


def study(cfg):
    """The study as Optuna reads it back from the sweep's journal."""
    import optuna

    from shardtrain.sweep_study import study_storage

    storage, _ = study_storage(cfg)
    summaries = optuna.get_all_study_summaries(storage)
    assert len(summaries) == 1, [s.study_name for s in summaries]
    return optuna.load_study(study_name=summaries[0].study_name, storage=storage)


def trial_dir(cfg, number: int) -> str:
    return os.path.join(cfg.output.path, "trials", f"{number:04d}")


def assert_complete_run(run_dir: str, model: str, epochs: int) -> None:
    """What every trial leaves: a committed model, and a run directory with its records, report
    and a committed checkpoint at its last epoch."""
    assert read_marker(model)["kind"] == "shardtrain.model"
    for name in ("config.yaml", "run.json", "metrics.jsonl", "summary.json", "report.html"):
        assert os.path.isfile(os.path.join(run_dir, name)), (run_dir, name)
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [m["epoch"] for m in metrics] == list(range(1, epochs + 1))
    checkpoints = os.path.join(run_dir, "checkpoints")
    committed = [d for d in os.listdir(checkpoints) if os.path.isfile(os.path.join(checkpoints, d, "_COMMITTED"))]
    assert committed, f"no committed checkpoint in {checkpoints}"


# --- bad configs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("space, key, words", [
    ({"train.lrr": LR}, "train.lrr", "did you mean 'train.lr'"),
    ({"train.lr": {"type": "float", "low": 0.1, "high": 0.01}}, "train.lr", "is empty"),
    ({"train.batch_size": {"type": "int", "low": 64, "high": 64}}, "train.batch_size", "is empty"),
    ({"train.lr": {"type": "float", "low": 0.0, "high": 0.1, "log": True}}, "train.lr", "> 0 with log"),
    ({"train.weight_decay": {"type": "float", "low": -1.0, "high": 0.1, "log": True}}, "train.weight_decay",
     "> 0 with log"),
    ({"model.hidden": {"type": "categorical", "choices": []}}, "model.hidden", "at least one"),
    ({"launch.num_proc": {"type": "int", "low": 1, "high": 2}}, "launch.num_proc", "cannot be searched"),
    ({"train.batch_size": {"type": "int", "low": 0, "high": 64}}, "train.batch_size", "refuses 0"),
])
def test_a_bad_search_space_is_exit_2_naming_the_key(tmp_path, dataset, capsys, space, key, words):
    from shardtrain.cli import main

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep_yaml(dataset, tmp_path, space, trials=2)))
    assert main(["sweep", "--config", str(path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert key in err and words in err, err
    assert not (tmp_path / "sweep").exists()  # refused before anything was written


def test_parallel_trials_that_cannot_run_together_are_exit_2_naming_the_keys(tmp_path, dataset, spark):
    from shardtrain.sweep import sweep

    with pytest.raises(ConfigError, match="sweep.parallel_trials.*in_process") as err:
        load(sweep_yaml(dataset, tmp_path, {"train.lr": LR}, trials=2, parallel=2))
    assert err.value.exit_code == EXIT_USAGE
    with pytest.raises(ConfigError, match="sweep.parallel_trials.*backend=horovod"):
        load(sweep_yaml(dataset, tmp_path, {"train.lr": LR}, trials=2, parallel=2,
                        launch={"num_proc": 1, "backend": "horovod"}))
    # 3 trials x 1 rank on local[2]'s 2 task slots: refused up front, naming both keys.
    cfg = load(sweep_yaml(dataset, tmp_path, {"train.lr": LR}, trials=3, parallel=3,
                          launch={"num_proc": 1, "backend": "torch"}))
    with pytest.raises(ConfigError, match=r"sweep.parallel_trials=3 x train.launch.num_proc=1 needs 3 concurrent "
                                          r"Spark tasks.*local\[2\].*runs 2"):
        sweep(cfg, spark)
    assert not (tmp_path / "sweep").exists()


def test_a_space_key_is_overridden_on_the_command_line_whole_or_one_field(tmp_path, dataset):
    """An override's key splits at every dot, a space's keys hold dots: both forms still reach the key."""
    from shardtrain.sweep_config import load_sweep_config

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep_yaml(dataset, tmp_path, {"train.lr": LR, "model.hidden": {
        "type": "categorical", "choices": [[8], [16, 8]]}}, trials=2)))
    cfg = load_sweep_config(str(path), ["sweep.space.train.lr={type: float, low: 0.001, high: 0.1}",
                                        "sweep.space.model.hidden.choices=[[4]]",
                                        "sweep.space.train.weight_decay={type: float, low: 0.0, high: 0.1}"])
    space = {key: (spec.type, spec.low, spec.high, spec.log, spec.choices) for key, spec in cfg.sweep.space.items()}
    assert space == {"train.lr": ("float", 0.001, 0.1, False, None),  # replaced whole: no log: true left over
                     "model.hidden": ("categorical", None, None, False, [[4]]),  # one field changed
                     "train.weight_decay": ("float", 0.0, 0.1, False, None)}  # a key the file does not have
    with pytest.raises(ConfigError, match=r"sweep.space: unknown key 'train.lrr'; did you mean 'train.lr'"):
        load_sweep_config(str(path), ["sweep.space.train.lrr={type: float, low: 0.001, high: 0.1}"])
    with pytest.raises(ConfigError, match=r"sweep.space.train.lr: high must be above low"):
        load_sweep_config(str(path), ["sweep.space.train.lr.high=0.0001"])


def test_a_sqlite_storage_in_a_missing_directory_is_exit_2_naming_the_key_and_the_directory(tmp_path, dataset,
                                                                                            capsys):
    from shardtrain.cli import main

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep_yaml(dataset, tmp_path, {"train.lr": LR}, trials=1)))
    missing = tmp_path / "no" / "such" / "dir"
    assert main(["sweep", "--config", str(path), f"sweep.storage=sqlite:///{missing}/study.db"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "sweep.storage" in err and f"directory {missing} " in err, err
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "no").exists()  # refused before anything


def test_an_objective_the_labels_task_does_not_report_is_exit_2_naming_the_metrics_it_does(tmp_path, dataset,
                                                                                          capsys):
    from shardtrain.cli import main

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep_yaml(dataset, tmp_path, {"train.lr": LR}, trials=1)))
    assert main(["sweep", "--config", str(path), "sweep.objective.metric=val_mae"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert ("sweep.objective.metric: val_mae is not reported for a classification label; use val_accuracy or "
            "val_loss") in err, err
    assert not (tmp_path / "sweep").exists()  # refused before anything was written


def test_a_journal_on_object_storage_is_refused_asking_for_a_url(tmp_path, dataset):
    from shardtrain.sweep_study import study_storage

    cfg = load(sweep_yaml(dataset, tmp_path, {"train.lr": LR}, trials=2), "sweep.storage=s3://bucket/study.journal")
    with pytest.raises(ConfigError, match="sweep.storage: .*object storage.*RDB URL"):
        study_storage(cfg, probe_only=True)


# --- trials ------------------------------------------------------------------------------------------

@pytest.mark.spark
@pytest.mark.ranks
@pytest.mark.process  # a rank's pid is SIGSTOPped
# Not `stack`: what in it could differ on the current stack, which Spark jobs a launch owns (job
# tags on a launch's barrier job, submitted on the launching thread by TorchDistributor and torch_tasks
# alike) and cancelling one launch's alone, runs there in
# test_cancelling_one_launch_by_its_job_tag_leaves_the_other_launch_running; the rest is torch's and
# our own Python (the stall rule, Optuna's study, publishing), the same on both. The trials run on
# torch_tasks, as conf/sweep.yaml's do: each trial's rank is a Spark Python worker, which the stall
# rule SIGKILLs.
def test_trials_two_at_a_time_on_local_2_a_stalled_one_cancelled_alone_and_the_best_published(tmp_path, dataset,
                                                                                               spark, caplog):
    """Three 1-rank torch_tasks trials, two at once on local[2]'s two task slots: trial 0's
    rank is SIGSTOPped inside its epoch, so the stall rule stops that launch and cancels its Spark
    job, while trial 1's rank is held at start-up (its barrier job running all along); trial 2 takes
    the slot trial 0 left; trials 1 and 2 train and finish, and the better one is published."""
    import logging
    import threading

    from shardtrain.sweep import sweep
    from training import load_model

    caplog.set_level(logging.INFO, logger="shardtrain")
    gates = tmp_path / "gates"
    gates.mkdir()
    stop, hold = str(gates / "stop"), str(gates / "hold")
    space = {"model.kwargs.role": {"type": "categorical", "choices": ["stop", "hold", "plain"]}, "train.lr": LR}
    data = sweep_yaml(dataset, tmp_path, space, trials=3, parallel=2, epochs=1,
                      enqueue=[{"model.kwargs.role": "stop", "train.lr": 0.01},
                               {"model.kwargs.role": "hold", "train.lr": 0.003},
                               {"model.kwargs.role": "plain", "train.lr": 0.03}],
                      launch={"num_proc": 1, "backend": "torch_tasks", "start_timeout": 300, "stall_timeout_s": 10,
                              "max_restarts": 0, "env": {"PYTHONPATH": os.pathsep.join([ROOT, TESTS + "/training",
                                                                                          HERE])}})
    data["train"]["model"] = {"name": "sweep_models:held_or_stopped", "kwargs": {"gates": str(gates)}}
    cfg = load(data)
    outcome: dict = {}
    ended = threading.Event()

    def run():
        try:
            outcome["result"] = sweep(cfg, spark)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc
        finally:
            ended.set()

    runner = threading.Thread(target=run, name="test-sweep", daemon=True)
    runner.start()
    stopped_pid = None
    try:
        held_pid = int(wait_for(lambda: os.path.exists(hold + ".waiting") and open(hold + ".waiting").read(),
                                "trial 1's rank held at start-up", 600, abort=ended))
        stopped_pid = int(wait_for(lambda: os.path.exists(stop + ".waiting") and open(stop + ".waiting").read(),
                                   "trial 0's rank in its first step", 600, abort=ended))
        assert os.getpid() not in (held_pid, stopped_pid)  # both are rank processes, not the driver
        os.kill(stopped_pid, signal.SIGSTOP)
        wait_for(lambda: _state(stopped_pid) == "T", "trial 0's rank to be stopped", 30)  # proven stopped
        wait_for(lambda: [t.state.name for t in study(cfg).trials][:1] == ["FAIL"], "trial 0 to fail", 300,
                 abort=ended)
        error = study(cfg).trials[0].user_attrs["error"]
        assert error.startswith("RankStalledError: rank 0 stalled") and "rank 0 sent nothing" in error, error
        cancelled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cancelled Spark job")]
        assert len(cancelled) == 1, cancelled  # the stalled launch's own job, not the other trial's
        wait_for(lambda: _state(stopped_pid) in (None, "Z"), "the supervisor to remove the stopped rank", 60)
        assert _state(held_pid) not in (None, "Z")  # trial 1's rank lives on through the other's cancel
        assert not ended.is_set()
        open(hold + ".go", "w").close()
        assert ended.wait(600), "the sweep did not end"
    finally:
        open(hold + ".go", "w").close()
        if stopped_pid is not None and _state(stopped_pid) not in (None, "Z"):
            os.kill(stopped_pid, signal.SIGKILL)
            os.kill(stopped_pid, signal.SIGCONT)
        runner.join(600)
    assert "error" not in outcome, outcome
    result = outcome["result"]
    s = study(cfg)
    assert [t.state.name for t in s.trials] == ["FAIL", "COMPLETE", "COMPLETE"]
    assert [t.params["model.kwargs.role"] for t in s.trials] == ["stop", "hold", "plain"]
    # Two at a time: trials 0 and 1 ran side by side (each started before the other ended), and
    # trial 2 ran in the slot trial 0 left, beside trial 1.
    first, second, third = s.trials
    assert first.datetime_start < second.datetime_complete and second.datetime_start < first.datetime_complete
    assert third.datetime_start >= first.datetime_complete and third.datetime_start < second.datetime_complete
    for t in s.trials[1:]:
        assert_complete_run(os.path.join(trial_dir(cfg, t.number), "model.run"),
                            os.path.join(trial_dir(cfg, t.number), "model"), epochs=1)
        assert t.value == json.loads(open(os.path.join(trial_dir(cfg, t.number), "model.run", "summary.json")).read()
                                     )["metrics"][-1]["val_accuracy"]
    # The published model is the best trial's: its metric is the study's best value.
    assert result.best.number == s.best_trial.number and s.best_trial.number in (1, 2)
    best = cfg.output.model_path
    meta = json.load(open(os.path.join(best, "model.json")))
    assert meta["metrics"][-1]["val_accuracy"] == s.best_value == result.best.value
    marker = read_marker(best)
    assert marker["sweep"] == {"study_name": s.study_name, "fingerprint": result.fingerprint,
                               "trial": s.best_trial.number}
    record = json.load(open(os.path.join(best, "sweep.json")))
    assert record["trial"] == s.best_trial.number and record["objective"]["value"] == s.best_value
    assert record["params"]["train.lr"] == s.best_trial.params["train.lr"]
    assert meta["config"]["train"]["lr"] == s.best_trial.params["train.lr"]
    model = load_model(best)  # a plug-in model, rebuilt by its factory: the marker, model.json and weights check out
    assert model.meta["run_id"] == read_marker(os.path.join(trial_dir(cfg, s.best_trial.number), "model"))["run_id"]
    page = open(os.path.join(cfg.output.path, "sweep.html")).read()
    assert page.count("<img") >= 4 and "train.lr" in page and "model.kwargs.role" in page  # over trials, per parameter


@pytest.mark.spark
@pytest.mark.ranks
@pytest.mark.stack  # job tags (addJobTag, getJobIdsForTag, cancelJobsWithTag) and TorchDistributor's job are pyspark's
def test_cancelling_one_launch_by_its_job_tag_leaves_the_other_launch_running(tmp_path, spark):
    """What parallel trials rely on where pyspark's version could change it: two launches on two
    plain threads of the driver (as the sweep runs its trials), each a 1-process TorchDistributor
    barrier job on local[2] whose rank waits at a gate; each launch's ``LaunchJobs`` sees its own
    job's task alone, and cancelling the first launch's jobs (what the supervisor does to a stalled
    launch) ends that job only: the other's rank runs on and its job returns the rank's result.
    The whole sweep (a SIGSTOPped rank, the stall rule, the best trial published) is
    test_trials_two_at_a_time_on_local_2_a_stalled_one_cancelled_alone_and_the_best_published."""
    import threading

    from pyspark.ml.torch.distributor import TorchDistributor

    from common.spark import LaunchJobs

    def rank(gate: str) -> int:  # a nested function: TorchDistributor's pickle carries it by value
        import os
        import time

        with open(gate + ".pid.tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(gate + ".pid.tmp", gate + ".pid")
        while not os.path.exists(gate + ".go"):
            time.sleep(0.05)
        return os.getpid()

    gates = {name: str(tmp_path / name) for name in ("cancelled", "kept")}
    launches: dict = {}
    outcome: dict = {}

    def launch(name: str) -> None:  # a trial's thread: the launch's job tag is a property of this thread
        jobs = LaunchJobs(spark)
        launches[name] = jobs
        try:
            outcome[name] = TorchDistributor(num_processes=1, local_mode=False, use_gpu=False).run(rank, gates[name])
        except Exception as exc:  # noqa: BLE001 - handed to the test
            outcome[name] = exc
        finally:
            jobs.close()

    threads = {name: threading.Thread(target=launch, args=(name,), name=f"test-launch-{name}", daemon=True)
               for name in gates}
    for thread in threads.values():
        thread.start()
    pids: dict = {}
    try:
        for name, gate in gates.items():
            pids[name] = int(wait_for(lambda: os.path.exists(gate + ".pid") and open(gate + ".pid").read(),
                                      f"the {name} launch's rank at its gate", 300))
        # Both ranks run at once, and each launch counts its own job's task alone. Spark's status
        # store follows its listener bus, a moment behind the tasks: once it shows both tasks (in
        # all), each launch must count exactly one of them.
        tracker = spark.sparkContext.statusTracker()
        wait_for(lambda: sum(getattr(tracker.getStageInfo(stage), "numActiveTasks", 0)
                             for stage in tracker.getActiveStageIds()) == 2, "Spark's status to show both tasks", 60)
        assert [launches[name].running_tasks() for name in gates] == [1, 1]
        cancelled = launches["cancelled"].cancel()
        assert len(cancelled) == 1 and cancelled[0].startswith("Spark job "), cancelled
        threads["cancelled"].join(120)
        assert not threads["cancelled"].is_alive()
        assert isinstance(outcome["cancelled"], Exception) and "cancel" in str(outcome["cancelled"]).lower(), \
            outcome["cancelled"]
        # The other launch lives on through the cancel: its task still runs, its rank still waits.
        assert threads["kept"].is_alive() and "kept" not in outcome
        assert launches["kept"].running_tasks() == 1 and _state(pids["kept"]) not in (None, "Z")
        open(gates["kept"] + ".go", "w").close()
        threads["kept"].join(120)
        assert outcome.get("kept") == pids["kept"], outcome.get("kept")
    finally:
        for gate in gates.values():
            open(gate + ".go", "w").close()  # a cancelled task's rank may outlive it: release it too
        for thread in threads.values():
            thread.join(120)
        for pid in pids.values():
            if _state(pid) not in (None, "Z"):
                try:
                    wait_for(lambda: _state(pid) in (None, "Z"), "a released rank to exit", 30)
                except AssertionError:
                    os.kill(pid, signal.SIGKILL)


def _state(pid: int) -> str | None:
    """A process's state letter from /proc (T: stopped, Z: exited, unreaped); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_a_trial_with_an_absurd_learning_rate_is_pruned_at_an_epoch_boundary(tmp_path, dataset):
    from shardtrain.sweep import sweep

    cfg = load(sweep_yaml(dataset, tmp_path, {"train.lr": {"type": "float", "low": 1e-9, "high": 0.1, "log": True}},
                          trials=3, pruner="median",
                          enqueue=[{"train.lr": 0.02}, {"train.lr": 0.01}, {"train.lr": 1e-9}]))
    result = sweep(cfg)
    s = study(cfg)
    assert [t.state.name for t in s.trials] == ["COMPLETE", "COMPLETE", "PRUNED"], \
        [(t.state.name, t.intermediate_values) for t in s.trials]
    pruned = s.trials[2]
    assert pruned.params["train.lr"] == 1e-9 and list(pruned.intermediate_values) == [1]
    assert pruned.intermediate_values[1] < min(t.intermediate_values[1] for t in s.trials[:2])
    # It stopped after epoch 1 of 2, as a real run: that epoch's checkpoint kept, its model and report written.
    run_dir = os.path.join(trial_dir(cfg, 2), "model.run")
    assert_complete_run(run_dir, os.path.join(trial_dir(cfg, 2), "model"), epochs=1)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["stopped_early"] is True
    step = summary["steps_per_epoch"]
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", f"step-{step:09d}", "_COMMITTED")), \
        os.listdir(os.path.join(run_dir, "checkpoints"))
    assert result.best.number in (0, 1)


def test_a_trial_drawing_more_epochs_than_the_base_config_can_still_be_pruned(tmp_path, dataset):
    """With train.epochs in the space, the pruner may stop a trial before the trial's own last
    epoch, not the base config's: a 2-epoch trial of a 1-epoch base config is pruned after epoch 1."""
    from shardtrain.sweep import sweep

    space = {"train.lr": {"type": "float", "low": 1e-9, "high": 0.1, "log": True},
             "train.epochs": {"type": "int", "low": 1, "high": 2}}
    cfg = load(sweep_yaml(dataset, tmp_path, space, trials=3, pruner="median", epochs=1,
                          enqueue=[{"train.lr": 0.02, "train.epochs": 2}, {"train.lr": 0.01, "train.epochs": 2},
                                   {"train.lr": 1e-9, "train.epochs": 2}]))
    sweep(cfg)
    s = study(cfg)
    assert [t.state.name for t in s.trials] == ["COMPLETE", "COMPLETE", "PRUNED"], \
        [(t.state.name, t.intermediate_values) for t in s.trials]
    assert list(s.trials[2].intermediate_values) == [1]
    summary = json.load(open(os.path.join(trial_dir(cfg, 2), "model.run", "summary.json")))
    assert summary["stopped_early"] is True and len(summary["metrics"]) == 1, summary


def test_a_failing_trial_is_recorded_and_the_sweep_goes_on(tmp_path, dataset):
    from shardtrain.sweep import sweep

    # model.hidden: a categorical of lists (Optuna's choices are scalars: stored as JSON text, decoded)
    space = {"model.name": {"type": "categorical", "choices": ["mlp", "plugin_models:poisoned"]},
             "model.hidden": {"type": "categorical", "choices": [[8], [16, 8]]}}
    cfg = load(sweep_yaml(dataset, tmp_path, space, trials=3, epochs=1,
                          enqueue=[{"model.name": "mlp", "model.hidden": [16, 8]},
                                   {"model.name": "plugin_models:poisoned", "model.hidden": [8]},
                                   {"model.name": "mlp", "model.hidden": [8]}]))
    result = sweep(cfg)
    s = study(cfg)
    assert [t.state.name for t in s.trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    error = s.trials[1].user_attrs["error"]
    assert "NonFiniteLossError" in error and "non-finite" in error, error
    assert result.best.number in (0, 2)
    assert [t.params["model.hidden"] for t in result.trials] == [[16, 8], [8], [8]]
    trained = json.load(open(os.path.join(trial_dir(cfg, 0), "model", "model.json")))
    assert trained["config"]["model"]["hidden"] == [16, 8]  # the trial trained the list it drew
    page = open(os.path.join(cfg.output.path, "sweep.html")).read()
    assert "NonFiniteLossError" in page and "model.hidden" in page

    # No trial succeeds: exit 1, every trial's error named, and no model published.
    only_bad = load(sweep_yaml(dataset, tmp_path / "bad", space, trials=1, epochs=1,
                               enqueue=[{"model.name": "plugin_models:poisoned", "model.hidden": [8]}]))
    with pytest.raises(TrainingError, match="no trial of the sweep finished.*trial 0: NonFiniteLossError") as err:
        sweep(only_bad)
    assert err.value.exit_code == EXIT_RUNTIME
    assert not os.path.exists(only_bad.output.model_path)


@pytest.mark.process
def test_a_sweep_killed_in_its_third_trial_resumes_it_and_reruns_nothing_finished(tmp_path, dataset, capsys, caplog,
                                                                                  monkeypatch):
    """The sweep process (in-process trials: the trial trains in it) is SIGKILLed while its third
    trial waits at a gate in epoch 2 (epoch 1's checkpoint written); the same command again
    finishes the study: trials 0 and 1 untouched, trial 2 resumed from its checkpoint, trial 3 run.
    The kill is the process boundary: the command runs again through ``main(argv)`` in this process."""
    import logging

    from shardtrain.cli import main

    space = {"model.kwargs.gate": {"type": "categorical", "choices": [0, 1]}}
    data = sweep_yaml(dataset, tmp_path, space, trials=4, epochs=2,
                      enqueue=[{"model.kwargs.gate": 0}, {"model.kwargs.gate": 0}, {"model.kwargs.gate": 1}])
    data["train"]["model"] = {"name": "sweep_models:gated_when", "kwargs": {"after": 25}}  # 18 steps/epoch: epoch 2
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load(data)
    gate = str(tmp_path / "gate")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(TESTS, "training"), HERE]),
           "SHARDTRAIN_TEST_GATE": gate}
    command = [sys.executable, "-m", "shardtrain", "sweep", "--config", str(path)]
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(tmp_path))
    try:
        wait_for(lambda: os.path.exists(gate + ".waiting"), "the third trial at its gate", 600, proc=proc, log=log)
        assert int(open(gate + ".waiting").read()) == proc.pid  # the trial trains in the sweep's own process
        third = os.path.join(trial_dir(cfg, 2), "model.run", "checkpoints")
        assert os.path.isfile(os.path.join(third, "step-000000018", "_COMMITTED")), os.listdir(third)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL  # proven: killed by SIGKILL, not exited
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [t.state.name for t in study(cfg).trials] == ["COMPLETE", "COMPLETE", "RUNNING"]
    before = {n: (read_marker(os.path.join(trial_dir(cfg, n), "model"))["run_id"],
                  os.stat(os.path.join(trial_dir(cfg, n), "model.run", "metrics.jsonl")).st_mtime_ns) for n in (0, 1)}
    assert not os.path.exists(os.path.join(trial_dir(cfg, 2), "model"))

    # The same command (without the gate, which was the test's, not the sweep's), in this process.
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="shardtrain")
    capsys.readouterr()
    assert main(command[3:]) == 0
    out, logged = capsys.readouterr().out, [r.getMessage() for r in caplog.records]
    assert "2 run by this command" in out, out
    assert any(m.startswith("trial 2 was interrupted") for m in logged), logged
    assert not [m for m in logged if m.startswith(("trial 0:", "trial 1:"))], logged  # not run again
    s = study(cfg)
    assert [t.state.name for t in s.trials] == ["COMPLETE"] * 4
    assert {n: (read_marker(os.path.join(trial_dir(cfg, n), "model"))["run_id"],
                os.stat(os.path.join(trial_dir(cfg, n), "model.run", "metrics.jsonl")).st_mtime_ns)
            for n in (0, 1)} == before
    summary = json.load(open(os.path.join(trial_dir(cfg, 2), "model.run", "summary.json")))
    assert summary["resumed_from"].endswith("step-000000018"), summary["resumed_from"]
    assert [m["epoch"] for m in summary["metrics"]] == [1, 2]
    assert s.trials[2].params == {"model.kwargs.gate": 1}
    for n in range(4):
        assert_complete_run(os.path.join(trial_dir(cfg, n), "model.run"), os.path.join(trial_dir(cfg, n), "model"), 2)
    assert read_marker(cfg.output.model_path)["sweep"]["trial"] == s.best_trial.number

    # Once more: everything is finished, nothing runs, the best model is already there.
    caplog.clear()
    assert main(command[3:]) == 0
    out = capsys.readouterr().out
    assert "0 run by this command" in out, out
    assert any("already published" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.process
def test_a_sweep_killed_at_each_trial_boundary_draws_what_one_uninterrupted_run_draws(tmp_path, dataset, capsys,
                                                                                       monkeypatch):
    """Each run of the sweep process SIGKILLs itself as soon as its first trial is in the study
    (common.faults' ``sweep:after-trial``): the first run after trial 0, the second after trial 1,
    its last (before publishing); then the same command with ``sweep.trials=3`` finishes. The trials
    drew what one uninterrupted sweep of the seed draws, so none drew another's learning rate (before,
    each new process drew trial 0's values again)."""
    from shardtrain.cli import main
    from shardtrain.sweep import sweep

    data = sweep_yaml(dataset, tmp_path, {"train.lr": LR}, trials=2, epochs=1)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load(data)
    env = {**os.environ, "PYTHONPATH": ROOT, "SHARDTRAIN_FAULT": "sweep:after-trial"}
    command = [sys.executable, "-m", "shardtrain", "sweep", "--config", str(path)]
    for killed in range(2):
        log = tmp_path / f"run-{killed}.log"
        with open(log, "w") as out:
            run = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(tmp_path), timeout=600)
        assert run.returncode == -signal.SIGKILL, log.read_text()[-3000:]  # proven: killed, not exited
        assert [t.state.name for t in study(cfg).trials] == ["COMPLETE"] * (killed + 1)
    assert not os.path.exists(cfg.output.model_path)  # the second run died before publishing

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(command[3:] + ["sweep.trials=3"]) == 0
    assert "1 run by this command" in capsys.readouterr().out
    resumed = [t.params for t in study(cfg).trials]
    uninterrupted = load(sweep_yaml(dataset, tmp_path / "uninterrupted", {"train.lr": LR}, trials=3, epochs=1))
    sweep(uninterrupted)
    assert resumed == [t.params for t in study(uninterrupted).trials]
    assert len({p["train.lr"] for p in resumed}) == 3, resumed


def test_a_study_reopened_before_every_trial_draws_what_one_uninterrupted_study_draws():
    """The sweep's sampler (shardtrain.sweep_sampler), past TPE's 10 random startup trials too: a
    study reopened with a new sampler before each trial, as each run of a resumed sweep does,
    draws the values one study with one sampler draws."""
    import optuna

    from shardtrain.sweep_sampler import TrialSeededSampler
    from shardtrain.sweep_space import ParamSpec, suggest

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = {"train.lr": ParamSpec(**LR), "train.batch_size": ParamSpec(type="int", low=16, high=256),
             "model.hidden": ParamSpec(type="categorical", choices=[[8], [16, 8]])}

    def draw(study) -> dict:
        trial = study.ask()
        params = suggest(trial, space)
        study.tell(trial, params["train.lr"] * params["train.batch_size"])  # a result TPE can learn from
        return params

    storage = optuna.storages.InMemoryStorage()
    reopened = [draw(optuna.create_study(storage=storage, study_name="s", sampler=TrialSeededSampler(7),
                                         load_if_exists=True)) for _ in range(14)]
    one = optuna.create_study(sampler=TrialSeededSampler(7))
    assert reopened == [draw(one) for _ in range(14)]
    assert len({p["train.lr"] for p in reopened}) == 14


def test_a_trial_failed_on_a_full_disk_runs_again_on_the_rerun_at_most_sweep_retries_times(tmp_path, dataset,
                                                                                           capsys):
    """Two trials each write to a scratch path of their own (sweep_models.writes_scratch), both links
    to /dev/full: both fail with the kernel's ENOSPC, a failure that may pass (exit 1). Disk a is
    freed and the same command runs again: each failed trial runs again as a new trial with its
    values (sweep.retries: 1); a's trains and is published, b's fails again; a third run runs none."""
    from shardtrain.cli import main

    disks = [str(tmp_path / "disk-a"), str(tmp_path / "disk-b")]
    for disk in disks:
        os.symlink("/dev/full", disk)
    space = {"model.kwargs.scratch": {"type": "categorical", "choices": disks}}
    data = sweep_yaml(dataset, tmp_path, space, trials=2, epochs=1,
                      enqueue=[{"model.kwargs.scratch": disk} for disk in disks])
    data["train"]["model"] = {"name": "sweep_models:writes_scratch"}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load(data)
    argv = ["sweep", "--config", str(path)]

    assert main(argv) == EXIT_RUNTIME  # no trial finished, and a rerun may do better
    failed = study(cfg).trials
    assert [t.state.name for t in failed] == ["FAIL", "FAIL"]
    for t in failed:  # proven: the disk was full, and the failure is recorded as one that may pass
        assert "[Errno 28] No space left on device" in t.user_attrs["error"], t.user_attrs
        assert t.user_attrs["exit_code"] == EXIT_RUNTIME

    os.remove(disks[0])  # space freed on disk a
    capsys.readouterr()
    assert main(argv) == 0
    assert "2 run by this command" in capsys.readouterr().out
    trials = study(cfg).trials
    assert [(t.state.name, t.user_attrs.get("retry_of"), t.params["model.kwargs.scratch"]) for t in trials] == [
        ("FAIL", None, disks[0]), ("FAIL", None, disks[1]), ("COMPLETE", 0, disks[0]), ("FAIL", 1, disks[1])]
    assert_complete_run(os.path.join(trial_dir(cfg, 2), "model.run"), os.path.join(trial_dir(cfg, 2), "model"), 1)
    assert read_marker(cfg.output.model_path)["sweep"]["trial"] == 2

    assert main(argv) == 0  # trial 3 was trial 1's one retry: nothing is left to run
    assert "0 run by this command" in capsys.readouterr().out
    assert len(study(cfg).trials) == 4


@pytest.mark.parametrize("space, runs", [
    # Refused by the dataset (a batch larger than its 1200 rows: DatasetError, exit-2 class): never retried.
    ({"train.batch_size": {"type": "int", "low": 100_000, "high": 200_000}}, [(EXIT_USAGE, 1), (EXIT_USAGE, 1)]),
    # Diverging at once (NonFiniteLossError, exit-1 class): retried once, then failed for good.
    ({"train.lr": {"type": "float", "low": 1e35, "high": 1e37, "log": True}},
     [(EXIT_RUNTIME, 1), (EXIT_USAGE, 2), (EXIT_USAGE, 2)]),
], ids=["refused", "diverging"])
def test_a_sweep_whose_every_trial_failed_for_good_is_exit_2_and_a_rerun_runs_nothing(tmp_path, dataset, capsys,
                                                                                     space, runs):
    """Each run of the same command: (its exit status, the trials in the study after it). Before,
    both sweeps exited 1 on every rerun, for a scheduler to retry without end."""
    from shardtrain.cli import main

    data = sweep_yaml(dataset, tmp_path, space, trials=1, epochs=1)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load(data)
    outcomes = []
    for _ in runs:
        outcomes.append((main(["sweep", "--config", str(path)]), len(study(cfg).trials)))
    assert outcomes == runs
    assert all(t.state.name == "FAIL" for t in study(cfg).trials)
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("shardtrain: error: no trial of the sweep finished, and a rerun would run none"), err


def test_with_mlflow_the_sweep_is_a_parent_run_with_one_child_run_per_trial(tmp_path, dataset, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from shardtrain.sweep import sweep

    monkeypatch.chdir(tmp_path)  # the experiment's artifacts go to ./mlruns, MLflow's default
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    space = {"model.name": {"type": "categorical", "choices": ["mlp", "plugin_models:poisoned"]}}
    cfg = load(sweep_yaml(dataset, tmp_path, space, trials=2, epochs=1,
                          enqueue=[{"model.name": "mlp"}, {"model.name": "plugin_models:poisoned"}],
                          tracking={"mlflow": {"tracking_uri": uri, "experiment": "sweeps"}}))
    result = sweep(cfg)
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("sweeps").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert parent.info.run_name == result.study_name and parent.info.status == "FINISHED"
    assert parent.data.tags["study_fingerprint"] == result.fingerprint and parent.data.tags["best_trial"] == "0"
    assert parent.data.metrics["best_val_accuracy"] == result.best.value
    children = sorted((r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id),
                      key=lambda r: r.data.tags["sweep_trial"])
    assert [(r.info.run_name, r.info.status) for r in children] == [("trial 0", "FINISHED"), ("trial 1", "FAILED")]
    assert children[0].data.params["model.name"] == "mlp"  # the trial's own run: training's tracking, its config
    assert "NonFiniteLossError" in children[1].data.tags["error"]
