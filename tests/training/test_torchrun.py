"""launch.backend=torchrun: `shardtrain train` run by a real ``torchrun --nproc-per-node 2`` (two Gloo
ranks on CPU, no Spark in them) trains to the same weights, bit for bit, as the TorchDistributor
run of the same config and seed (both run the one rank loop on a ``TorchGroup``), with equal steps
on both ranks and rank 0 publishing. A rank SIGKILLed by pid after the first checkpoint is
relaunched by torchrun (``--max-restarts 1``), resumes from that checkpoint and ends with the
uninterrupted run's weights; one SIGKILLed just after rank 0 published is restarted too, and the
restarted ranks (the same launch: the same run id) find their model and finish without training,
under ``output.mode=error``, while a launch reusing that run id (``--rdzv-id``) with another
learning rate is a new run, refused there. A rank 0 whose peer never comes, or whose MASTER_ADDR
names no host, ends after ``launch.start_timeout`` in one line naming rank 1 (exit 1) or
MASTER_ADDR (exit 2). Without torchrun's environment, with a world size other than
``launch.num_proc`` or a MASTER_PORT that is no port, the command is exit 2 naming what to set.

Launches: two torchruns (the two kill tests' module fixtures), both read by the bit-identity test,
the finished one's run id reused by one more (refused before training); the TorchDistributor run
is the session's (``uneven_torch_run``, tests/training/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from common.errors import ConfigError
from common.faults import FAULT_ENV, FAULT_ONCE_ENV
from polling import wait_for
from spark_cluster import free_port
from torch_uneven import SETTINGS, TORCH_RUN
from train_configs import train_config, train_overrides
from training import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The config of the session's TorchDistributor run (``uneven_torch_run``), less its backend and the
# PYTHONPATH its Spark ranks are given (torchrun's ranks get theirs from the environment).
COMMON = tuple(o for o in (*SETTINGS, *TORCH_RUN) if not o.startswith(("launch.backend=", "launch.env.")))

pytestmark = [pytest.mark.timeout(900), pytest.mark.ranks]


def _torchrun() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "torch.distributed.run"]


def _run_torchrun(ds, out, *extra, restarts: int = 0, env_extra: dict | None = None,
                  rdzv_id: str | None = None) -> subprocess.Popen:
    """torchrun of 2 ranks training ``ds`` into ``<out>/model``; ``rdzv_id``: the launch's run id
    (a c10d rendezvous on a free port), else a fresh one (--standalone)."""
    overrides = train_overrides(ds, f"{out}/model", *COMMON, "launch.backend=torchrun", *extra, ranks=2)
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, FAULT_ONCE_ENV)}
    env.update({"PYTHONPATH": ROOT, **(env_extra or {})})
    rendezvous = ["--standalone"] if rdzv_id is None else [
        "--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", rdzv_id]
    # Each attempt's rank logs are kept (torchrun's --log-dir: <out>/torchrun-logs/<run id>/attempt_<n>/<rank>/),
    # and shown when a run fails.
    command = [*_torchrun(), *rendezvous, "--nproc-per-node", "2", f"--max-restarts={restarts}",
               "--log-dir", os.path.join(out, "torchrun-logs"), "--redirects", "3", "--tee", "3",
               "-m", "shardtrain", "train", "--config", _defaults(out), *overrides]
    return subprocess.Popen(command, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _defaults(folder) -> str:
    """A config file that sets nothing: the overrides on the defaults, as ``train_config`` builds them."""
    path = os.path.join(folder, "defaults.yaml")
    with open(path, "w") as fh:
        fh.write("{}\n")
    return path


def _finished(proc: subprocess.Popen) -> str:
    output = proc.communicate(timeout=800)[0]
    assert proc.returncode == 0, output[-6000:] + _rank_logs(proc.args)
    return output


def _rank_logs(command: list[str]) -> str:
    """Every attempt's rank logs of the torchrun ``command``, the end of each."""
    logs = command[command.index("--log-dir") + 1]
    parts = []
    for folder, _, files in sorted(os.walk(logs)):
        for name in sorted(files):
            with open(os.path.join(folder, name), errors="replace") as fh:
                parts.append(f"\n--- {os.path.relpath(os.path.join(folder, name), logs)}\n{fh.read()[-3000:]}")
    return "".join(parts)


def _weights(model_dir: str) -> dict:
    from safetensors.numpy import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def _assert_same_weights(a: str, b: str) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)


def _summary(out) -> dict:
    return json.loads((out / "model.run" / "summary.json").read_text())


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _stopped_pid(proc, once, what: str) -> int:
    """The pid the fault point wrote to ``once``, once that process is stopped (state 'T')."""
    wait_for(lambda: once.exists() and once.read_text() and _state(int(once.read_text())) == "T",
             what, timeout=600, proc=proc, interval=0.2)
    return int(once.read_text())


def _kill_and_finish(proc, pid: int) -> str:
    """SIGKILL ``pid``, wait until it is dead, then torchrun's output once it has finished."""
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _state(pid) in (None, "Z"), "the killed rank to die", timeout=60)
    return _finished(proc)


# Two torchrun launches for the module, each read by several tests: no launch of its own for the
# uninterrupted run. The run killed just after rank 0's publish trained uninterrupted up to that
# publish, and its published model is left as it was (asserted below): it is the uninterrupted
# torchrun run the TorchDistributor run and the resumed run are held to.

@pytest.fixture(scope="module")
def killed_after_checkpoint(uneven_dataset, tmp_path_factory):
    """Rank 0 stops itself once its first checkpoint is committed (the fault point of every commit);
    the fixture SIGKILLs it by pid. torchrun sees a rank die, stops the other, starts both again,
    and they resume. Returns (out, output, the stopped rank's environment, the checkpoints then)."""
    out = tmp_path_factory.mktemp("torchrun-killed-after-checkpoint")
    once = out / "stopped.pid"
    proc = _run_torchrun(uneven_dataset, out, restarts=1,
                         env_extra={FAULT_ENV: "commit:after-swap:stop", FAULT_ONCE_ENV: str(once)})
    try:
        pid = _stopped_pid(proc, once, "rank 0 to stop after its first checkpoint")
        with open(f"/proc/{pid}/environ", "rb") as fh:
            environ = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
        checkpoints = sorted(os.listdir(out / "model.run" / "checkpoints"))
        output = _kill_and_finish(proc, pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return out, output, environ, checkpoints


@pytest.fixture(scope="module")
def killed_after_publish(uneven_dataset, tmp_path_factory):
    """Rank 0 stops itself once its run returned (the model published); the fixture SIGKILLs it by
    pid, and torchrun restarts both ranks (same TORCHELASTIC_RUN_ID), under output.mode=error.
    Returns (out, output, the rank logs, the published files and marker as they were before the kill)."""
    out = tmp_path_factory.mktemp("torchrun-killed-after-publish")
    once = out / "stopped.pid"
    proc = _run_torchrun(uneven_dataset, out, "output.mode=error", restarts=1,
                         env_extra={FAULT_ENV: "rank0:after-run:stop", FAULT_ONCE_ENV: str(once)})
    try:
        pid = _stopped_pid(proc, once, "rank 0 to stop after its publish")
        published = {name: (out / "model" / name).read_bytes() for name in os.listdir(out / "model")}
        output = _kill_and_finish(proc, pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return out, output, _rank_logs(proc.args), published


@pytest.mark.spark
def test_torchrun_trains_bit_identically_to_torch_distributor(uneven_torch_run, killed_after_publish,
                                                              killed_after_checkpoint):
    reference = uneven_torch_run  # the same config on launch.backend=torch (tests/training/conftest.py)
    # The run that trained uninterrupted to its publish (its model as published: see the publish test).
    out, _, _, _ = killed_after_publish
    _assert_same_weights(f"{out}/model", reference.model_uri)
    summary = _summary(out)
    assert summary["world_size"] == 2 and summary["steps_per_epoch"] == reference.steps_per_epoch
    keys = ("train_loss", "val_loss", "val_accuracy")
    # Every epoch's metrics, as rank 0 recorded them in the published model.json.
    assert [{k: m[k] for k in keys} for m in summary["metrics"]] == [{k: m[k] for k in keys} for m in reference.metrics]
    # Both ranks' own accounts and log lines, from the run that finished in its second attempt.
    out, output, _, _ = killed_after_checkpoint
    summary = _summary(out)
    assert summary["world_size"] == 2 and summary["steps_per_epoch"] == reference.steps_per_epoch
    assert summary["steps_per_rank"] == reference.steps_per_rank == [2 * reference.steps_per_epoch] * 2
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert "rank 1 of 2:" in output and f"rank 0 publishes {out}/model" in output  # rank 1's own line
    assert f"model:   {out}/model" in output  # rank 0's summary


# Not stack: no Spark, and torch is the same on both profiles. It once failed on the current profile
# only, by load, not by version: torchrun's store kept across restarts (training.distributed.attempt_store).
def test_a_rank_killed_after_a_checkpoint_is_restarted_by_torchrun_and_resumes(killed_after_checkpoint,
                                                                               killed_after_publish):
    out, output, environ, checkpoints = killed_after_checkpoint
    # The stopped (then SIGKILLed) process was rank 0 of the first attempt, after a checkpoint.
    assert environ[b"RANK"] == b"0" and environ[b"TORCHELASTIC_RESTART_COUNT"] == b"0"
    assert [c for c in checkpoints if c.startswith("step-")]
    # Exit 0 although a rank was SIGKILLed: torchrun started the ranks again, and they resumed.
    summary = _summary(out)
    assert summary["resumed_from"] and "/model.run/checkpoints/step-" in summary["resumed_from"]
    assert summary["steps_per_rank"] == [2 * summary["steps_per_epoch"]] * 2
    uninterrupted, _, _, _ = killed_after_publish
    _assert_same_weights(f"{out}/model", f"{uninterrupted}/model")


def test_a_restart_after_rank_0_published_finishes_without_training_again(killed_after_publish):
    # torchrun restarted both ranks (same TORCHELASTIC_RUN_ID): under output.mode=error they find the
    # model this launch published and exit 0 without training, leaving the published model as it was.
    out, output, logs, published = killed_after_publish
    assert "model.safetensors" in published
    marker = json.loads(published["_COMMITTED"])
    assert "attempt_1" in logs  # torchrun did restart the ranks
    # One run id for the launch: the model's, from torchrun's run id, in both attempts.
    assert marker["run_id"].startswith("torchrun-") and marker["run_id"][len("torchrun-"):] in logs
    assert output.count("already published by this run") == 2, output[-4000:]  # both restarted ranks
    assert "OutputExistsError" not in output and "resuming from" not in output
    assert {name: (out / "model" / name).read_bytes() for name in os.listdir(out / "model")} == published
    summary = _summary(out)
    assert summary["steps_per_rank"] == [2 * summary["steps_per_epoch"]] * 2


def test_a_new_launch_reusing_a_finished_runs_id_with_another_config_is_a_new_run(uneven_dataset,
                                                                                 killed_after_publish):
    # A launch of its own with the finished launch's run id (torchrun's --rdzv-id), on its model path,
    # with another learning rate: a new run, not the finished one, which output.mode=error refuses
    # (rank 0's exit 2) because a model is there. (The same command with that run id is the same run:
    # the restarted processes of the test above, which finish without training.)
    out, _, _, published = killed_after_publish
    run_id = json.loads(published["_COMMITTED"])["run_id"]
    assert run_id.startswith("torchrun-")
    other = _run_torchrun(uneven_dataset, out, "output.mode=error", "train.lr=0.5", rdzv_id=run_id[len("torchrun-"):])
    output = other.communicate(timeout=600)[0]
    assert other.returncode != 0, output[-4000:]
    assert f"shardtrain: error: {out}/model already exists; set output.mode=overwrite" in output, output[-4000:]
    assert "exitcode  : 2" in output and "already published by this run" not in output, output[-4000:]
    assert f"under this run id ({run_id}) by a run with another config" in output, output[-4000:]
    assert {name: (out / "model" / name).read_bytes() for name in os.listdir(out / "model")} == published


@pytest.mark.parametrize("master_addr, exit_code, says", [
    ("127.0.0.1", 1, "rank(s) 1 of WORLD_SIZE=2 never arrived at the rendezvous at MASTER_ADDR:MASTER_PORT=127.0.0.1:"),
    ("no.such.host.invalid", 2, "MASTER_ADDR=no.such.host.invalid does not resolve to an address"),
])
def test_a_rank_whose_peer_or_address_never_answers_ends_after_launch_start_timeout_in_one_line(
        uneven_dataset, tmp_path, master_addr, exit_code, says):
    # Rank 0 of a world of 2 started alone, as a launcher without an agent starts it (the environment
    # only): rank 1 never comes, or MASTER_ADDR names no host.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHELASTIC_") and k not in (FAULT_ENV, FAULT_ONCE_ENV)}
    env.update(PYTHONPATH=ROOT, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR=master_addr,
               MASTER_PORT=str(free_port()))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "shardtrain", "train", "--config", _defaults(tmp_path),
                           *train_overrides(uneven_dataset, f"{tmp_path}/model", "launch.backend=torchrun",
                                            "launch.start_timeout=3", ranks=2)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - started
    errors = [line for line in proc.stderr.splitlines() if line.startswith("shardtrain: error:")]
    assert proc.returncode == exit_code and len(errors) == 1 and says in errors[0], proc.stderr[-4000:]
    assert "launch.start_timeout=3s" in errors[0] and seconds >= 3  # it waited that long for what never came
    assert "Traceback" not in proc.stderr and "frame #" not in proc.stderr, proc.stderr[-4000:]
    assert seconds < 120  # not the collective timeout's 10 minutes (a bound for a loaded machine, not a timing)
    assert not os.path.exists(f"{tmp_path}/model")


@pytest.mark.parametrize("env, message", [
    ({}, "launch.backend=torchrun runs each rank as a process a launcher started, but RANK, WORLD_SIZE, "
         "MASTER_ADDR, MASTER_PORT, LOCAL_RANK is not set"),
    ({"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "LOCAL_RANK": "0"},
     "launch.backend=torchrun: the launcher started WORLD_SIZE=3 rank(s) but launch.num_proc=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999", "LOCAL_RANK": "0"},
     "launch.backend=torchrun: MASTER_PORT=99999 is not a TCP port; set it to rank 0's rendezvous port, from 1 to "
     "65535"),
])
def test_without_a_launchers_environment_with_another_world_size_or_no_port_it_is_exit_2(uneven_dataset, tmp_path,
                                                                                         monkeypatch, env, message):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = train_config(uneven_dataset, f"{tmp_path}/model", "launch.backend=torchrun", ranks=2)
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert str(err.value).startswith(message) and err.value.exit_code == 2
    assert not os.path.exists(f"{tmp_path}/model") and not os.path.exists(f"{tmp_path}/model.run")


def test_the_command_without_torchrun_exits_2_naming_launch_backend(uneven_dataset, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-m", "shardtrain", "train", "--config", _defaults(tmp_path),
                           *train_overrides(uneven_dataset, f"{tmp_path}/model", "launch.backend=torchrun", ranks=2)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "launch.backend=torchrun" in proc.stderr and "torchrun --nproc-per-node" in proc.stderr

