"""The whole training path in one process (launch.mode=in_process: the same loop, world size 1,
no Spark or Horovod): resume equivalence (fp32 mid-epoch, fp16 from an epoch end with its loss
scale), corrupt-checkpoint fallback, load_model round trip, validation over every row, non-finite
loss and weights never checkpointed, the fp16 skipped-steps stop, regression, and the driver
refusing bad datasets before launching anything."""

import json
import math
import os

import numpy as np
import pytest

from common.features import FeatureSpec
import torch

from common.errors import EXIT_USAGE, ConfigError, DatasetError, OutputExistsError
from tabular_data import write_dataset
from train_configs import train_config
from training import load_model, load_train_config, train
from common.errors import NonFiniteLossError

# Marked stack, test by test: predict on pandas rows and pyarrow's errors; the loop itself is torch's,
# the same on both profiles (the arrow reader's own order and resume: tests/training/test_arrow_reader.py).

LAYOUT = {"train": [[400, 150], [300], [190]], "val": [[120], [80]]}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("ip") / "ds"), LAYOUT)


def _cfg(ds_uri, out, *extra):
    return train_config(ds_uri, f"{out}/model", "train.epochs=3", "train.batch_size=32", "train.lr=0.01",
                        "train.log_every_steps=5", "data.shuffle_buffer_rows=100", "model.hidden=[16]",
                        "model.dropout=0.1", *extra)


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


@pytest.mark.stack  # load_model's predict on each stack's pandas rows
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
    assert FeatureSpec(meta["features"]).by_kind()["categorical"][0]["vocab"] and meta["versions"]["torch"] == torch.__version__
    assert len(meta["metrics"]) == 3 and meta["config"]["train"]["precision"] == "bf16"
    assert all(m["val_rows"] == 200 for m in result.metrics)  # every validation row, none skipped
    lines = open(os.path.join(result.run_dir, "metrics.jsonl")).read().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]
    for record in map(json.loads, lines):  # the step-time breakdown every epoch reports
        assert record["samples"] == 1 * (1040 // 32) * 32  # world size x steps x batch
        assert 0 <= record["data_wait_seconds"] <= record["seconds"]
        assert 0 <= record["allreduce_wait_seconds"] <= record["seconds"]
    with pytest.raises(OutputExistsError):  # output.mode=error refuses before training
        train(_cfg(dataset.uri, tmp_path, "output.mode=error"))
    marker = json.load(open(os.path.join(result.model_uri, "_COMMITTED")))
    assert marker["run_id"] == meta["run_id"] and len(meta["run_id"]) == 32  # which run published it
    # A later run in this run directory that dies before its end: its config.yaml is never left beside
    # the first run's summary, report or metrics.
    assert {"summary.json", "report.html", "metrics.jsonl"} <= set(os.listdir(result.run_dir))

    def preempt(step):
        if step == 3:
            raise Preempted()

    with pytest.raises(Preempted):
        train(_cfg(dataset.uri, tmp_path, "train.lr=0.02", "checkpoint.resume=never", "output.mode=overwrite"),
              on_step=preempt)
    assert "lr: 0.02" in open(os.path.join(result.run_dir, "config.yaml")).read()
    assert not {"summary.json", "report.html", "metrics.jsonl"} & set(os.listdir(result.run_dir))
    checkpoints = os.path.join(result.run_dir, "checkpoints")
    for step in os.listdir(checkpoints):
        assert json.load(open(os.path.join(checkpoints, step, "_COMMITTED")))["kind"] == "shardtrain.checkpoint"


def test_a_checkpoint_path_holding_another_output_is_refused(dataset, tmp_path):
    model = train(_cfg(dataset.uri, tmp_path / "first", "train.epochs=1")).model_uri
    before = sorted(os.listdir(model))
    with pytest.raises(OutputExistsError, match=rf"^{model} \(checkpoint.path\) holds a shardtrain.model") as err:
        train(_cfg(dataset.uri, tmp_path / "second", f"checkpoint.path={model}"))
    assert err.value.exit_code == EXIT_USAGE and sorted(os.listdir(model)) == before
    # A step directory that another output's marker claims: resuming would read it, pruning delete it.
    foreign = tmp_path / "foreign"
    os.makedirs(foreign / "step-000000005")
    (foreign / "step-000000005" / "_COMMITTED").write_text(json.dumps({"kind": "shardtrain.dataset"}))
    with pytest.raises(OutputExistsError, match=r"step-000000005 \(checkpoint.path\) holds a shardtrain.dataset"):
        train(_cfg(dataset.uri, tmp_path / "third", f"checkpoint.path={foreign}"))


@pytest.mark.stack  # what each pyarrow raises for a file gone mid-read
@pytest.mark.parametrize("reader", ["petastorm", "arrow"])
def test_a_shard_removed_mid_run_is_one_line_naming_it(tmp_path, reader):
    if reader == "petastorm":
        pytest.importorskip("petastorm")  # the current profile has only the arrow reader
    from common.dataset import read_manifest
    from common.errors import EXIT_RUNTIME, DatasetChangedError

    ds = write_dataset(str(tmp_path / "ds"), {"train": [[200], [200]], "val": [[50]]})
    victim = read_manifest(ds.uri).file_uris("train")[1]

    def remove_a_shard(step):
        if step == 3:  # epoch 1 of 2: the file was read and verified once already
            os.remove(victim)
    with pytest.raises(DatasetChangedError) as err:  # the dataset changed under the run (training.split_layout: pinning)
        train(_cfg(ds.uri, tmp_path, "train.epochs=2", f"data.reader={reader}"), on_step=remove_a_shard)
    assert not os.path.exists(victim)  # the file really went away mid-run
    message = str(err.value)
    assert f"({victim} is gone)" in message and "\n" not in message, message
    assert f"dataset {ds.uri}: it was rewritten while training read it" in message, message
    assert err.value.exit_code == EXIT_RUNTIME and not os.path.exists(tmp_path / "model")


def test_plugin_model_and_regression(tmp_path):
    ds = write_dataset(str(tmp_path / "reg"), {"train": [[600], [400]], "val": [[200]]}, task="regression")
    result = train(_cfg(ds.uri, tmp_path, "model.name=plugin_models:tiny", "model.kwargs.width=8",
                        "train.epochs=4", "train.precision=fp16"))
    assert result.final["val_mae"] < result.final["baseline_mae"]
    assert (f"validation mae: {result.final['val_mae']:.4f} (trivial baseline {result.final['baseline_mae']:.4f}; "
            "lower is better)") in result.summary(), result.summary()
    # A plug-in is rebuilt by calling its factory again with the kwargs it was trained with, and is
    # also served by its TorchScript program (it scripts: output.torchscript auto wrote one).
    rows = ds.raw["val"].iloc[result.reference["rows"]]
    for program in (False, True):
        values = load_model(result.model_uri, program=program).predict(rows)
        np.testing.assert_allclose(values, np.array(result.reference["predictions"]), rtol=1e-5, atol=1e-5)


def test_a_model_torchscript_cannot_compile_publishes_without_a_program_and_predicts(dataset, tmp_path, caplog):
    """The plug-in has a try statement, which TorchScript lacks: with output.torchscript auto
    (the default) the model is published with its weights and no program, saying so, and
    load_model rebuilds it from its factory to the predictions training made; asked for a program,
    load_model says there is none. With always it is refused before any step."""
    import torch

    from common.dataset import read_manifest
    from plugin_models import unscriptable

    manifest = read_manifest(dataset.uri)
    probe = unscriptable(FeatureSpec(manifest.features.spec).by_kind(), manifest.label.to_record())
    with pytest.raises(Exception, match="[Tt]ry"):  # proves the model really cannot be scripted
        torch.jit.script(probe)
    overrides = ("model.name=plugin_models:unscriptable", "model.kwargs.width=6", "train.epochs=1")
    with caplog.at_level("WARNING", logger="shardtrain.train"):
        result = train(_cfg(dataset.uri, tmp_path / "auto", *overrides))
    assert sorted(os.listdir(result.model_uri)) == ["_COMMITTED", "model.json", "model.safetensors"]
    assert "published without a TorchScript program: torch.jit.script cannot compile it" in caplog.text
    values = load_model(result.model_uri).predict(dataset.raw["val"].iloc[result.reference["rows"]])
    np.testing.assert_allclose(values, np.array(result.reference["predictions"]), rtol=1e-5, atol=1e-5)
    with pytest.raises(DatasetError, match="published without a TorchScript program"):
        load_model(result.model_uri, program=True)

    with pytest.raises(ConfigError, match=r"output.torchscript=always, but torch.jit.script cannot compile") as err:
        train(_cfg(dataset.uri, tmp_path / "always", *overrides, "output.torchscript=always",
                   "checkpoint.every_steps=1"))
    assert err.value.exit_code == EXIT_USAGE
    assert not os.path.exists(tmp_path / "always/model.run/checkpoints")  # no step ran


def _checkpoint_steps(run_dir):
    ckpt = os.path.join(run_dir, "checkpoints")
    return sorted(int(name.split("-")[1]) for name in os.listdir(ckpt)) if os.path.isdir(ckpt) else []


def test_non_finite_loss_is_never_checkpointed_and_names_step_and_rank(dataset, tmp_path):
    """The loss goes NaN at step 8, between log steps (every 50; 32 steps per epoch), with a
    checkpoint due every step: the steps before it are saved, the bad one and later ones never."""
    cfg = _cfg(dataset.uri, tmp_path, "model.name=plugin_models:poisoned", "model.kwargs.nan_after=7",
               "train.log_every_steps=50", "checkpoint.every_steps=1", "checkpoint.keep=3")
    with pytest.raises(NonFiniteLossError, match="loss became non-finite .* at optimizer step 8 on rank 0"):
        train(cfg)
    assert _checkpoint_steps(tmp_path / "model.run") == [5, 6, 7]


def test_non_finite_weights_are_never_checkpointed(dataset, tmp_path):
    """Step 6's update makes a weight NaN while step 6's loss is still finite (step 7's is not):
    a check of the loss alone would have saved step 6."""
    cfg = _cfg(dataset.uri, tmp_path, "model.name=plugin_models:poisoned_weights", "model.kwargs.after=5",
               "train.log_every_steps=50", "checkpoint.every_steps=1", "checkpoint.keep=3")
    with pytest.raises(NonFiniteLossError, match="weights became non-finite .* by optimizer step 6 on rank 0"):
        train(cfg)
    assert _checkpoint_steps(tmp_path / "model.run") == [3, 4, 5]
    saved = torch.load(tmp_path / "model.run/checkpoints/step-000000005/state.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in saved["model"].values())


def test_fp16_stops_after_max_skipped_steps(dataset, tmp_path):
    """Every loss is NaN: the GradScaler skips steps 1-3, the 4th in a row stops training at the
    next check (step 5, a log step) instead of skipping steps for the rest of the run."""
    steps = []
    cfg = _cfg(dataset.uri, tmp_path, "model.name=plugin_models:poisoned", "model.kwargs.nan_after=0",
               "train.precision=fp16", "train.max_skipped_steps=3", "train.log_every_steps=5")
    with pytest.raises(NonFiniteLossError, match=r"at optimizer step 4 on rank 0 \(4 consecutive non-finite losses"):
        train(cfg, on_step=steps.append)
    assert steps == [1, 2, 3, 4]  # step 5 raised before its on_step: nothing ran past the check
    assert _checkpoint_steps(tmp_path / "model.run") == []


def test_fp16_resume_from_an_epoch_end_restores_the_loss_scale_and_the_history(dataset, tmp_path):
    """fp16 on CPU with one overflowing batch per epoch (the scaler skips it and halves its scale);
    checkpoints at epoch ends only (32 steps each); a crash in epoch 2 resumes from step 32. After
    the resume the GradScaler state (scale, growth tracker) and the weights equal the uninterrupted
    run's at steps 64 and 96, and the metrics still list all 3 epochs."""
    same = ("train.precision=fp16", "model.name=plugin_models:spiky", "model.kwargs.row=100")
    straight = train(_cfg(dataset.uri, tmp_path / "a", *same))

    def crash(step):
        if step == 40:
            raise Preempted()

    broken = _cfg(dataset.uri, tmp_path / "b", *same, "checkpoint.keep=3")
    with pytest.raises(Preempted):
        train(broken, on_step=crash)
    assert _checkpoint_steps(tmp_path / "b/model.run") == [32]
    at_32 = torch.load(tmp_path / "b/model.run/checkpoints/step-000000032/state.pt", weights_only=True)
    assert at_32["scaler"]["scale"] < torch.amp.GradScaler("cpu").get_scale()  # a fresh scaler would differ
    resumed = train(broken)
    assert resumed.resumed_from.endswith("step-000000032")
    assert [m["epoch"] for m in resumed.metrics] == [1, 2, 3]
    assert [m["train_loss"] for m in resumed.metrics] == pytest.approx([m["train_loss"] for m in straight.metrics])
    # The skipped step's inf loss is counted, not averaged in: each epoch's train_loss stays finite.
    assert [m["non_finite_losses"] for m in straight.metrics] == [1, 1, 1]
    assert [m["non_finite_losses"] for m in resumed.metrics] == [1, 1, 1]
    assert all(math.isfinite(m["train_loss"]) for m in straight.metrics)
    for step in (64, 96):
        a, b = (torch.load(tmp_path / run / f"model.run/checkpoints/step-{step:09d}/state.pt", weights_only=True)
                for run in ("a", "b"))
        assert a["scaler"] == b["scaler"], step
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), (step, name)


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


def test_a_full_disk_is_one_line_naming_the_output_that_did_not_fit(dataset, small_disk):
    """A checkpoint that does not fit (a real tmpfs, full): exit 1 naming the checkpoint, not a bare
    OSError, and the staging it left is removed."""
    from common.errors import StorageIOError

    checkpoints = small_disk.path / "model.run" / "checkpoints"
    with pytest.raises(StorageIOError, match=rf"^{checkpoints}/step-\d+: writing the output failed: OSError: "
                                             r"No space left on device$") as err:
        train(_cfg(dataset.uri, small_disk.path, "model.hidden=[512,512]", "checkpoint.every_steps=2"))
    assert err.value.exit_code == 1
    assert not [name for name in os.listdir(checkpoints) if "staging" in name]


def test_a_config_built_in_code_with_relative_paths_names_them_from_the_working_directory(dataset, tmp_path,
                                                                                       monkeypatch):
    """A notebook's config made in code never passes through the loader: train() makes its relative
    paths absolute from the working directory all the same (what the ranks and executors are given),
    and leaves the caller's object as it was."""
    import dataclasses

    monkeypatch.chdir(tmp_path)
    cfg = _cfg(dataset.uri, tmp_path, "train.epochs=1")
    cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, model_path="relative/model"))
    assert cfg.output.model_path == "relative/model"  # built in code: nothing resolved it
    result = train(cfg)
    assert result.model_uri == str(tmp_path / "relative" / "model") and os.path.isdir(result.model_uri)
    meta = json.load(open(os.path.join(result.model_uri, "model.json")))
    assert meta["config"]["output"]["model_path"] == result.model_uri  # what the ranks were given
    assert cfg.output.model_path == "relative/model"
