"""Real Horovod ranks launched by horovod.spark.run on a real local Spark session (2 ranks), and as
a spark-submit job on the standalone cluster fixture, whose workers give each task a fake GPU.
Launches are few and each asserts several properties, since each costs 10-20 s."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from common.errors import EXIT_RUNTIME
from run_report_checks import assert_run_report
from torch_ranks import run_loop
from torch_uneven import UNEVEN
from train_configs import train_config, train_overrides
from training import load_model, train
from training.epoch_steps import rank_row_range
from common.errors import RankFailedError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

pytestmark = [pytest.mark.spark, pytest.mark.horovod, pytest.mark.timeout(300)]


# The runs read the session's `uneven_dataset` (tests/training/conftest.py): torch_uneven.UNEVEN, shard counts
# and row groups that divide evenly by neither 2 nor 3 ranks, which test_torch_backend.py and test_torchrun.py
# read too.


def _cfg(ds, out, *extra):
    return train_config(ds, f"{out}/model", "launch.start_timeout=90", f"launch.env.PYTHONPATH={HERE}",
                        "train.batch_size=32", "train.lr=0.005", "train.log_every_steps=10",
                        "data.shuffle_buffer_rows=200", "model.hidden=[32]", *extra, ranks=2)


def assert_equal_steps_no_repeats(summary_ranks, total_rows, world, rows_per_step, epochs):
    steps = {r["steps"] for r in summary_ranks}
    assert len(steps) == 1, f"ranks ran different step counts: {[r['steps'] for r in summary_ranks]}"
    for epoch in range(epochs):
        stats = [r["epoch_stats"][epoch] for r in summary_ranks]
        assert len({s["batches"] for s in stats}) == 1
        assert all(s["duplicate_rows"] == 0 for s in stats)  # no row twice on a rank
        for rank, s in enumerate(stats):  # ranges are disjoint, so no row twice across ranks either
            lo, hi = rank_row_range(total_rows, rank, world)
            assert lo <= s["min_row"] and s["max_row"] < hi
        skipped = total_rows - sum(s["rows"] for s in stats)
        assert 0 <= skipped < world * rows_per_step


def test_two_ranks_fp16_grad_accum_uneven_layout(spark, uneven_dataset, tmp_path):
    """fp16 with 2-step gradient accumulation on 2 Horovod ranks over files and row groups that split
    unevenly: equal steps in both epochs, no row twice, the loss falls (0.49 -> 0.20 here) and the
    model beats the majority baseline; rank 0's predictions equal the published model's. It is given
    metrics in code that exist only in this process (user_code_cells): Horovod's ranks get them by
    value, and their sums reduced over both ranks give the accuracy the loop's own reduction does."""
    from user_code_cells import notebook_code

    code = notebook_code()
    result = train(_cfg(uneven_dataset, tmp_path, "train.precision=fp16", "train.grad_accum=2", "train.epochs=2"),
                   spark, metrics=code["metrics"], finalize=code["finalize"])
    assert all(m["val_my_accuracy"] == pytest.approx(m["val_accuracy"], abs=1e-12) for m in result.metrics)
    rows = sum(map(sum, UNEVEN["train"]))
    assert result.steps_per_rank == [2 * result.steps_per_epoch] * 2
    assert_equal_steps_no_repeats(result.ranks, rows, 2, 32 * 2, 2)
    losses = [m["train_loss"] for m in result.metrics]
    assert losses[-1] < losses[0]
    assert result.final["val_accuracy"] > result.final["baseline_accuracy"]
    # Every validation row, though 267 rows split 133/134 fill neither rank's batches evenly.
    assert all(m["val_rows"] == sum(map(sum, UNEVEN["val"])) for m in result.metrics)
    # What rank 0 predicted at the end equals what the published model predicts on raw rows.
    model = load_model(result.model_uri)
    probs = model.predict(uneven_dataset.raw["val"].iloc[result.reference["rows"]])
    np.testing.assert_allclose(probs, np.array(result.reference["predictions"]), rtol=1e-5, atol=1e-6)
    summary = json.load(open(os.path.join(result.run_dir, "summary.json")))
    assert summary["steps_per_rank"] == result.steps_per_rank
    assert all(r["device"] == "cpu" and r["gpu_addresses"] == [] for r in result.ranks)
    assert_run_report(result.run_dir, uneven_dataset.manifest["fingerprint"], 2, result.metrics)  # written by rank 0


@pytest.mark.ranks  # the uninterrupted run on the session's two Gloo ranks
def test_two_ranks_resumed_mid_epoch_after_a_nan_equal_an_uninterrupted_run(spark, uneven_dataset, tmp_path, two_ranks):
    """fp32, CPU, 2 ranks, 38 steps per epoch, checkpoints every 10 steps and at epoch ends, and no
    log-step checks. Rank 1's loss goes NaN at step 45 (TRIPWIRE_NAN_* through launch.env, no part of
    the run's identity): both ranks stop, naming step 45 and rank 1, and no checkpoint at or after
    step 45 exists. The rerun resumes mid-epoch 2 from step 40 (each rank its own partial epoch
    loss) and ends with weights bit-identical to a run never interrupted: that run on the session's
    two bare Gloo ranks (torch_ranks.run_loop on the ``two_ranks`` pool, no Spark job), as the
    backends' arithmetic is the same bit for bit (test_torch_backend's
    test_horovod_and_torch_train_identically).

    The failed launch also shows how any exception a Horovod rank raises reaches the driver: one
    RankFailedError whose first line is the rank's own exception (not a bare Py4JJavaError), with
    the rank's own traceback after it (a plugin model's ValueError on TorchDistributor ranks:
    test_torch_backend's test_a_failing_torch_rank_reports_its_own_traceback)."""
    same = ("model.name=plugin_models:tripwire", "train.precision=fp32", "train.epochs=2",
            "train.log_every_steps=1000", "checkpoint.every_steps=10")
    straight = run_loop(_cfg(uneven_dataset, tmp_path / "a", *same, "launch.backend=torch"), pool=two_ranks)
    assert straight.steps_per_epoch == 38

    with pytest.raises(RankFailedError) as info:
        train(_cfg(uneven_dataset, tmp_path / "b", *same, "launch.env.TRIPWIRE_NAN_RANK=1",
                    "launch.env.TRIPWIRE_NAN_CALL=45"), spark)
    message = str(info.value)
    first_line = message.splitlines()[0]
    assert first_line.startswith("training failed on rank ") and ": NonFiniteLossError: " in first_line, first_line
    assert "at optimizer step 45 on rank 1" in first_line and "Py4JJavaError" not in first_line
    # The rank's own traceback, down to the line of the rank loop that raised.
    assert "--- rank 1 traceback ---" in message and "raise NonFiniteLossError(" in message, message
    assert info.value.exit_code == EXIT_RUNTIME
    assert sorted(os.listdir(tmp_path / "b/model.run/checkpoints")) == ["step-000000038", "step-000000040"]

    resumed = train(_cfg(uneven_dataset, tmp_path / "b", *same), spark)
    assert resumed.resumed_from.endswith("step-000000040") and resumed.steps_per_rank == [76, 76]
    from safetensors.torch import load_file

    a, b = (load_file(os.path.join(r.model_uri, "model.safetensors")) for r in (straight, resumed))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert [m["epoch"] for m in resumed.metrics] == [1, 2]
    assert [m["train_loss"] for m in resumed.metrics] == pytest.approx([m["train_loss"] for m in straight.metrics])


def _spark_submit(args, cwd=ROOT, timeout=280):
    import pyspark

    env = dict(os.environ, SPARK_HOME=os.path.dirname(pyspark.__file__), PYSPARK_PYTHON=sys.executable,
               PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=HERE)
    submit = os.path.join(os.path.dirname(sys.executable), "spark-submit")
    return subprocess.run([submit, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.cluster
@pytest.mark.process  # spark-submit
def test_two_ranks_on_the_standalone_cluster_each_on_the_gpu_its_task_was_given(standalone_cluster, uneven_dataset,
                                                                                tmp_path):
    """spark-submit shardtrain/job.py train on the standalone cluster, whose two 1-core workers each
    offer one fake GPU (addresses 0 and 1, tests/spark_cluster.py): each rank must see the GPU
    address its own task was given, then fall back to CPU (no CUDA here). Two ranks carry the GPU
    assignment as three did (each task its own address); equal steps without repeats at world size
    3 on this uneven layout are test_data.py's test_equal_batches_no_repeats_bounded_skips[3-*]."""
    master = standalone_cluster.master_url
    proc = _spark_submit([
        "--master", master, "--conf", "spark.ui.enabled=false", "--conf", "spark.executor.memory=1g",
        "--conf", "spark.executor.resource.gpu.amount=1", "--conf", "spark.task.resource.gpu.amount=1",
        "shardtrain/job.py", "train", "--config", "conf/train.yaml", f"spark.master={master}",
        *train_overrides(uneven_dataset, f"{tmp_path}/model", "launch.gpus_per_proc=1", "launch.start_timeout=90",
                         "train.batch_size=32", "train.epochs=1", "train.precision=fp32", ranks=2)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "validation accuracy" in proc.stdout
    summary = json.load(open(tmp_path / "model.run/summary.json"))
    ranks = summary["ranks"]
    assert_equal_steps_no_repeats(ranks, sum(map(sum, UNEVEN["train"])), 2, 32, 1)
    assert summary["metrics"][-1]["val_accuracy"] > summary["metrics"][-1]["baseline_accuracy"]
    addresses = [r["gpu_addresses"] for r in ranks]
    assert all(len(a) == 1 for a in addresses) and sorted(a[0] for a in addresses) == ["0", "1"], addresses
    for r in ranks:  # no CUDA here: the rank names the address it was given and uses the CPU
        assert r["device"] == "cpu" and f"GPU address {r['gpu_addresses'][0]}" in r["device_reason"]
