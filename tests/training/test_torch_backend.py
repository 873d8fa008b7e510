"""launch.backend=torch: real torch.distributed ranks (Gloo, CPU) started by pyspark's
TorchDistributor as barrier tasks on a real local[2] session, running the same loop as Horovod.

The two backends do the same arithmetic (DDP averages by dividing by the world size before the
sum, Horovod after: both exact for 2 ranks; the torch group gives a fresh optimizer its state the
way Horovod's broadcast does), so with fp32 on CPU and the same seed they train to bit-identical
weights, and a checkpoint written by one resumes on the other to the weights of an uninterrupted
run. The Horovod half skips where Horovod is not installed (the current-stack profile)."""

import os

import numpy as np
import pytest

from common.errors import EXIT_RUNTIME, RankFailedError
from resume_from import copy_checkpoint
from tabular_data import write_dataset
from train_configs import train_config
from training import load_model, train
from training.data import rank_row_range

HERE = os.path.dirname(os.path.abspath(__file__))
UNEVEN = {"train": [[700, 301], [13], [900, 111, 2], [0], [455]], "val": [[190], [77]]}

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600), pytest.mark.ranks]


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("torch") / "ds"), UNEVEN)


def _cfg(ds, out, *extra, backend="torch"):
    return train_config(ds, f"{out}/model", "launch.start_timeout=120", f"launch.env.PYTHONPATH={HERE}",
                        "train.batch_size=32", "train.lr=0.005", "train.log_every_steps=10",
                        "data.shuffle_buffer_rows=200", "model.hidden=[32]", f"launch.backend={backend}", *extra, ranks=2)


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


@pytest.fixture(scope="module")
def torch_run(spark, uneven, tmp_path_factory):
    out = tmp_path_factory.mktemp("torch-run")
    return train(_cfg(uneven, out, "train.epochs=2", "data.reader=arrow"), spark)


@pytest.mark.stack  # TorchDistributor and the arrow reader are pyspark's and pyarrow's
def test_two_torch_ranks_train_with_equal_steps(torch_run, uneven):
    _assert_equal_steps(torch_run, 2)
    losses = [m["train_loss"] for m in torch_run.metrics]
    assert losses[-1] < losses[0]
    assert torch_run.final["val_accuracy"] > torch_run.final["baseline_accuracy"]
    assert all(r["device"] == "cpu" for r in torch_run.ranks)
    # DDP waits for the allreduce inside backward; the wait after its last bucket started is
    # still measured (timing the no-op synchronize summed to 0.0 here).
    assert all(0 < m["allreduce_wait_seconds"] < m["seconds"] for m in torch_run.metrics)
    # The published model predicts on raw rows what rank 0 predicted at the end.
    model = load_model(torch_run.model_uri)
    probs = model.predict(uneven.raw["val"].iloc[torch_run.reference["rows"]])
    np.testing.assert_allclose(probs, np.array(torch_run.reference["predictions"]), rtol=1e-5, atol=1e-6)


# One epoch of plain SGD over a shuffle buffer larger than a rank's rows (so the rows' order is one
# permutation of them, whatever the batch size): the DDP run that gradient accumulation and FSDP are
# both compared with, launched once for the two tests.
ONE_SGD_EPOCH = ("data.shuffle_buffer_rows=4096", "train.epochs=1", "train.optimizer=sgd", "data.reader=arrow")


@pytest.fixture(scope="module")
def ddp_sgd_epoch(spark, uneven, tmp_path_factory):
    return train(_cfg(uneven, tmp_path_factory.mktemp("ddp-sgd"), *ONE_SGD_EPOCH), spark)


def test_gradient_accumulation_equals_the_larger_batch(spark, uneven, tmp_path, ddp_sgd_epoch):
    # 2 micro-batches of 16 with no_sync on the first == one batch of 32 (ddp_sgd_epoch) on the same
    # rows: the shuffle buffer makes one permutation of a rank's rows, cut into 16s or 32s.
    # Only the order of float sums differs (hence a tolerance, not equality).
    accum = train(_cfg(uneven, tmp_path / "a", "train.batch_size=16", "train.grad_accum=2", *ONE_SGD_EPOCH), spark)
    whole = ddp_sgd_epoch
    assert accum.steps_per_rank == whole.steps_per_rank
    wa, wb = _weights(accum), _weights(whole)
    for name in wa:
        np.testing.assert_allclose(wa[name], wb[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.stack  # the rank's traceback comes out of pyspark's barrier-task error
def test_a_failing_torch_rank_reports_its_own_traceback(spark, uneven, tmp_path):
    cfg = _cfg(uneven, tmp_path, "model.name=plugin_models:failing", "model.kwargs.fail_rank=1",
               "model.kwargs.fail_after=3", "train.epochs=1")
    with pytest.raises(RankFailedError) as info:
        train(cfg, spark)
    message = str(info.value)
    assert message.startswith("training failed on rank 1: ValueError: plugin model exploded on purpose")
    assert "--- rank 1 traceback ---" in message and "plugin_models.py" in message
    assert info.value.exit_code == EXIT_RUNTIME


@pytest.fixture(scope="module")
def horovod_run(spark, uneven, tmp_path_factory):
    pytest.importorskip("horovod.torch")
    return train(_cfg(uneven, tmp_path_factory.mktemp("hvd-run"), "train.epochs=2", backend="horovod"), spark)


@pytest.mark.horovod
def test_horovod_and_torch_train_identically(horovod_run, torch_run):
    # Same seed, same data: the same weights, losses and validation accuracy on both backends.
    _assert_identical(horovod_run, torch_run)
    assert horovod_run.final["val_accuracy"] == torch_run.final["val_accuracy"]


@pytest.mark.horovod
@pytest.mark.timeout(900)
@pytest.mark.parametrize("first,second", [("horovod", "torch"), ("torch", "horovod")])
def test_a_checkpoint_resumes_on_the_other_backend(spark, uneven, tmp_path, horovod_run, torch_run, first, second):
    # One backend wrote the epoch-1 checkpoint (in its uninterrupted run above: what a run of that
    # one epoch writes, see resume_from.py), the other resumes it: the weights of a run never
    # interrupted (both backends' uninterrupted runs are identical, test above).
    written = {"horovod": horovod_run, "torch": torch_run}[first]
    assert written.steps_per_rank == [2 * written.steps_per_epoch] * 2
    copy_checkpoint(written.run_dir, written.steps_per_epoch, tmp_path / "ck")
    resumed = train(_cfg(uneven, tmp_path / "second", "train.epochs=2", f"checkpoint.path={tmp_path}/ck",
                         backend=second), spark)
    assert resumed.resumed_from and resumed.resumed_from.startswith(f"{tmp_path}/ck")
    assert all(r["resumed_step"] == written.steps_per_epoch for r in resumed.ranks)
    _assert_identical(resumed, horovod_run)


def _last_checkpoint(result):
    import glob

    import torch

    newest = sorted(glob.glob(os.path.join(result.run_dir, "checkpoints", "step-*", "state.pt")))[-1]
    return torch.load(newest, map_location="cpu", weights_only=False)


def test_fsdp_trains_like_ddp_and_saves_the_same_formats(spark, uneven, tmp_path, ddp_sgd_epoch):
    # SGD: a fresh optimizer's zero-gradient first step (see TorchGroup.broadcast_model) leaves
    # its state as if untouched, so only sharded vs whole-tensor float sums differ.
    ddp = ddp_sgd_epoch
    fsdp = train(_cfg(uneven, tmp_path / "fsdp", "train.parallel=fsdp", *ONE_SGD_EPOCH), spark)
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
