"""launch.backend=torch: real torch.distributed ranks (Gloo, CPU) started by pyspark's
TorchDistributor as barrier tasks on a real local[2] session, running the same loop as Horovod.

The two backends do the same arithmetic (DDP averages by dividing by the world size before the
sum, Horovod after: both exact for 2 ranks; the torch group gives a fresh optimizer its state the
way Horovod's broadcast does), so with fp32 on CPU and the same seed they train to bit-identical
weights, and a checkpoint written by one resumes on the other to the weights of an uninterrupted
run. The Horovod half skips where Horovod is not installed (the current-stack profile).

Launches: the plain 2-epoch torch run is the session's (``uneven_torch_run``, tests/training/conftest.py:
test_torchrun.py compares with it too); gradient accumulation and FSDP are compared with DDP through
the rank loop without Spark (``sgd_epochs``), and a Horovod checkpoint resumes there too, both on the
session's two Gloo ranks (``two_ranks``: started once for this file and test_pipeline,
test_ft_transformer, test_periodic_sync, test_pipeline_failures)."""

import os

import numpy as np
import pytest

from common.errors import EXIT_RUNTIME, RankFailedError
from resume_from import copy_checkpoint
from torch_ranks import values
from torch_uneven import UNEVEN, torch_config
from training import load_model, train
from training.epoch_steps import rank_row_range

# `spark` on the tests that launch on the suite's session; the rank-loop launches need none.
pytestmark = [pytest.mark.timeout(600), pytest.mark.ranks]


def _cfg(ds, out, *extra, backend="torch"):
    return torch_config(ds, out, f"launch.backend={backend}", *extra)


def _weights(result):
    from safetensors.numpy import load_file

    return load_file(os.path.join(result.model_uri, "model.safetensors"))


def _assert_identical(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)
    # The last epoch's metrics (a resumed run's history starts at its checkpoint's epoch).
    assert {k: a.final[k] for k in ("train_loss", "val_loss", "val_accuracy")} == \
        {k: b.final[k] for k in ("train_loss", "val_loss", "val_accuracy")}


def _assert_equal_steps(result, epochs):
    rows = sum(map(sum, UNEVEN["train"]))
    assert [r["rank"] for r in result.ranks] == [0, 1]
    assert result.steps_per_rank == [epochs * result.steps_per_epoch] * 2
    for epoch in range(epochs):
        stats = [r["epoch_stats"][epoch] for r in result.ranks]
        assert len({s["batches"] for s in stats}) == 1 and all(s["duplicate_rows"] == 0 for s in stats)
        for rank, s in enumerate(stats):
            lo, hi = rank_row_range(rows, rank, 2)
            assert lo <= s["min_row"] and s["max_row"] < hi


@pytest.mark.spark
@pytest.mark.stack  # TorchDistributor and the arrow reader are pyspark's and pyarrow's
def test_two_torch_ranks_train_with_equal_steps(uneven_torch_run, uneven_dataset):
    _assert_equal_steps(uneven_torch_run, 2)
    losses = [m["train_loss"] for m in uneven_torch_run.metrics]
    assert losses[-1] < losses[0]
    assert uneven_torch_run.final["val_accuracy"] > uneven_torch_run.final["baseline_accuracy"]
    assert all(r["device"] == "cpu" for r in uneven_torch_run.ranks)
    # DDP waits for the allreduce inside backward; the wait after its last bucket started is
    # still measured (timing the no-op synchronize summed to 0.0 here).
    assert all(0 < m["allreduce_wait_seconds"] < m["seconds"] for m in uneven_torch_run.metrics)
    # The published model predicts on raw rows what rank 0 predicted at the end.
    model = load_model(uneven_torch_run.model_uri)
    probs = model.predict(uneven_dataset.raw["val"].iloc[uneven_torch_run.reference["rows"]])
    np.testing.assert_allclose(probs, np.array(uneven_torch_run.reference["predictions"]), rtol=1e-5, atol=1e-6)


# One epoch of plain SGD over a shuffle buffer larger than a rank's rows (so the rows' order is one
# permutation of them, whatever the batch size): a DDP run, the same with gradient accumulation, and
# FSDP, which the two tests below compare. What they compare is the strategies' arithmetic in the rank
# loop, not the launch (TorchDistributor's is test_two_torch_ranks_train_with_equal_steps'), so the
# three runs go through the rank loop one after another on the session's 2 Gloo ranks (torch_ranks.RankPool).
ONE_SGD_EPOCH = ("data.shuffle_buffer_rows=4096", "train.epochs=1", "train.optimizer=sgd", "data.reader=arrow")
SGD_RUNS = {"ddp": (), "accum": ("train.batch_size=16", "train.grad_accum=2"), "fsdp": ("train.parallel=fsdp",)}


@pytest.fixture(scope="module")
def sgd_epochs(two_ranks, uneven_dataset, tmp_path_factory) -> dict:
    """Per run of SGD_RUNS: its plan and its ranks' outcomes (read with ``_rank_loop_result``)."""
    from pipeline_ranks import train_rank
    from training.plan import build_plan

    plans = {name: build_plan(_cfg(uneven_dataset, tmp_path_factory.mktemp(f"sgd-{name}"), *ONE_SGD_EPOCH, *extra))
             for name, extra in SGD_RUNS.items()}
    outcomes = two_ranks.run_calls([(train_rank, (plan,)) for plan in plans.values()])
    return {name: (plan, outcome) for (name, plan), outcome in zip(plans.items(), outcomes)}


def _rank_loop_result(run):
    """A run of the rank loop as ``train()`` reports it (training.api's own assembly of the ranks'
    records); fails with every failed rank's traceback."""
    from training.api import _result

    plan, outcome = run
    return _result(plan, values(outcome), 0.0)


def test_gradient_accumulation_equals_the_larger_batch(sgd_epochs):
    # 2 micro-batches of 16 with no_sync on the first == one batch of 32 (the DDP run) on the same
    # rows: the shuffle buffer makes one permutation of a rank's rows, cut into 16s or 32s.
    # Only the order of float sums differs (hence a tolerance, not equality).
    accum, whole = _rank_loop_result(sgd_epochs["accum"]), _rank_loop_result(sgd_epochs["ddp"])
    assert accum.steps_per_rank == whole.steps_per_rank
    wa, wb = _weights(accum), _weights(whole)
    for name in wa:
        np.testing.assert_allclose(wa[name], wb[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.spark
@pytest.mark.stack  # the rank's traceback comes out of pyspark's barrier-task error
@pytest.mark.parametrize("backend", ["torch", "torch_tasks"])
def test_a_failing_torch_rank_reports_its_own_traceback(spark, uneven_dataset, tmp_path, backend):
    cfg = _cfg(uneven_dataset, tmp_path, "model.name=plugin_models:failing", "model.kwargs.fail_rank=1",
               "model.kwargs.fail_after=3", "train.epochs=1", backend=backend)
    with pytest.raises(RankFailedError) as info:
        train(cfg, spark)
    message = str(info.value)
    assert message.startswith("training failed on rank 1: ValueError: plugin model exploded on purpose")
    assert "--- rank 1 traceback ---" in message and "plugin_models.py" in message
    assert info.value.exit_code == EXIT_RUNTIME
    if backend == "torch_tasks":
        # The failed rank's worker lives on and told rank 0 at once (torch_tasks shuts its group's
        # sockets): both workers ran a rank and are still there. Had rank 0 waited on rank 1's open
        # connections, it would have failed only when Spark stopped rank 1's idle worker (a minute),
        # and the job below would find a fresh worker without torch.
        from spark_workers import python_workers

        assert python_workers(spark) == [(True, "")] * 2


@pytest.fixture(scope="module")
def horovod_run(spark, uneven_dataset, tmp_path_factory):
    pytest.importorskip("horovod.torch")
    return train(_cfg(uneven_dataset, tmp_path_factory.mktemp("hvd-run"), "train.epochs=2", backend="horovod"), spark)


@pytest.mark.spark
@pytest.mark.horovod
def test_horovod_and_torch_train_identically(horovod_run, uneven_torch_run):
    # Same seed, same data: the same weights, losses and validation accuracy on both backends.
    _assert_identical(horovod_run, uneven_torch_run)
    assert horovod_run.final["val_accuracy"] == uneven_torch_run.final["val_accuracy"]


@pytest.mark.spark
@pytest.mark.horovod
@pytest.mark.timeout(900)
@pytest.mark.parametrize("first,second", [("horovod", "torch"), ("torch", "horovod")])
def test_a_checkpoint_resumes_on_the_other_backend(spark, two_ranks, uneven_dataset, tmp_path, horovod_run,
                                                  uneven_torch_run, first, second):
    # One backend wrote the epoch-1 checkpoint (in its uninterrupted run above: what a run of that
    # one epoch writes, see resume_from.py), the other resumes it: the weights of a run never
    # interrupted (both backends' uninterrupted runs are identical, test above). Horovod's ranks are
    # launched on Spark; torch's go through the rank loop on a torch group without Spark, as in
    # sgd_epochs (what resumes is the loop's and the strategy's; TorchDistributor's launch is
    # tested above), on the session's two ranks.
    written = {"horovod": horovod_run, "torch": uneven_torch_run}[first]
    assert written.steps_per_rank == [2 * written.steps_per_epoch] * 2
    copy_checkpoint(written.run_dir, written.steps_per_epoch, tmp_path / "ck")
    cfg = _cfg(uneven_dataset, tmp_path / "second", "train.epochs=2", f"checkpoint.path={tmp_path}/ck", backend=second)
    if second == "torch":
        from pipeline_ranks import train_rank
        from training.plan import build_plan

        plan = build_plan(cfg)
        resumed = _rank_loop_result((plan, two_ranks.run_calls([(train_rank, (plan,))])[0]))
    else:
        resumed = train(cfg, spark)
    assert resumed.resumed_from and resumed.resumed_from.startswith(f"{tmp_path}/ck")
    assert all(r["resumed_step"] == written.steps_per_epoch for r in resumed.ranks)
    _assert_identical(resumed, horovod_run)


def _last_checkpoint(result):
    import glob

    import torch

    newest = sorted(glob.glob(os.path.join(result.run_dir, "checkpoints", "step-*", "state.pt")))[-1]
    return torch.load(newest, map_location="cpu", weights_only=False)


def test_fsdp_trains_like_ddp_and_saves_the_same_formats(sgd_epochs):
    # SGD: a fresh optimizer's zero-gradient first step (see TorchGroup.broadcast_model) leaves
    # its state as if untouched, so only sharded vs whole-tensor float sums differ.
    ddp, fsdp = _rank_loop_result(sgd_epochs["ddp"]), _rank_loop_result(sgd_epochs["fsdp"])
    _assert_equal_steps(fsdp, 1)
    assert abs(fsdp.final["train_loss"] - ddp.final["train_loss"]) < 1e-4
    # The wait after the step's last gradient reduce-scatter started is measured, as DDP's is.
    assert all(0 < m["allreduce_wait_seconds"] < m["seconds"] for m in fsdp.metrics)
    wd, wf = _weights(ddp), _weights(fsdp)
    assert wd.keys() == wf.keys()
    for name in wd:
        np.testing.assert_allclose(wf[name], wd[name], rtol=1e-4, atol=1e-5, err_msg=name)
    # Full, unsharded state dicts in the checkpoint, in the format DDP (and Horovod) write.
    cd, cf = _last_checkpoint(ddp), _last_checkpoint(fsdp)
    assert {k: tuple(v.shape) for k, v in cf["model"].items()} == {k: tuple(v.shape) for k, v in cd["model"].items()}
    assert all(type(v).__name__ == "Tensor" for v in cf["model"].values())
    assert cf["optimizer"]["param_groups"][0]["params"] == cd["optimizer"]["param_groups"][0]["params"]
    assert cf["optimizer"]["state"].keys() == cd["optimizer"]["state"].keys()
