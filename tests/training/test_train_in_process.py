"""The whole training path in one process (launch.mode=in_process: the same loop, world size 1,
no Spark or Horovod): resume equivalence, corrupt-checkpoint fallback, load_model round trip,
non-finite loss, regression, and the driver refusing bad datasets before launching anything."""

import json
import os

import numpy as np
import pytest
import torch

from common.errors import EXIT_USAGE, ConfigError, DatasetError, OutputExistsError
from tabular_data import write_dataset
from training import load_model, load_train_config, train
from common.errors import NonFiniteLossError

LAYOUT = {"train": [[400, 150], [300], [190]], "val": [[120], [80]]}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("ip") / "ds"), LAYOUT)


def _cfg(ds_uri, out, *extra):
    return load_train_config(None, [
        f"data.path={ds_uri}", "launch.mode=in_process", "launch.num_proc=1", f"output.model_path={out}/model",
        "train.epochs=3", "train.batch_size=32", "train.lr=0.01", "train.log_every_steps=5", "data.shuffle_buffer_rows=100",
        "model.hidden=[16]", "model.dropout=0.1", *extra])


class Preempted(Exception):
    pass


def _params(uri):
    from safetensors.torch import load_file

    return load_file(os.path.join(uri, "model.safetensors"))


def test_interrupted_and_resumed_equals_uninterrupted(dataset, tmp_path):
    """fp32, CPU, same seed; a crash mid-epoch (step 13 of 32/epoch), checkpoints every 5 steps.
    The newest checkpoint (step 10) is then corrupted, so the resume also proves the fallback to step 5."""
    straight = train(_cfg(dataset.uri, tmp_path / "a", "checkpoint.every_steps=5"))

    def crash(step):
        if step == 13:
            raise Preempted()

    broken = _cfg(dataset.uri, tmp_path / "b", "checkpoint.every_steps=5", "checkpoint.keep=3")
    with pytest.raises(Preempted):
        train(broken, on_step=crash)
    ckpt = tmp_path / "b/model.run/checkpoints"
    assert sorted(os.listdir(ckpt)) == ["step-000000005", "step-000000010"]
    with open(ckpt / "step-000000010/state.pt", "r+b") as fh:
        fh.seek(100)
        fh.write(b"\0" * 16)
    resumed = train(broken)
    assert resumed.resumed_from.endswith("step-000000005")
    assert any("step-000000010" in p and "corrupt" in p for p in resumed.checkpoint_problems)
    a, b = _params(straight.model_uri), _params(resumed.model_uri)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bit-identical: the order is a function of the seed
    assert [m["train_loss"] for m in straight.metrics] == pytest.approx([m["train_loss"] for m in resumed.metrics])


def test_model_round_trip_and_run_files(dataset, tmp_path):
    result = train(_cfg(dataset.uri, tmp_path, "train.precision=bf16"))
    assert result.final["val_accuracy"] > result.final["baseline_accuracy"]
    rows = result.reference["rows"]
    raw = dataset.raw["val"].iloc[rows]
    for program in (False, True):  # rebuilt from safetensors, and the TorchScript program
        model = load_model(result.model_uri, program=program)
        probs = model.predict(raw)
        np.testing.assert_allclose(probs, np.array(result.reference["predictions"]), rtol=1e-5, atol=1e-6)
        assert probs.shape == (len(rows), 2)
    meta = json.load(open(os.path.join(result.model_uri, "model.json")))
    assert meta["dataset"]["fingerprint"] == dataset.manifest["fingerprint"]
    assert meta["features"]["categorical"][0]["vocab"] and meta["versions"]["torch"] == torch.__version__
    assert len(meta["metrics"]) == 3 and meta["config"]["train"]["precision"] == "bf16"
    lines = open(os.path.join(result.run_dir, "metrics.jsonl")).read().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]
    for record in map(json.loads, lines):  # the step-time breakdown every epoch reports
        assert record["samples"] == 1 * (1040 // 32) * 32  # world size x steps x batch
        assert 0 <= record["data_wait_seconds"] <= record["seconds"]
        assert 0 <= record["allreduce_wait_seconds"] <= record["seconds"]
    with pytest.raises(OutputExistsError):  # output.mode=error refuses before training
        train(_cfg(dataset.uri, tmp_path, "output.mode=error"))


def test_plugin_model_and_regression(tmp_path):
    ds = write_dataset(str(tmp_path / "reg"), {"train": [[600], [400]], "val": [[200]]}, task="regression")
    result = train(_cfg(ds.uri, tmp_path, "model.name=plugin_models:tiny", "model.kwargs.width=8",
                        "train.epochs=4", "train.precision=fp16"))
    assert result.final["val_mae"] < result.final["baseline_mae"]
    model = load_model(result.model_uri, program=True)  # plug-in: served from the TorchScript program
    values = model.predict(ds.raw["val"].iloc[result.reference["rows"]])
    np.testing.assert_allclose(values, np.array(result.reference["predictions"]), rtol=1e-5, atol=1e-5)


def test_non_finite_loss_names_step_and_rank(dataset, tmp_path):
    cfg = _cfg(dataset.uri, tmp_path, "model.name=plugin_models:poisoned", "model.kwargs.nan_after=7",
               "train.log_every_steps=3")
    with pytest.raises(NonFiniteLossError, match="optimizer step 8 on rank 0"):
        train(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_asking_for_cuda_without_cuda_is_refused_not_silently_cpu(dataset, tmp_path):
    with pytest.raises(ConfigError, match="launch.device=cuda but CUDA is not available"):
        train(_cfg(dataset.uri, tmp_path, "launch.device=cuda"))


@pytest.mark.parametrize("change, field", [
    (lambda root, m: os.remove(os.path.join(root, "_COMMITTED")), "_COMMITTED"),
    (lambda root, m: m.update(format_version=99), "format_version"),
    (lambda root, m: m["label"].update(num_classes=1), "label.num_classes"),
    (lambda root, m: m.update(schema=[c for c in m["schema"] if c["name"] != "x2"]), "schema"),
])
def test_bad_datasets_are_refused_before_launch(tmp_path, change, field):
    ds = write_dataset(str(tmp_path / "bad"), {"train": [[100]], "val": [[50]]})
    manifest = dict(ds.manifest)
    change(ds.uri, manifest)
    with open(os.path.join(ds.uri, "_manifest.json"), "w") as fh:
        json.dump(manifest, fh)
    with pytest.raises(DatasetError, match=field.replace(".", r"\.")) as info:
        train(_cfg(ds.uri, tmp_path))
    assert info.value.exit_code == EXIT_USAGE


def test_model_config_must_match_the_manifest(dataset, tmp_path):
    with pytest.raises(DatasetError, match=r"label\.num_classes"):
        train(_cfg(dataset.uri, tmp_path, "model.num_classes=3"))
    with pytest.raises(DatasetError, match=r"'features' lacks \['age'\]"):
        train(_cfg(dataset.uri, tmp_path, "model.features=[x1, age]"))
    with pytest.raises(DatasetError, match=r"splits\.train\.files"):  # 3 shards, 4 ranks (checked before Spark)
        train(load_train_config(None, [f"data.path={dataset.uri}", "launch.num_proc=4"]))
    with pytest.raises(DatasetError, match=r"splits\.train\.rows"):
        train(_cfg(dataset.uri, tmp_path, "train.batch_size=2000"))
