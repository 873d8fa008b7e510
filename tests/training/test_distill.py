"""Knowledge distillation on the training side (``train.distill``), without Spark: the loss against
its formula, ``alpha: 0`` identical to plain training through the whole loop, a teacher that
pulls the student its way, every precision and gradient accumulation, both readers carrying the
soft targets into the batch, and the refusals before launch (no soft targets, a teacher whose
features, classes or temperature do not fit). The soft-target column itself, written by a real
shard job, is tested in tests/shardtrain/test_distill_loop.py."""

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from common.dataset import LabelSpec, read_manifest
from common.errors import EXIT_USAGE, DatasetError
from plugin_models import Wrap
from tabular_data import write_dataset
from train_configs import train_config
from training import train
from training.columns import columns_for
from training.config import DistillConfig
from training.data import RankLoader
from training.distributed import LocalGroup
from training.split_layout import SplitLayout
from training.tasks import Objective, task_for
from training.strategies.single import SingleProcess
from training.precision import Precision

LAYOUT = {"train": [[300, 100], [240]], "val": [[90], [70]]}
CLASSES_2 = LabelSpec(name="label", task="classification", num_classes=2)

def loss_fn(output, label, spec, distill=None, teacher=None):
    """The training loss of one micro-batch, as the label's task computes it."""
    return task_for(spec).loss(output, label, spec, distill, teacher)


def train_step(model, micro_batches, optimizer, precision, clip_norm, distill=None):
    """One optimizer step of the one-process strategy, as the rank loop takes it."""
    strategy = SingleProcess(LocalGroup(), precision)
    return strategy.train_step(model, micro_batches, optimizer, Objective(CLASSES_2, distill), clip_norm)



@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("distill") / "ds"), LAYOUT, teacher={"temperature": 2.0})


def _cfg(ds_uri, out, *extra):
    return train_config(ds_uri, f"{out}/model", "train.epochs=2", "train.batch_size=32", "train.lr=0.01",
                        "data.shuffle_buffer_rows=100", "model.hidden=[16]", *extra)


def _params(uri):
    from safetensors.torch import load_file

    return load_file(os.path.join(uri, "model.safetensors"))


# --- the loss ------------------------------------------------------------------------------------

def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def test_classification_loss_is_the_hinton_mix():
    """alpha * T^2 * KL(teacher || softmax(z / T)) + (1 - alpha) * CE(z, label), against numpy in float64."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (8, 3))
    teacher = _softmax(rng.normal(0, 2, (8, 3)) / 3.0)
    teacher[0] = [0.0, 0.25, 0.75]  # a class the teacher rules out contributes 0 (0 log 0), not NaN
    label = rng.integers(0, 3, 8)
    alpha, temperature = 0.3, 3.0
    student = _softmax(logits / temperature)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(teacher > 0, teacher * (np.log(teacher) - np.log(student)), 0.0).sum(axis=1).mean()
    ce = -np.log(_softmax(logits)[np.arange(8), label]).mean()
    expected = alpha * temperature ** 2 * kl + (1 - alpha) * ce
    got = loss_fn(torch.tensor(logits, dtype=torch.float32), torch.tensor(label),
                  LabelSpec(name="label", task="classification", num_classes=3),
                  DistillConfig(alpha=alpha, temperature=temperature), torch.tensor(teacher, dtype=torch.float32))
    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(expected, rel=1e-5)


def test_regression_loss_uses_the_teachers_value_standardized_like_the_label():
    spec = LabelSpec(name="label", task="regression", train_mean=10.0, train_std=4.0)
    output = torch.tensor([0.5, -1.0, 2.0])
    label = torch.tensor([12.0, 6.0, 18.0])  # standardized: 0.5, -1, 2: the label term is 0
    teacher = torch.tensor([14.0, 10.0, 10.0])  # standardized: 1, 0, 0
    expected_soft = ((0.5 - 1) ** 2 + (-1.0 - 0) ** 2 + (2.0 - 0) ** 2) / 3
    got = loss_fn(output, label, spec, DistillConfig(alpha=0.25, temperature=1.0), teacher)
    assert float(got) == pytest.approx(0.25 * expected_soft)
    assert float(loss_fn(output, label, spec)) == 0.0


def test_alpha_zero_is_the_plain_loss_bit_for_bit():
    rng = np.random.default_rng(1)
    logits = torch.tensor(rng.normal(0, 2, (16, 4)), dtype=torch.float32)
    teacher = torch.tensor(_softmax(rng.normal(0, 2, (16, 4))), dtype=torch.float32)
    label = torch.tensor(rng.integers(0, 4, 16))
    spec = LabelSpec(name="label", task="classification", num_classes=4)
    plain = loss_fn(logits, label, spec)
    mixed = loss_fn(logits, label, spec, DistillConfig(alpha=0.0, temperature=4.0), teacher)
    assert torch.equal(plain, mixed)


# --- transfer rows: no label, the teacher term only ---------------------------------------------

def test_transfer_rows_add_exactly_zero_to_the_label_term():
    """A dataset with transfer rows (label -1): the loss is (1/B) sum_i [alpha T^2 KL_i + (1 - alpha)
    m_i CE_i], m_i = 0 for a transfer row, against numpy in float64; the transfer rows' logits get
    no gradient from the label term, and a batch of transfer rows alone has a label term of 0."""
    rng = np.random.default_rng(2)
    rows, classes = 10, 3
    logits = rng.normal(0, 2, (rows, classes))
    teacher = _softmax(rng.normal(0, 2, (rows, classes)) / 2.0)
    label = rng.integers(0, classes, rows)
    label[[1, 4, 5, 9]] = -1  # the classification task's missing_label
    labelled = label >= 0
    alpha, temperature = 0.4, 2.0
    spec = LabelSpec.from_record({"name": "label", "task": "classification", "num_classes": classes,
                                  "unlabeled": "transfer", "train_transfer_rows": 4})
    assert spec.transfer_rows == 4
    kl = (teacher * (np.log(teacher) - np.log(_softmax(logits / temperature)))).sum(axis=1)
    ce = np.where(labelled, -np.log(_softmax(logits)[np.arange(rows), np.where(labelled, label, 0)]), 0.0)
    expected = (alpha * temperature ** 2 * kl + (1 - alpha) * ce).sum() / rows
    z = torch.tensor(logits, dtype=torch.float32, requires_grad=True)
    got = loss_fn(z, torch.tensor(label), spec, DistillConfig(alpha=alpha, temperature=temperature),
                  torch.tensor(teacher, dtype=torch.float32))
    assert float(got.detach()) == pytest.approx(expected, rel=1e-5)

    hard_only = loss_fn(z, torch.tensor(label), spec, DistillConfig(alpha=0.0, temperature=temperature),
                        torch.tensor(teacher, dtype=torch.float32))
    assert float(hard_only.detach()) == pytest.approx(ce.sum() / rows, rel=1e-5)
    hard_only.backward()
    assert torch.count_nonzero(z.grad[~torch.tensor(labelled)]) == 0  # exactly zero, not small
    assert torch.count_nonzero(z.grad[torch.tensor(labelled)]) > 0
    none = torch.full((rows,), -1)
    assert float(loss_fn(z.detach(), none, spec, DistillConfig(alpha=0.0, temperature=1.0), torch.tensor(teacher))) == 0.0


def test_regression_transfer_rows_add_exactly_zero_to_the_label_term():
    spec = LabelSpec.from_record({"name": "label", "task": "regression", "train_mean": 10.0, "train_std": 4.0,
                                  "unlabeled": "transfer", "train_transfer_rows": 1})
    output = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    label = torch.tensor([14.0, float("nan"), 18.0])  # standardized: 1, (none), 2
    teacher = torch.tensor([14.0, 10.0, 10.0])  # standardized: 1, 0, 0
    soft = ((0.5 - 1) ** 2 + (-1.0 - 0) ** 2 + (2.0 - 0) ** 2) / 3
    hard = ((0.5 - 1) ** 2 + 0 + (2.0 - 2) ** 2) / 3
    got = loss_fn(output, label, spec, DistillConfig(alpha=0.25, temperature=1.0), teacher)
    assert float(got.detach()) == pytest.approx(0.25 * soft + 0.75 * hard)
    hard_only = loss_fn(output, label, spec, DistillConfig(alpha=0.0, temperature=1.0), teacher)
    hard_only.backward()
    assert torch.isfinite(hard_only.detach()) and float(output.grad[1]) == 0.0 and float(output.grad[0]) != 0.0


def _batch(seed=0, rows=64):
    """Labels follow x0 > 0; the teacher says the opposite: a student can only agree with one."""
    torch.manual_seed(seed)
    x = torch.randn(rows, 4)
    label = (x[:, 0] > 0).long()
    flipped = torch.nn.functional.one_hot(1 - label, 2).float() * 0.9 + 0.05
    return {"numeric": x, "label": label, "teacher": flipped}


def _student(seed=0):
    torch.manual_seed(seed)
    return Wrap(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))


def _agreement_with_labels(alpha, steps=60):
    model, batch = _student(), _batch()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    distill = DistillConfig(alpha=alpha, temperature=2.0)
    for _ in range(steps):
        train_step(model, [batch], opt, Precision("fp32", "cpu"), None, distill)
    with torch.no_grad():
        return float((model(batch).argmax(-1) == batch["label"]).float().mean())


def test_the_teacher_pulls_the_student_its_way():
    """Same student, same data, labels and teacher disagreeing on every row: alpha 0 learns the
    labels, alpha 1 learns the teacher, and alpha 0.9 leans to the teacher (its term dominates)."""
    assert _agreement_with_labels(0.0) > 0.9
    assert _agreement_with_labels(1.0) < 0.1
    assert _agreement_with_labels(0.9) < 0.5


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp16"])
def test_distill_step_in_every_precision_with_accumulation(kind):
    """Two micro-batches per step under autocast (and the fp16 GradScaler): the loss stays float32
    and finite, goes down, and the weights stay float32."""
    model, batch = _student(), _batch(rows=64)
    batch["teacher"] = torch.softmax(batch["numeric"][:, :2] * 2, dim=-1)  # a teacher the student can follow
    halves = [{k: v[:32] for k, v in batch.items()}, {k: v[32:] for k, v in batch.items()}]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    precision = Precision(kind, "cpu")
    distill = DistillConfig(alpha=0.7, temperature=2.0)
    losses = [train_step(model, halves, opt, precision, 1.0, distill)
              for _ in range(30)]
    assert all(loss.dtype == torch.float32 and torch.isfinite(loss) for loss in losses)
    assert float(losses[-1]) < float(losses[0]) * 0.8
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_accumulated_distill_step_equals_one_big_batch():
    a, b = _student(seed=3), _student(seed=3)
    batch = _batch(seed=4)
    batch["teacher"] = torch.softmax(torch.randn(64, 2), dim=-1)
    halves = [{k: v[:32] for k, v in batch.items()}, {k: v[32:] for k, v in batch.items()}]
    opt_a, opt_b = torch.optim.AdamW(a.parameters(), lr=0.01), torch.optim.AdamW(b.parameters(), lr=0.01)
    distill, fp32 = DistillConfig(alpha=0.5, temperature=3.0), Precision("fp32", "cpu")
    for _ in range(3):
        la = train_step(a, halves, opt_a, fp32, None, distill)
        lb = train_step(b, [batch], opt_b, fp32, None, distill)
        assert abs(float(la) - float(lb)) < 1e-6
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6)


# --- the readers ---------------------------------------------------------------------------------

@pytest.mark.stack  # the soft targets ride through pyarrow
@pytest.mark.parametrize("reader", ["petastorm", "arrow"])
def test_both_readers_carry_the_soft_targets_into_the_batch(dataset, reader):
    if reader == "petastorm":
        pytest.importorskip("petastorm")
    manifest = read_manifest(dataset.uri)
    stored = np.concatenate([np.stack(pq.read_table(os.path.join(dataset.uri, f.path), columns=["teacher"])
                                      .column("teacher").to_pylist()) for f in manifest.files("train")])
    loader = RankLoader(SplitLayout.from_manifest(manifest, "train"), columns_for(manifest, teacher=True), 0, 1, 32,
                        seed=5, shuffle_buffer_rows=100, reader=reader)
    batches = list(loader.epoch(0))
    assert batches and all(b["teacher"].shape == (32, 2) and b["teacher"].dtype == torch.float32 for b in batches)
    for b in batches:
        np.testing.assert_array_equal(b["teacher"].numpy(), stored[b["_row"].numpy()])  # each row its own targets
    plain = RankLoader(SplitLayout.from_manifest(manifest, "train"), columns_for(manifest), 0, 1, 32, seed=5,
                       shuffle_buffer_rows=100, reader=reader)
    assert "teacher" not in next(iter(plain.epoch(0)))  # not read unless the run distills


# --- through the whole loop ----------------------------------------------------------------------

def test_alpha_zero_trains_exactly_like_plain_training(dataset, tmp_path):
    """Same seed and data: train.distill.alpha=0 (soft targets read and in the loss with weight 0)
    gives bit-identical weights and losses to a run without train.distill."""
    plain = train(_cfg(dataset.uri, tmp_path / "plain"))
    zero = train(_cfg(dataset.uri, tmp_path / "zero", "train.distill.alpha=0"))
    assert [m["train_loss"] for m in plain.metrics] == [m["train_loss"] for m in zero.metrics]
    a, b = _params(plain.model_uri), _params(zero.model_uri)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    half = train(_cfg(dataset.uri, tmp_path / "half", "train.distill.alpha=0.5"))
    c = _params(half.model_uri)
    assert not all(torch.equal(a[k], c[k]) for k in a)  # while a real alpha does change training


def test_distill_through_the_loop_bf16_with_accumulation_records_the_resolved_config(dataset, tmp_path):
    result = train(_cfg(dataset.uri, tmp_path, "train.distill.alpha=0.7", "train.precision=bf16",
                        "train.grad_accum=2", "train.epochs=3"))
    losses = [m["train_loss"] for m in result.metrics]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert result.final["val_accuracy"] > result.final["baseline_accuracy"]
    meta = json.load(open(os.path.join(result.model_uri, "model.json")))
    # temperature: null in the config, resolved from the manifest's teacher record
    assert meta["config"]["train"]["distill"] == {"alpha": 0.7, "temperature": 2.0}
    assert "teacher" not in meta["inputs"]  # the served model is not given soft targets


def test_regression_distills_from_the_teachers_value(tmp_path):
    ds = write_dataset(str(tmp_path / "reg"), {"train": [[500]], "val": [[100]]}, task="regression", teacher={})
    result = train(_cfg(ds.uri, tmp_path, "train.distill.alpha=0.5", "train.precision=fp16", "train.epochs=3"))
    assert result.final["val_mae"] < result.final["baseline_mae"]


# --- refusals before launch --------------------------------------------------------------------------

def test_distill_without_soft_targets_is_refused(tmp_path):
    ds = write_dataset(str(tmp_path / "plain"), {"train": [[200]], "val": [[50]]})
    with pytest.raises(DatasetError, match="has no teacher soft targets.*remove train.distill") as info:
        train(_cfg(ds.uri, tmp_path, "train.distill.alpha=0.5"))
    assert info.value.exit_code == EXIT_USAGE
    assert not os.path.exists(tmp_path / "model.run")  # refused before anything ran


@pytest.mark.parametrize("teacher, named", [
    ({"num_classes": 3}, r"num_classes is 3, but the dataset's label.num_classes is 2"),
    ({"features": {"numeric": ["x1"], "categorical": ["city"], "arrays": []}},
     r"numeric features are \['x1'\], but the dataset's are \['x1', 'x2'\]"),
    ({"features": {"numeric": ["x1", "x2"], "categorical": [], "arrays": []}},
     r"categorical features are \[\], but the dataset's are \['city'\]"),
])
def test_a_teacher_that_does_not_fit_is_refused_naming_what_differs(tmp_path, teacher, named):
    ds = write_dataset(str(tmp_path / "ds"), {"train": [[200]], "val": [[50]]}, teacher=teacher)
    with pytest.raises(DatasetError, match=f"teacher file:///teachers/t whose {named}") as info:
        train(_cfg(ds.uri, tmp_path, "train.distill.alpha=0.5"))
    assert info.value.exit_code == EXIT_USAGE
    train(_cfg(ds.uri, tmp_path / "plain", "train.epochs=1"))  # without train.distill the column is ignored


def test_a_teacher_of_the_same_classes_in_another_order_is_refused_naming_both_lists(tmp_path):
    ds = write_dataset(str(tmp_path / "ds"), {"train": [[200]], "val": [[50]]}, classes=["no", "yes"],
                       teacher={"classes": ["yes", "no"]})
    with pytest.raises(DatasetError, match=r"teacher file:///teachers/t whose classes are \['yes', 'no'\], but "
                                           r"the dataset's label.classes are \['no', 'yes'\]") as info:
        train(_cfg(ds.uri, tmp_path, "train.distill.alpha=0.5"))
    assert info.value.exit_code == EXIT_USAGE


def test_a_different_temperature_is_refused(dataset, tmp_path):
    with pytest.raises(DatasetError, match=r"teacher.temperature' is 2 .* train.distill.temperature is 4"):
        train(_cfg(dataset.uri, tmp_path, "train.distill.alpha=0.5", "train.distill.temperature=4"))
    train_cfg = _cfg(dataset.uri, tmp_path, "train.distill.temperature=2")
    assert train_cfg.train.distill.alpha == 0.5  # the default mix


@pytest.mark.parametrize("override, key", [("train.distill.alpha=1.5", "alpha"),
                                           ("train.distill.temperature=0", "temperature")])
def test_distill_config_is_validated(tmp_path, override, key):
    from common.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"train\.distill\.{key}"):
        _cfg("ds", tmp_path, override)
