"""Transfer sets on real Spark (local[2]): ``shardtrain distill``'s loop with
``soft_targets.unlabeled: transfer`` over raw rows of which a third have no label. The teacher's
dataset quarantines them (``null_label``, as always); the student's keeps every one of them in its
train split, with the teacher's soft targets and its task's ``missing_label`` as its label, while val and
test hold the same labelled rows as the teacher's dataset. What a user relies on: the accounting
adds up (input = published + quarantined; transfer rows said separately), shards stay balanced,
the marker reaches a batch through both Parquet readers, the student trains, and the refusals:
``transfer`` without a teacher (exit 2 naming label.unlabeled) and a transfer dataset trained
without ``train.distill`` (exit 2 naming train.distill.alpha). The loss itself (a transfer row's
label term is exactly zero) is tested against its formula in tests/training/test_distill.py."""

from __future__ import annotations

import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.dataset import read_manifest
from common.errors import EXIT_USAGE, ConfigError, DatasetError
from shardtrain.cli import main as shardtrain

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # distill_transforms, named by a shard config

# The tests of the shard job and of both Parquet readers are marked stack (each stack's pyarrow/pyspark):
# the current profile runs them too.
pytestmark = pytest.mark.spark

ROWS = 1500


def _shard_section(raw, out):
    return {"sources": {"raw": {"path": raw, "format": "parquet"}},
            "transform": "distill_transforms:unlabel_every_third",
            "features": {"numeric": ["x0", "x1", "x2", "x3"], "categorical": ["c0", "c1"]},
            "label": {"column": "label", "task": "classification", "num_classes": 2},
            "split": {"key": "id", "fractions": {"train": 0.8, "val": 0.1, "test": 0.1}},
            "quality": {"max_bad_fraction": 0.5},  # the teacher's dataset quarantines the unlabelled third
            "output": {"path": out, "num_shards": 3}}


def _train_section(model_path, hidden, **train):
    return {"model": {"hidden": hidden}, "launch": {"mode": "in_process", "num_proc": 1},
            "train": {"epochs": 1, "batch_size": 64, "lr": 0.005, **train},
            "data": {"shuffle_buffer_rows": 512}, "checkpoint": {"resume": "never"},
            "output": {"model_path": model_path}}


@pytest.fixture(scope="module")
def loop(spark, tmp_path_factory):
    from common.config import from_dict
    from pipelines.generate import generate_dataset
    from shardtrain.distill import DistillRunConfig, distill

    root = tmp_path_factory.mktemp("transfer")
    raw = str(root / "raw")
    generate_dataset(spark, raw, ROWS, seed=11, partitions=2, null_fraction=0.0)
    cfg = from_dict(DistillRunConfig, {
        "shard": _shard_section(raw, str(root / "shards")),
        "teacher": _train_section(str(root / "teacher"), [32]),
        "soft_targets": {"path": str(root / "shards-transfer"), "temperature": 2.0, "unlabeled": "transfer"},
        "student": _train_section(str(root / "student"), [8], distill={"alpha": 0.5}),
    })
    result = distill(cfg, spark=spark)
    return {"root": root, "cfg": cfg, "result": result, "plain": read_manifest(str(root / "shards")),
            "transfer": read_manifest(str(root / "shards-transfer"))}


def _split_table(manifest, split):
    return pa.concat_tables([pq.read_table(os.path.join(manifest.root.path, f.path)) for f in manifest.files(split)])


def _decoded(manifest, table, name):
    stats = next(f for f in manifest.features.by_kind()["numeric"] if f["name"] == name)
    return table.column(name).to_numpy().astype(np.float64) * stats["std"] + stats["mean"]


UNLABELLED = len([i for i in range(ROWS) if i % 3 == 0])
INVALID = len([i for i in range(ROWS) if i % 3 and i % 97 == 1])


@pytest.mark.stack  # the shard job's splits and Parquet on each stack
def test_every_unlabelled_row_is_in_train_and_only_there(loop):
    """All 500 rows without a label, whatever split their key hashes to, are train rows of the
    transfer dataset, stored with label -1 and the teacher's soft targets; val and test are the
    teacher dataset's labelled rows, row for row."""
    plain, transfer = loop["plain"], loop["transfer"]
    assert plain.data["quarantine"]["by_reason"] == {"null_label": UNLABELLED, "invalid_label": INVALID}
    assert transfer.data["quarantine"]["by_reason"] == {"invalid_label": INVALID}
    assert transfer.label.transfer_rows == UNLABELLED and plain.label.transfer_rows == 0
    assert transfer.label.to_record()["unlabeled"] == "transfer"
    assert transfer.label.train_class_counts == plain.label.train_class_counts  # the labelled train rows
    train = _split_table(transfer, "train")
    labels = train.column("label").to_numpy()
    assert (labels == -1).sum() == UNLABELLED and set(np.unique(labels)) == {-1, 0, 1}
    assert transfer.rows("train") == plain.rows("train") + UNLABELLED
    soft = np.stack(train.column("teacher").to_pylist())
    np.testing.assert_allclose(soft[labels == -1].sum(axis=1), 1.0, atol=1e-6)
    # The feature statistics are fitted on all train rows, transfer rows included (they are the
    # student's inputs too), so the stored values differ; the rows, decoded, are the same.
    for split in ("val", "test"):
        ours, theirs = _split_table(transfer, split), _split_table(plain, split)
        assert (ours.column("label").to_numpy() >= 0).all()
        assert ours.column("label").equals(theirs.column("label")), split
        for name in ("x0", "x3"):
            decoded = [_decoded(m, t, name) for m, t in ((transfer, ours), (plain, theirs))]
            np.testing.assert_allclose(*decoded, rtol=0, atol=1e-4)


@pytest.mark.stack  # the shard job's counts on each stack
def test_accounting_adds_up_and_shards_stay_balanced(loop):
    plain, transfer = loop["plain"], loop["transfer"]
    acc = transfer.data["accounting"]
    assert acc == {"input_rows": ROWS, "published_rows": ROWS - INVALID, "quarantined_rows": INVALID,
                   "transfer_rows": UNLABELLED}
    assert acc["published_rows"] == sum(transfer.rows(s) for s in transfer.split_names)
    assert plain.data["accounting"]["input_rows"] == ROWS and "transfer_rows" not in plain.data["accounting"]
    for split in transfer.split_names:
        sizes = [f.rows for f in transfer.files(split)]
        assert len(sizes) == 3 and max(sizes) - min(sizes) <= 1, (split, sizes)

    from pipelines.describe import describe_dataset

    text = describe_dataset(transfer.root.uri)
    assert f"transfer {UNLABELLED:,} of the published train rows have no label" in text


@pytest.mark.stack  # each stack's pyarrow under the readers
@pytest.mark.parametrize("reader", ["petastorm", "arrow"])
def test_both_readers_carry_the_missing_label_marker(loop, reader):
    """Every train row through a rank loader, each reader: the batch's label is the stored one,
    -1 on exactly the transfer rows, with their soft targets."""
    if reader == "petastorm":
        pytest.importorskip("petastorm")
    import torch

    from training.columns import columns_for
    from training.data import RankLoader
    from training.split_layout import SplitLayout

    manifest = loop["transfer"]
    stored = _split_table(manifest, "train").column("label").to_numpy()
    loader = RankLoader(SplitLayout.from_manifest(manifest, "train"), columns_for(manifest, teacher=True), 0, 1, 64,
                        shuffle=False, reader=reader)
    batches = list(loader.every_row())
    rows = torch.cat([b["_row"] for b in batches]).numpy()
    labels = torch.cat([b["label"] for b in batches]).numpy()
    assert sorted(rows) == list(range(manifest.rows("train")))
    np.testing.assert_array_equal(labels, stored[rows])
    assert (labels == -1).sum() == UNLABELLED
    assert all(b["label"].dtype == torch.int64 and b["teacher"].shape[1] == 2 for b in batches)


def test_the_student_trained_on_the_transfer_set(loop):
    student = loop["result"].student.train
    assert student.metrics and all(np.isfinite(m["train_loss"]) for m in student.metrics)
    assert all(0.0 <= m["val_accuracy"] <= 1.0 for m in student.metrics)
    import json

    meta = json.load(open(os.path.join(student.model_uri, "model.json")))
    assert meta["dataset"]["fingerprint"] == loop["transfer"].fingerprint


def test_training_a_transfer_set_without_distill_is_refused(loop, tmp_path):
    from train_configs import train_config
    from training import train

    for extra, says in (((), "train.distill is unset"), (("train.distill.alpha=0",), "train.distill.alpha is 0")):
        cfg = train_config(loop["transfer"].root.uri, str(tmp_path / "model"), "launch.mode=in_process", *extra)
        with pytest.raises(DatasetError, match=f"'label.train_transfer_rows' is {UNLABELLED}.*{says}; set "
                                               r"train.distill.alpha") as info:
            train(cfg)
        assert info.value.exit_code == EXIT_USAGE
    assert not os.path.exists(tmp_path / "model")


def test_transfer_without_a_teacher_is_refused(loop, tmp_path, capsys):
    """In a config (exit 2, naming label.unlabeled and what to set), and from the command line
    (``main(argv)`` in this process: test_cli runs the console script's exit status) before
    anything is read or written."""
    from common.config import to_dict
    from pipelines.shard_config import load_shard_config

    data = to_dict(loop["cfg"].shard)
    data["output"]["path"] = str(tmp_path / "out")
    with pytest.raises(ConfigError, match=r"label.unlabeled is transfer, but no teacher is set.*Set teacher.model "
                                          r".* or label.unlabeled=quarantine") as info:
        load_shard_config(None, ["label.unlabeled=transfer"], data)
    assert info.value.exit_code == EXIT_USAGE
    config = tmp_path / "shard.yaml"
    from common.config import dump_yaml, from_dict
    from pipelines.shard_config import ShardConfig

    config.write_text(dump_yaml(from_dict(ShardConfig, data)))
    code = shardtrain(["shard", "--config", str(config), "label.unlabeled=transfer"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert "label.unlabeled is transfer, but no teacher is set" in err
    assert not os.path.exists(tmp_path / "out")
    # shardtrain distill: the teacher's dataset has no teacher; soft_targets.unlabeled is the key
    with pytest.raises(ConfigError, match=r"label.unlabeled is transfer, but no teacher is set.*"
                                          r"soft_targets.unlabeled=transfer"):
        from shardtrain.distill import DistillRunConfig

        bad = to_dict(loop["cfg"])
        bad["shard"]["label"]["unlabeled"] = "transfer"
        from_dict(DistillRunConfig, bad)


def test_the_shard_command_says_the_transfer_rows_and_rewrites_the_same_bytes(loop, tmp_path, capsys):
    """`shardtrain shard` on the student's shard config (another output path; the command in this
    process, on the shared session) over the same rows in 150 Spark partitions of about 10 rows
    instead of 2 of 750: its summary line names the transfer rows, and the dataset is the
    fixture's, byte for byte. Batches that small give other last bits than large ones (measured
    with torch on CPU), so a scorer run on the input partitions as they come would store other
    soft targets: the rows are scored in an arrangement that depends on the rows alone."""
    from common.config import dump_yaml

    cfg = loop["cfg"].student_shard()
    cfg.transform = "distill_transforms:unlabel_every_third_in_tiny_partitions"
    cfg.output.path = str(tmp_path / "again")
    config = tmp_path / "shard.yaml"
    config.write_text(dump_yaml(cfg))
    code = shardtrain(["shard", "--config", str(config)])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    assert f"quarantined {INVALID:,}; transfer {UNLABELLED:,} (train rows without a label)" in out.out
    again, transfer = read_manifest(str(tmp_path / "again")), loop["transfer"]
    for split in transfer.split_names:
        assert [f.sha256 for f in again.files(split)] == [f.sha256 for f in transfer.files(split)], split
    assert again.fingerprint == transfer.fingerprint
