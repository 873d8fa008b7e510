"""Image columns through the whole training path (real PNG and JPEG bytes in real Parquet shards,
tests/training/image_data.py): a row of a number and a photo trains with ft_transformer, resumes
from a checkpoint bit-identically with augmentation on, and the published model predicts on the raw
encoded bytes what rank 0 computed from the training-time preprocessing (rebuilt and TorchScript);
two Horovod ranks and two torch.distributed ranks train the MLP's image stem to the same weights
with augmentation on; ResNet-18 learns an image-only dataset on two FSDP ranks and on two pipeline
stages."""

from __future__ import annotations

import os

import numpy as np
import pytest

from image_data import write_image_dataset
from train_configs import train_config
from training import load_model, train

pytestmark = [pytest.mark.timeout(600)]

LAYOUT = {"train": [[96, 64], [96]], "val": [[48]]}
AUGMENT = ("data.augment.photo.flip=true", "data.augment.photo.random_resized_crop.scale=[0.6,1.0]",
           "data.augment.photo.color_jitter=0.1")
FT = ("model.name=ft_transformer", "model.layers=1", "model.d_model=8", "model.heads=2")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_image_dataset(str(tmp_path_factory.mktemp("image-train") / "ds"), LAYOUT, numeric=True)


def _cfg(ds, out, *extra, ranks=1):
    return train_config(ds, f"{out}/model", "train.epochs=2", "train.batch_size=16", "train.lr=0.01",
                        "data.shuffle_buffer_rows=64", "data.reader=arrow", "data.decode_workers=2", *AUGMENT, *extra,
                        ranks=ranks)


def _weights(uri) -> dict:
    from safetensors.numpy import load_file

    return load_file(os.path.join(uri, "model.safetensors"))


def _assert_same_weights(a: str, b: str):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)


class Preempted(Exception):
    pass


def test_a_number_and_a_photo_train_with_ft_transformer_resume_exactly_and_serve_from_raw_bytes(dataset, tmp_path):
    straight = train(_cfg(dataset, tmp_path / "a", *FT, "checkpoint.every_steps=8"))
    assert straight.final["val_accuracy"] > straight.final["baseline_accuracy"]

    def crash(step):
        if step == 20:  # mid-epoch 2 (16 steps an epoch): the resume starts at step 16, augmenting again
            raise Preempted()

    broken = _cfg(dataset, tmp_path / "b", *FT, "checkpoint.every_steps=8")
    with pytest.raises(Preempted):
        train(broken, on_step=crash)
    resumed = train(broken)
    assert resumed.resumed_from.endswith("step-000000016")
    _assert_same_weights(straight.model_uri, resumed.model_uri)
    # The published model takes the raw encoded bytes (a pandas column of bytes) and decodes,
    # resizes and normalises them as the ranks did: the predictions rank 0 made at the end.
    rows = dataset.raw["val"].iloc[straight.reference["rows"]]
    assert isinstance(rows["photo"].iloc[0], bytes)
    for program in (False, True):
        probs = load_model(straight.model_uri, program=program).predict(rows)
        np.testing.assert_allclose(probs, np.array(straight.reference["predictions"]), rtol=1e-5, atol=1e-6)


@pytest.mark.spark
@pytest.mark.ranks
def test_horovod_and_torch_ranks_train_images_to_the_same_weights(spark, two_ranks, dataset, tmp_path):
    """The MLP with an image stem, augmentation on, 2 ranks each: Horovod on Spark, and the same rank
    loop on torch.distributed (the session's two Gloo ranks)."""
    pytest.importorskip("horovod.torch")
    from pipeline_ranks import train_rank
    from torch_ranks import values
    from training.plan import build_plan

    mlp = ("model.name=mlp", "model.hidden=[8]", "model.kwargs.image_width=4")
    hvd = train(_cfg(dataset, tmp_path / "hvd", *mlp, "launch.backend=horovod", ranks=2), spark)
    plan = build_plan(_cfg(dataset, tmp_path / "torch", *mlp, "launch.backend=torch", ranks=2))
    # On the same two ranks after it: ResNet-18 (width 4) on the photos alone, 2 epochs, sharded by
    # FSDP one residual stage a unit, and cut into 2 pipeline stages of whole residual stages (whose
    # BatchNorm statistics torch's shape inference on uninitialised tensors must not touch).
    photos = write_image_dataset(str(tmp_path / "photos"), LAYOUT)
    resnets = [build_plan(_cfg(photos, tmp_path / f"resnet-{i}", "model.name=resnet", "model.width=4",
                               "train.epochs=2", *layout, "launch.backend=torch", ranks=2))
               for i, layout in enumerate((["train.parallel=fsdp"],
                                           ["train.pipeline.stages=2", "train.pipeline.microbatches=2"]))]
    torch_run, *resnet_runs = two_ranks.run_calls([(train_rank, (p,)) for p in (plan, *resnets)])
    assert len({r["steps"] for r in values(torch_run)}) == 1
    _assert_same_weights(hvd.model_uri, plan.model_path)
    assert hvd.final["val_accuracy"] > hvd.final["baseline_accuracy"]
    for run in resnet_runs:
        metrics = values(run)[0]["metrics"]
        assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]
        assert metrics[-1]["val_accuracy"] > metrics[-1]["baseline_accuracy"]


@pytest.mark.spark
@pytest.mark.ranks
def test_a_sharded_folder_trains_on_two_ranks_in_bf16_and_predicts_raw_files_as_it_trained(image_dataset, two_ranks,
                                                                                          tmp_path):
    """The session's folder of PNGs and JPEGs sharded by the real shard job (``binaryFile``, class
    names from the path), ResNet-18 (width 4) on two torch ranks in bf16, then the published model on
    the raw files: each validation row's raw file gets the prediction rank 0 made from the stored
    bytes at the end of training."""
    import pyarrow as pa
    from pathlib import Path

    from common.images import decode_image
    from pipeline_ranks import train_rank
    from torch_ranks import values
    from training.plan import build_plan

    folder, expected, _, shards = image_dataset
    plan = build_plan(_cfg(shards.uri, tmp_path, "model.name=resnet", "model.width=4", "train.precision=bf16",
                           "train.epochs=1", "data.augment={}", "launch.backend=torch", ranks=2))
    rank_0 = values(two_ranks.run_calls([(train_rank, (plan,))])[0])[0]
    # Which raw file each stored row came from: its decoded pixels (png stores them exactly).
    files = {decode_image(Path(p).read_bytes(), (16, 16), 3).tobytes(): p for p, rule in expected.items() if rule is None}
    val = pa.concat_tables([pa.parquet.read_table(p) for p in sorted(Path(shards.uri, "val").glob("*.parquet"))])
    stored = dict(zip(val.column("_row").to_pylist(), val.column("content").to_pylist()))
    paths = [files[decode_image(stored[row], (16, 16), 3).tobytes()] for row in rank_0["reference"]["rows"]]
    raw = pa.table({"content": pa.array([Path(p).read_bytes() for p in paths], pa.binary())})
    out = load_model(plan.model_path).predict(raw)
    np.testing.assert_allclose(np.stack(list(out["probabilities"])), np.array(rank_0["reference"]["predictions"]),
                               rtol=1e-5, atol=1e-6)
    assert set(out["prediction"]) <= {"cat", "dog", "fox"}  # the class names the shard job fitted
