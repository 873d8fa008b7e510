"""Integrity end to end: a shard file or model file whose bytes changed after it was written is
refused, naming the file, with exit status 2; manifests cannot point outside their dataset; an
edit to model.json cannot change which program loads. Real shard files from the real shard job
(local Spark), real training (in process), real byte flips, each proven before the outcome."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

from common.dataset import MANIFEST_NAME, read_manifest, validate_manifest
from common.dataset_files import verify_dataset
from common.errors import DatasetError
from shardtrain.cli import main
from train_configs import train_overrides

# Not stack: the checks are sha256s and file names, the same code on both profiles; what pyarrow itself
# says of a damaged file is tested in tests/training/test_arrow_reader.py, which both profiles run.
pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def published(generated_dataset):
    """The session's generated dataset (tests/conftest.py): 3 shard files per split and a quarantine,
    from the real shard job. Read only: every test that damages a file damages its own copy."""
    return generated_dataset[2].uri


@pytest.fixture
def dataset(published, tmp_path):
    """A private copy of the published dataset, free to damage."""
    return shutil.copytree(published, str(tmp_path / "ds"))


def _sha(path) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def _flip(path, count: int = 8, offset: int | None = None) -> None:
    """Invert ``count`` bytes in the middle of ``path``, and prove they changed."""
    before = open(path, "rb").read()
    at = len(before) // 2 if offset is None else offset
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(bytes(b ^ 0xFF for b in before[at:at + count]))
    after = open(path, "rb").read()
    assert len(after) == len(before) and sum(a != b for a, b in zip(before, after)) == count


def _train(dataset, out, capsys, *extra) -> tuple[int, str]:
    code = main(["train", "--config", "conf/train.yaml",
                 *train_overrides(dataset, out, "train.epochs=1", "train.batch_size=64", "model.hidden=[8]", *extra)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("reader", ["petastorm", "arrow"])
def test_flipped_bytes_in_a_shard_fail_training_naming_the_file(dataset, tmp_path, capsys, reader):
    if reader == "petastorm":
        pytest.importorskip("petastorm")
    shard = os.path.join(dataset, "train", "part-00001.parquet")
    _flip(shard)
    code, err = _train(dataset, tmp_path / "model", capsys, f"data.reader={reader}")
    assert code == 2
    assert f"{shard}: sha256" in err and "re-run the shard job" in err
    assert not (tmp_path / "model").exists()


def test_garbage_in_a_shard_fails_training_naming_the_file(dataset, tmp_path, capsys):
    shard = os.path.join(dataset, "train", "part-00000.parquet")
    garbage = os.urandom(64 * 1024)
    with open(shard, "wb") as fh:
        fh.write(garbage)
    assert open(shard, "rb").read() == garbage
    code, err = _train(dataset, tmp_path / "model", capsys)
    assert code == 2
    assert shard in err and "re-run the shard job" in err
    assert "Corrupt snappy" not in err


def test_garbage_without_the_checksum_check_is_still_named_by_the_arrow_reader(dataset, tmp_path, capsys):
    shard = os.path.join(dataset, "train", "part-00000.parquet")
    with open(shard, "wb") as fh:
        fh.write(b"not parquet" * 100)
    assert open(shard, "rb").read(11) == b"not parquet"
    code, err = _train(dataset, tmp_path / "model", capsys, "data.reader=arrow", "data.verify=never")
    assert code == 2
    assert f"{shard}: not a readable Parquet file" in err and "re-run the shard job" in err


def test_inspect_verify_checks_every_file(dataset, capsys):
    assert main(["inspect", "--verify", dataset]) == 0
    manifest = read_manifest(dataset)
    files = sum(manifest.num_shards(s) for s in manifest.split_names) + len(manifest.data["quarantine"]["files"])
    assert f"all {files} files match" in capsys.readouterr().out
    damaged = os.path.join(dataset, "val", "part-00000.parquet")
    _flip(damaged)
    assert main(["inspect", "--verify", dataset]) == 2
    captured = capsys.readouterr()
    assert f"1 of {files} files do NOT match" in captured.out and damaged in captured.out
    assert "re-run the shard job" in captured.err
    assert verify_dataset(read_manifest(dataset)) and len(verify_dataset(read_manifest(dataset))) == 1


@pytest.mark.parametrize("path", ["../other_ds/train/part-00001.parquet", "/etc/passwd", "train/../../x.parquet",
                                  "s3://bucket/x.parquet"])
def test_manifest_paths_must_stay_inside_the_dataset(dataset, path):
    manifest_path = os.path.join(dataset, MANIFEST_NAME)
    data = json.load(open(manifest_path))
    data["splits"]["train"]["files"][1]["path"] = path
    with pytest.raises(DatasetError, match=r"field 'splits.train.files\[1\].path'"):
        validate_manifest(data, "m")
    with open(manifest_path, "w") as fh:
        json.dump(data, fh)
    with pytest.raises(DatasetError, match=r"splits.train.files\[1\].path"):
        read_manifest(dataset)


# --- the model --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(published, tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "model"
    code = main(["train", "--config", "conf/train.yaml",
                 *train_overrides(published, out, "train.epochs=1", "train.batch_size=64", "model.hidden=[8]")])
    assert code == 0
    return str(out)


@pytest.fixture
def model_copy(model, tmp_path):
    return shutil.copytree(model, str(tmp_path / "model"))


def test_model_json_records_every_file_and_load_verifies(model_copy):
    from training import load_model

    meta = json.load(open(os.path.join(model_copy, "model.json")))
    for name in ("model.safetensors", "model.torchscript.pt"):
        assert meta["files"][name]["sha256"] == _sha(os.path.join(model_copy, name))
    assert load_model(model_copy).predict_arrays  # intact: loads


@pytest.mark.parametrize("name, program", [("model.safetensors", False), ("model.torchscript.pt", True)])
def test_flipped_bytes_in_a_model_file_fail_load_naming_it(model_copy, name, program):
    from training import load_model

    _flip(os.path.join(model_copy, name))
    with pytest.raises(DatasetError, match=rf"{model_copy}/{name}: does not match the sha256") as err:
        load_model(model_copy, program=program)
    assert err.value.exit_code == 2


def test_a_damaged_safetensors_header_is_one_error_naming_the_file(model_copy):
    """Even when the recorded digests were rewritten to match, a broken header is a DatasetError
    naming model.safetensors, not a raw SafetensorError."""
    from training import load_model

    weights = os.path.join(model_copy, "model.safetensors")
    _flip(weights, offset=8)  # inside the JSON header
    meta_path = os.path.join(model_copy, "model.json")
    meta = json.load(open(meta_path))
    meta["files"]["model.safetensors"]["sha256"] = _sha(weights)
    _rewrite_meta(model_copy, meta)
    with pytest.raises(DatasetError, match=rf"{model_copy}/model.safetensors: cannot be loaded") as err:
        load_model(model_copy)
    assert "SafetensorError" in str(err.value) and "\n" not in str(err.value)


def _rewrite_meta(model_dir: str, meta: dict) -> None:
    """Rewrite model.json and re-record its digest in the marker (what a deliberate edit would need)."""
    text = json.dumps(meta, indent=2, sort_keys=True)
    with open(os.path.join(model_dir, "model.json"), "w") as fh:
        fh.write(text)
    marker_path = os.path.join(model_dir, "_COMMITTED")
    marker = json.load(open(marker_path))
    marker["model_json_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    with open(marker_path, "w") as fh:
        json.dump(marker, fh)


def test_editing_model_json_cannot_switch_the_program(model_copy):
    from training import load_model

    meta_path = os.path.join(model_copy, "model.json")
    meta = json.load(open(meta_path))
    meta["model"]["arguments"] = None
    with open(meta_path, "w") as fh:
        json.dump(meta, fh)
    # A plain edit: model.json no longer matches the digest the marker recorded.
    with pytest.raises(DatasetError, match=rf"{model_copy}/model.json: does not match the sha256"):
        load_model(model_copy)
    # Even an edit that also rewrites the digest cannot make the built-in load run TorchScript.
    _rewrite_meta(model_copy, meta)
    with pytest.raises(DatasetError, match=r"field 'model.arguments' is None"):
        load_model(model_copy)
    assert isinstance(load_model(model_copy, program=True).module, torch.jit.ScriptModule)


@pytest.mark.horovod
@pytest.mark.timeout(400)
def test_a_damaged_shard_on_one_horovod_rank_keeps_exit_status_2(spark, dataset, tmp_path):
    """Rank 1 of 2 alone reads train/part-00002 (ranks own halves of the rows, so of 3 files the middle
    one is both ranks'); its DatasetError must come back through horovod.spark.run as the job's error,
    with the dataset-contract exit status 2."""
    from common.errors import RankFailedError
    from train_configs import train_config
    from training import train

    shard = os.path.join(dataset, "train", "part-00002.parquet")
    assert read_manifest(dataset).num_shards("train") == 3
    _flip(shard)
    cfg = train_config(dataset, tmp_path / "model", "launch.start_timeout=90", "train.epochs=1", "train.batch_size=64",
                       "model.hidden=[8]", ranks=2)
    with pytest.raises(RankFailedError) as err:
        train(cfg, spark)
    assert err.value.exit_code == 2
    assert "training failed on rank 1: DatasetError" in str(err.value) and f"{shard}: sha256" in str(err.value)
    assert not (tmp_path / "model").exists()
