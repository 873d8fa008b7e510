"""Spark Connect end to end (issue 25), on pyspark 4's own local Connect server
(``spark.remote: local[2]`` through the project's session factory, in a child process:
tests/connect_process.py says why), against the suite's classic local[2] session in this process:

- shard -> train (launch.backend=torch, data.reader=arrow, 2 ranks) -> score -> load_model give the
  same shard files, weights and scores over Connect as on the classic session, with the same seed.
  The Connect run's ranks cannot reach the driver's progress server (``SHARDTRAIN_PROGRESS_HOST``
  names a host that does not resolve, as a cluster cannot reach a laptop running Databricks
  Connect), with a stall timeout far below the run's length: the launch says so once and finishes.
- a rank killed (SIGKILL by pid) over Connect, and on classic, is relaunched, resumes from its
  checkpoint and ends with the weights of an uninterrupted run (rank 0 stops itself just after
  committing its first checkpoint, ``common.faults``; the test checks its pid is a rank of the
  launch, that it is stopped, then kills it). Those are the module's two runs above: each is
  killed and relaunched, and both are held to the uninterrupted run below, bit for bit.
- a rank's training process stopped (SIGSTOP by pid, its state checked) ends the launch as on
  classic: RankStalledError naming rank 1, exit 1, the barrier job cancelled through its job tag
  (interruptTag), the stopped process removed.
- launch.backend left unset where Horovod is installed runs on torch over Connect: the shared
  Connect run above is that run (a stand-in ``horovod.torch`` on the path while it trains).
- launch.backend=torch_tasks over Connect (ranks inside the server's barrier tasks), uninterrupted,
  trains to the weights of the TorchDistributor runs, bit for bit: the module's uninterrupted run.

One Connect process for the module (its server start is the largest fixed cost); one shard ->
train (killed, relaunched) -> score run on each session, shared by every test that reads it
(instead of a kill run of its own per session); rows as few as keep a kill after a committed
checkpoint mid-run.

Skipped where Spark Connect cannot run (pyspark 3.5 from pip ships no Connect server).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import uuid

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from common.faults import FAULT_ENV, FAULT_ONCE_ENV

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from connect_process import ConnectProcess, connect_available  # noqa: E402
from polling import wait_for  # noqa: E402
from stopped_rank import stopped_rank_killed  # noqa: E402

WHY_NOT = connect_available()
pytestmark = [pytest.mark.spark, pytest.mark.timeout(900), pytest.mark.stack, pytest.mark.ranks,
              pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]
MARKER = "SHARDTRAIN_TEST_RANKS"
ROWS = 2000
UNREACHABLE = "shardtrain-unreachable.invalid"


# --- the steps, run on either session (module-level: the Connect process imports this file) ----------

def _train_overrides(shards: str, model: str, marker: str) -> list[str]:
    # About 25 steps per rank and epoch: a checkpoint at step 20 is committed mid-run, 30 steps before the end.
    return [f"data.path={shards}", f"output.model_path={model}", "launch.num_proc=2", "launch.backend=torch",
            "data.reader=arrow", "launch.start_timeout=120", "launch.stall_timeout_s=5", f"launch.env.PYTHONPATH={HERE}",
            f"launch.env.{MARKER}={marker}", "train.batch_size=32", "train.epochs=2", "model.hidden=[16]",
            "checkpoint.every_steps=20", "checkpoint.keep=3", "data.shuffle_buffer_rows=200"]


def shard_train_score(spark, root: str, shard_defaults: dict, raw: str, progress_host: str | None = None,
                      fake_horovod: str | None = None, extra: tuple[str, ...] = (), relative: bool = False) -> dict:
    """shard -> train -> score -> load_model on ``spark``; what the test compares, and what the
    launch logged about the progress server and relaunches. ``fake_horovod``: train with
    launch.backend unset, where ``horovod.torch`` can be found (see ``_horovod_on_the_path``).
    ``extra``: train overrides after the usual ones. ``relative``: score as conf/score.yaml's user
    does, with the model, the source and the output relative to the working directory (``root``)."""
    from pipelines import shard_dataset
    from pipelines.shard_config import load_shard_config
    from training import load_model, load_train_config, train

    said = _LogLines("shardtrain")
    if progress_host:
        os.environ["SHARDTRAIN_PROGRESS_HOST"] = progress_host
    try:
        sharded = shard_dataset(load_shard_config(defaults=shard_defaults,
                                                  overrides=[f"output.path={root}/shards"]), spark=spark)
        overrides = [*_train_overrides(sharded.uri, f"{root}/model", uuid.uuid4().hex), *extra]
        with _horovod_on_the_path(fake_horovod):
            if fake_horovod:
                overrides = [o for o in overrides if not o.startswith("launch.backend=")]
            cfg = load_train_config(None, overrides)
            configured = cfg.launch.backend  # what the config resolved, before the session is known
            trained = train(cfg, spark=spark)
    finally:
        os.environ.pop("SHARDTRAIN_PROGRESS_HOST", None)
        said.close()
    scored = _score_from(spark, root, trained.model_uri, raw, relative)
    sample = pd.read_parquet(raw).sort_values("id").head(50)
    with open(os.path.join(trained.model_uri, "model.json")) as fh:
        recorded = json.load(fh)["config"]["launch"]["backend"]
    return {"shards": sharded.uri, "model": trained.model_uri, **scored,
            "predictions": load_model(trained.model_uri).predict(sample), "sample_ids": sample["id"].tolist(),
            "unreachable": [line for line in said.lines if "never reached the driver's progress server" in line],
            "stalled": [line for line in said.lines if "stalled" in line], "train_seconds": trained.seconds,
            "configured_backend": configured, "recorded_backend": recorded, "world_size": trained.world_size,
            "unset_backend": [line for line in said.lines if "launch.backend is not set" in line],
            **_relaunches(said, trained)}


@contextlib.contextmanager
def _horovod_on_the_path(fake_horovod: str | None):
    """``horovod.torch`` importable while the block runs, where ``fake_horovod`` is given: no
    environment here has both Horovod and a Spark Connect server, so it is an empty package of
    that name, put on the path for this block only; it is never imported by a rank."""
    if not fake_horovod:
        yield
        return
    import importlib

    sys.path.insert(0, fake_horovod)
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(fake_horovod)
        for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
            del sys.modules[name]


def train_only(spark, shards: str, model: str, marker: str, extra: tuple[str, ...] = ()) -> dict:
    from training import load_train_config, train

    said = _LogLines("shardtrain")
    try:
        result = train(load_train_config(None, [*_train_overrides(shards, model, marker), *extra]), spark=spark)
    finally:
        said.close()
    return {"model": result.model_uri, **_relaunches(said, result)}


def _score_from(spark, cwd: str, model: str, raw: str, relative: bool) -> dict:
    """``shardtrain score`` of ``raw`` by ``model`` into ``cwd``/scores, from a config in ``cwd``;
    ``relative``: its paths relative to ``cwd``, where this process works for the call. Where the
    scores went, where this process worked and where the session's Python workers work."""
    import yaml

    from scoring.job import score

    def worker_cwd(batches):
        for _ in batches:
            pass
        yield pd.DataFrame({"cwd": [os.getcwd()]})

    paths = {"model": model, "raw": raw, "scores": f"{cwd}/scores"}
    if relative:
        paths = {key: os.path.relpath(path, cwd) for key, path in paths.items()}
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with open("score.yaml", "w") as fh:
            yaml.safe_dump({"model": paths["model"], "sources": {"raw": {"path": paths["raw"]}},
                            "output": {"path": paths["scores"], "keep_columns": ["id"]}, "batch_size": 64}, fh)
        uri = score("score.yaml", spark=spark).uri
    finally:
        os.chdir(before)
    if not relative:
        return {"scores": uri}
    return {"scores": uri, "score_cwd": cwd, "score_paths": paths,
            "worker_cwd": spark.range(0, 1, 1, 1).mapInPandas(worker_cwd, "cwd string").first()["cwd"]}


def _relaunches(said: "_LogLines", result) -> dict:
    """What a launch logged about relaunching its ranks, and the checkpoint it resumed from."""
    return {"resumed_from": result.resumed_from,
            "restarts": [line for line in said.lines if "restarting the ranks" in line],
            "failed": [line for line in said.lines if line.startswith("ranks failed:")]}


class _LogLines(logging.Handler):
    def __init__(self, logger: str):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.logger = logging.getLogger(logger)
        self.level_before = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())

    def close(self):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)
        super().close()


# --- the tests --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def connect():
    process = ConnectProcess([HERE])
    yield process
    process.close()


@pytest.fixture(scope="module")
def raw(spark, tmp_path_factory):
    from pipelines import generate_dataset

    root = tmp_path_factory.mktemp("connect-raw")
    generated = generate_dataset(str(root / "raw"), rows=ROWS, array_shape=[4], spark=spark)
    return str(root / "raw"), generated.shard_config("unused", output={"num_shards": 4, "rows_per_row_group": 500})


@pytest.fixture(scope="module")
def both(spark, connect, raw, tmp_path_factory):
    """The Connect run and the classic run, each with its rank 0 killed after its first checkpoint
    and relaunched (test_a_killed_rank_is_restarted_and_resumes reads what was killed; each run's
    ``killed``), both held to the uninterrupted run (``uninterrupted``) and to each other, bit for
    bit, as the tests comparing the two sessions do."""
    path, defaults = raw
    classic_root, connect_root = tmp_path_factory.mktemp("classic"), tmp_path_factory.mktemp("connect")
    fake = tmp_path_factory.mktemp("fake-horovod")
    (fake / "horovod" / "torch").mkdir(parents=True)
    (fake / "horovod" / "__init__.py").write_text("")
    (fake / "horovod" / "torch" / "__init__.py").write_text("")
    # The Connect run leaves launch.backend unset where horovod.torch can be found; the classic run
    # sets launch.backend=torch. Both train on torch, from the same seed: the same weights. Its ranks
    # cannot reach the driver's progress server, so no stall rule can see its stopped rank 0: it keeps
    # launch.stall_timeout_s=5, which test_ranks_that_cannot_reach_the_driver_are_not_called_stalled
    # reads, and a start timeout no launch on a loaded machine reaches (after start and stall timeouts
    # the supervisor says "never reached" during a launch; said by the killed launch and again by the
    # relaunch, it would be said twice).
    once = connect_root / "stopped.pid"
    with _rank_0_killed(once, connect.proc.pid, f"{connect_root}/model.run") as killed:
        over_connect = connect.call("test_connect:shard_train_score", root=str(connect_root), shard_defaults=defaults,
                                    raw=path, progress_host=UNREACHABLE, fake_horovod=str(fake), relative=True,
                                    extra=(*_kill_after_checkpoint(once, stall_timeout_s=5),
                                           "launch.start_timeout=600"))
    over_connect["killed"] = killed
    once = classic_root / "stopped.pid"
    with _rank_0_killed(once, os.getpid(), f"{classic_root}/model.run") as killed:
        on_classic = shard_train_score(spark, str(classic_root), defaults, path, extra=_kill_after_checkpoint(once))
    return {**on_classic, "killed": killed}, over_connect


@pytest.fixture(scope="module")
def uninterrupted(both, connect, tmp_path_factory):
    """launch.backend=torch_tasks over Connect (its ranks inside the Connect server's barrier tasks:
    a barrier mapInPandas, what Connect offers instead of RDDs) on the Connect run's shards, never
    interrupted: the weights both killed runs must end with."""
    _, over_connect = both
    return connect.call("test_connect:train_only", shards=over_connect["shards"],
                        model=str(tmp_path_factory.mktemp("torch-tasks") / "model"), marker=uuid.uuid4().hex,
                        extra=("launch.backend=torch_tasks",))


def _assert_same_weights(model: str, reference: str) -> None:
    ours = load_file(os.path.join(model, "model.safetensors"))
    theirs = load_file(os.path.join(reference, "model.safetensors"))
    assert ours.keys() == theirs.keys() and ours
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = open(path, "rb").read()
    return out


def test_shards_are_the_same_files_over_connect(both):
    on_classic, over_connect = both
    classic, connect = _files(on_classic["shards"]), _files(over_connect["shards"])
    assert sorted(classic) == sorted(connect)
    data = [name for name in classic if name.endswith(".parquet")]
    assert len(data) >= 4
    for name in data:
        assert classic[name] == connect[name], name


def test_weights_scores_and_load_model_are_the_same_over_connect(both):
    on_classic, over_connect = both
    # Both were killed and resumed (see ``both``); test_a_killed_rank_is_restarted_and_resumes holds
    # each to the uninterrupted run.
    _assert_same_weights(over_connect["model"], on_classic["model"])
    scored = [pd.read_parquet(run["scores"], engine="pyarrow").sort_values("id").reset_index(drop=True)
              for run in (on_classic, over_connect)]
    assert len(scored[0]) == ROWS and scored[0]["id"].tolist() == scored[1]["id"].tolist()
    np.testing.assert_array_equal(np.stack(scored[0]["probabilities"]), np.stack(scored[1]["probabilities"]))
    np.testing.assert_array_equal(over_connect["predictions"], on_classic["predictions"])
    by_id = scored[1].set_index("id").loc[over_connect["sample_ids"]]
    np.testing.assert_allclose(np.stack(by_id["probabilities"]), over_connect["predictions"], rtol=0, atol=1e-6)


def test_ranks_that_cannot_reach_the_driver_are_not_called_stalled(both):
    on_classic, over_connect = both
    # launch.stall_timeout_s=5 and no rank ever reported: the launch said so once, and finished.
    assert len(over_connect["unreachable"]) == 1, over_connect["unreachable"]
    assert UNREACHABLE in over_connect["unreachable"][0] and "rank(s) 0, 1" in over_connect["unreachable"][0]
    assert not over_connect["stalled"]
    # The run went on past the stall window (launch.stall_timeout_s=5) with no rank heard from: the
    # fallback to Spark's task state held while the ranks were still training, not only at the end.
    assert over_connect["train_seconds"] > 5, over_connect["train_seconds"]
    assert not on_classic["unreachable"]  # the classic run's ranks did report


def test_torch_tasks_over_connect_train_to_the_same_weights(both, uninterrupted):
    """launch.backend=torch_tasks over Connect: its ranks run inside the Connect server's barrier
    tasks (a barrier mapInPandas, what Connect offers instead of RDDs) and train to the Connect
    run's weights (TorchDistributor's), bit for bit; never interrupted, where that run was killed and
    resumed (test_a_killed_rank_is_restarted_and_resumes)."""
    _, over_connect = both
    assert not uninterrupted["restarts"] and uninterrupted["resumed_from"] is None, uninterrupted
    _assert_same_weights(uninterrupted["model"], over_connect["model"])


def test_relative_paths_score_over_connect_where_the_workers_work_elsewhere(both):
    """A Spark Connect session's Python workers run in its artifact directory, not in the client's:
    a relative path the driver's checks pass (conf/score.yaml's artifacts/model) named nothing there.
    The Connect run scored with relative paths (``both``); made absolute when the config was loaded,
    they scored what the classic run scored (test_weights_scores_and_load_model_are_the_same_over_connect)."""
    _, over_connect = both
    assert not any(os.path.isabs(path) for path in over_connect["score_paths"].values()), over_connect["score_paths"]
    assert over_connect["worker_cwd"] != over_connect["score_cwd"]  # where the workers would resolve them: not here
    assert over_connect["scores"] == f"{over_connect['score_cwd']}/scores"


def _rank_process(root_pid: int, rank: int, training: bool = False):
    """The process running ``rank`` under ``root_pid`` (the Connect process: its Spark server, the
    Python workers, torchrun and the ranks all descend from it), not torchrun itself. ``training``:
    the rank's training process itself, not pyspark's torch_run_process_wrapper above torchrun
    (which has the node's RANK too)."""
    import psutil

    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            command = " ".join(proc.cmdline())
            if proc.environ().get("RANK") == str(rank) and proc.name().startswith("python") and \
                    "torch.distributed.run" not in command and "torchrun" not in command and \
                    not (training and "torch_run_process_wrapper" in command):
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return None


def _committed_checkpoint(run_dir: str) -> bool:
    root = os.path.join(run_dir, "checkpoints")
    return os.path.isdir(root) and any(os.path.exists(os.path.join(root, d, "_COMMITTED")) for d in os.listdir(root)
                                       if d.startswith("step-"))


def _descends_from(pid: int, root_pid: int) -> bool:
    import psutil

    return any(proc.pid == pid for proc in psutil.Process(root_pid).children(recursive=True))


def _kill_after_checkpoint(once, stall_timeout_s: int = 120) -> tuple[str, ...]:
    """Train overrides: rank 0 stops itself just after committing its first checkpoint, once (the
    relaunched rank passes unharmed). A long stall timeout by default: the stop lasts until the
    kill, and the stall rule is not what these runs test."""
    return (f"launch.env.{FAULT_ENV}=commit:after-swap:stop", f"launch.env.{FAULT_ONCE_ENV}={once}",
            f"launch.stall_timeout_s={stall_timeout_s}")


def _rank_0_killed(once, root_pid: int, run_dir: str):
    """While the block runs a launch with ``_kill_after_checkpoint(once)``: once rank 0 has stopped
    itself, prove its pid is a rank of this launch (it descends from ``root_pid``: the Connect
    process, or this one on classic) and stopped after a committed checkpoint, SIGKILL it and prove
    it dead. Yields what was seen (``error`` where something did not happen)."""
    return stopped_rank_killed(once, lambda proc: {
        "rank": proc.environ().get("RANK"),
        "ours": _descends_from(proc.pid, root_pid),  # a rank of this launch, not any process
        "committed": _committed_checkpoint(run_dir)}, what="rank 0 (after its first checkpoint)")


@pytest.mark.parametrize("session", ["classic", "connect"])
def test_a_killed_rank_is_restarted_and_resumes(both, uninterrupted, session):
    """Rank 0 stops itself just after committing its first checkpoint (``common.faults``, once:
    the relaunched rank passes unharmed); the test proves the pid is a rank of this launch (under
    the Connect process, or under this one on classic) and stopped, SIGKILLs it and proves it dead,
    while the launch goes on. Classic too: the error pyspark 4's TorchDistributor raises for a
    killed barrier task is what the relaunch reads (on pyspark 3.5, test_pipeline_failures.py).
    The killed runs are the module's two runs (``both``), each held to the uninterrupted run."""
    on_classic, over_connect = both
    result = on_classic if session == "classic" else over_connect
    killed = result["killed"]
    assert "error" not in killed, killed.get("error")
    # The kill happened, to this launch's rank 0, after its first checkpoint was committed.
    assert killed["rank"] == "0" and killed["ours"] and killed["committed"], killed
    assert not killed["proc"].is_running() or killed["proc"].status() == "zombie"
    # One relaunch, for the barrier stage the kill failed (TorchDistributor's error; its first line is
    # what the log shows), resumed from a checkpoint rather than from scratch.
    assert len(result["restarts"]) == 1 and "TorchDistributor failed running 2 rank(s)" in result["failed"][0], result
    assert result["resumed_from"] is not None and "/model.run/checkpoints/step-" in result["resumed_from"]
    _assert_same_weights(result["model"], uninterrupted["model"])


def horovod_and_doctor(spark, shards: str, model: str) -> dict:
    """launch.backend=horovod through train() on ``spark``, and what doctor says there."""
    from dataclasses import asdict

    from common.errors import ShardtrainError
    from shardtrain.doctor import backend_status, check_executors, check_spark_mode
    from training import load_train_config, train

    overrides = [o for o in _train_overrides(shards, model, "refused") if not o.startswith("launch.backend=")]
    try:
        train(load_train_config(None, [*overrides, "launch.backend=horovod"]), spark=spark)
        refused = None
    except ShardtrainError as exc:
        refused = {"exit_code": exc.exit_code, "message": str(exc)}
    from common.spark import default_parallelism

    return {"refused": refused, "spark": asdict(check_spark_mode()), "backends": backend_status(),
            "parallelism": default_parallelism(spark), "executors": asdict(check_executors())}


def test_horovod_is_refused_over_connect_and_doctor_says_connect(connect, spark, tmp_path):
    from dataclasses import asdict

    from common.spark import default_parallelism
    from shardtrain.doctor import check_spark_mode
    from tabular_data import write_dataset

    shards = write_dataset(str(tmp_path / "ds"), {"train": [[200], [200]], "val": [[50]]}).uri  # 2 shards, 2 ranks
    said = connect.call("test_connect:horovod_and_doctor", shards=shards, model=str(tmp_path / "m"))
    assert said["refused"]["exit_code"] == 2
    assert "launch.backend=horovod" in said["refused"]["message"], said["refused"]
    assert "set launch.backend=torch" in said["refused"]["message"]
    assert not (tmp_path / "m").exists()  # refused before any rank ran
    assert said["spark"]["ok"] and said["spark"]["detail"].startswith("Spark Connect (the active session)")
    assert said["backends"]["torch"] == "" and "needs classic Spark" in said["backends"]["horovod"]
    # The doctor's one-task job runs on the Connect server's executors, which import shardtrain.
    assert said["executors"]["ok"] and said["executors"]["detail"].startswith("shardtrain 0.1.0 imports in the "
                                                                              "executors' Python"), said["executors"]
    # The shard job's staging parallelism: the cluster's, asked over Connect as on classic.
    assert said["parallelism"] == default_parallelism(spark) == spark.sparkContext.defaultParallelism
    here = asdict(check_spark_mode())  # this process: the suite's classic session
    assert here["ok"] and here["detail"].startswith("classic Spark (the active session")


def test_an_unset_backend_runs_on_torch_over_connect_where_horovod_is_installed(both):
    _, over_connect = both
    # The config picked horovod (it is "installed"); the Connect session ran the ranks on torch and
    # said so once, where an explicit launch.backend=horovod is exit 2 (test above).
    assert over_connect["configured_backend"] == "horovod", over_connect
    assert over_connect["recorded_backend"] == "torch" and over_connect["world_size"] == 2
    assert len(over_connect["unset_backend"]) == 1 and "ranks run on torch" in over_connect["unset_backend"][0]
    assert os.path.isfile(os.path.join(over_connect["model"], "_COMMITTED"))


def stalled_launch(spark, shards: str, model: str, marker: str) -> dict:
    """A launch whose rank the test stops: the error it ends with and what the supervisor logged."""
    from common.errors import ShardtrainError
    from training import load_train_config, train

    said = _LogLines("shardtrain")
    try:
        # The stall window is waited out in full once the rank is stopped: the config's minimum, 5 s
        # (a rank reports every 0.25 s at this timeout, which leaves a loaded machine room, as in
        # test_failures.py); 20 epochs keep the run going well past the stop.
        overrides = [*_train_overrides(shards, model, marker), "launch.stall_timeout_s=5", "launch.max_restarts=0",
                     "train.epochs=20"]
        train(load_train_config(None, overrides), spark=spark)
        error = None
    except ShardtrainError as exc:
        error = {"type": type(exc).__name__, "exit_code": exc.exit_code, "message": str(exc)}
    finally:
        said.close()
    return {"error": error, "cancelled": [line for line in said.lines if line.startswith("cancelled ")]}


def test_a_stopped_rank_ends_the_launch_over_connect_naming_it(both, connect, tmp_path):
    _, over_connect = both
    marker, out = uuid.uuid4().hex, tmp_path / "stalled"
    stopped, ended = {}, threading.Event()

    def saboteur():
        try:
            wait_for(lambda: _committed_checkpoint(f"{out}/model.run"), "the first checkpoint", timeout=240, abort=ended)
            proc = wait_for(lambda: _rank_process(connect.proc.pid, 1, training=True), "rank 1's process", timeout=60,
                            abort=ended)
            proc.send_signal(signal.SIGSTOP)
            wait_for(lambda: proc.status() == "stopped", "rank 1 to stop", timeout=30, abort=ended)
            stopped["proc"] = proc  # proof: its state is 'T'
        except Exception as exc:  # noqa: BLE001 - reported below
            stopped["error"] = exc

    thread = threading.Thread(target=saboteur, daemon=True)
    thread.start()
    try:
        result = connect.call("test_connect:stalled_launch", shards=over_connect["shards"], model=f"{out}/model",
                              marker=marker)
    finally:
        ended.set()
        thread.join()
        proc = stopped.get("proc")
        if proc is not None and proc.is_running() and proc.status() != "zombie":  # only after a failure
            proc.send_signal(signal.SIGKILL)
            proc.send_signal(signal.SIGCONT)
    assert "error" not in stopped, stopped.get("error")
    error = result["error"]
    # As on classic (test_failures): the rank named, exit 1; over Connect the barrier job is
    # cancelled through its job tag (interruptTag), and the stopped rank is gone.
    assert error and error["type"] == "RankStalledError" and error["exit_code"] == 1, result
    assert error["message"].startswith("rank 1 stalled"), error["message"]
    assert result["cancelled"] and all(line.startswith("cancelled operation ") for line in result["cancelled"]), result
    wait_for(lambda: not stopped["proc"].is_running() or stopped["proc"].status() == "zombie",
             "the stopped rank to be removed", timeout=60)
    assert not os.path.exists(f"{out}/model")
