"""The built-in FT-Transformer (``model.name=ft_transformer``, training.models) trained by every
strategy through the rank loop on real torch.distributed ranks (Gloo, CPU, processes of their own):

- DDP on 2 ranks lowers the loss, beats the majority baseline, and publishes a model that
  ``load_model`` rebuilds from model.json (and its TorchScript program) predicting what rank 0 did;
- FSDP on 2 ranks (one unit per block) trains to DDP's weights;
- 2 pipeline stages of whole blocks equal one process: per-step losses and final weights;
- distillation from a dataset's soft targets trains it like any model;
- its config keys are checked, naming the key.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import pipeline_ranks
from common.errors import EXIT_USAGE, ConfigError
from torch_ranks import values

pytestmark = [pytest.mark.timeout(600), pytest.mark.ranks]

LAYOUT = {"train": [[160, 96], [256]], "val": [[70], [50]]}
FT = ["model.name=ft_transformer", "model.layers=2", "model.d_model=8", "model.heads=2"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tabular_data import write_dataset

    return write_dataset(str(tmp_path_factory.mktemp("ft") / "ds"), LAYOUT)


def _config(ds, out, *extra, layout="ddp"):
    from training import load_train_config

    launch = {"ddp": ["launch.backend=torch", "launch.num_proc=2"],
              "fsdp": ["launch.backend=torch", "launch.num_proc=2", "train.parallel=fsdp"],
              "stages": ["launch.backend=torch", "launch.num_proc=2", "train.pipeline.stages=2",
                         "train.pipeline.microbatches=4"],
              "one process": ["launch.mode=in_process", "launch.num_proc=1", "launch.device=cpu"]}[layout]
    return load_train_config(None, [
        f"data.path={ds.uri}", f"output.model_path={out}/model", "train.batch_size=16", "train.lr=0.01",
        "train.log_every_steps=1", "train.epochs=2", "data.shuffle_buffer_rows=64", "data.reader=arrow",
        *FT, *launch, *extra])


def _train(cfg) -> dict:
    """Rank 0's result of a run in this process (``launch.mode=in_process``)."""
    from training import train

    assert cfg.launch.mode == "in_process"
    return train(cfg).ranks[0]


def _weights(out) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "model", "model.safetensors"))


def _step_losses(out) -> list[float]:
    with open(os.path.join(out, "model.run", "steps.jsonl")) as fh:
        return [json.loads(line)["loss"] for line in fh if line.strip()]


def _assert_close_states(got: dict, expected: dict, tol: float):
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name].numpy(), value.numpy(), rtol=0, atol=tol, err_msg=name)


# SGD for the staged run: multi-rank strategies start with one zero-gradient step (which would count
# as a step of Adam's bias correction), and it leaves SGD's momentum as if untouched.
# One epoch: the runs' float rounding differs (micro-batches, sends), and SGD with momentum
# amplifies it step by step (1e-7 of the loss in epoch 1, 4e-5 by the end of epoch 2 at lr 0.05).
STAGED_SGD = ("train.optimizer=sgd", "train.lr=0.02", "train.epochs=1")


@pytest.fixture(scope="module")
def two_rank_runs(two_ranks, dataset, tmp_path_factory):
    """The three 2-rank runs the tests read, through the rank loop on the session's two ranks
    (``two_ranks``), one after another: DDP and FSDP for 3 epochs, and 2 pipeline stages for one
    epoch of SGD. Each: (its output, its ranks' outcomes)."""
    from training.plan import build_plan

    runs = {"ddp": ("train.epochs=3",), "fsdp": ("train.epochs=3",), "stages": STAGED_SGD}
    outs = {layout: tmp_path_factory.mktemp(layout) for layout in runs}
    plans = [build_plan(_config(dataset, outs[layout], *extra, layout=layout)) for layout, extra in runs.items()]
    outcomes = two_ranks.run_calls([(pipeline_ranks.train_rank, (plan,)) for plan in plans])
    return {layout: (outs[layout], outcome) for layout, outcome in zip(runs, outcomes)}


def _rank_0(outcomes) -> dict:
    results = values(outcomes)
    assert len({r["steps"] for r in results}) == 1  # equal steps on every rank
    return results[0]


def test_ddp_on_two_ranks_learns_and_publishes_a_model_load_model_rebuilds(dataset, two_rank_runs):
    from training import load_model

    out, outcomes = two_rank_runs["ddp"]
    result = _rank_0(outcomes)
    metrics = result["metrics"]
    assert [m["epoch"] for m in metrics] == [1, 2, 3]
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]
    assert metrics[-1]["val_accuracy"] > metrics[-1]["baseline_accuracy"]
    meta = json.load(open(out / "model" / "model.json"))["model"]
    assert meta["name"] == "ft_transformer"
    assert {k: meta["arguments"][k] for k in ("layers", "d_model", "heads")} == {"layers": 2, "d_model": 8, "heads": 2}
    rows = dataset.raw["val"].iloc[result["reference"]["rows"]]
    expected = np.array(result["reference"]["predictions"])
    # Rebuilt from model.json's arguments and the safetensors, and as the TorchScript program.
    for program in (False, True):
        loaded = load_model(str(out / "model"), program=program)
        np.testing.assert_allclose(loaded.predict(rows), expected, rtol=1e-5, atol=1e-6)


def test_fsdp_with_one_unit_per_block_trains_to_ddps_weights(two_rank_runs):
    out, outcomes = two_rank_runs["ddp"]
    sharded_out, sharded_outcomes = two_rank_runs["fsdp"]
    assert _rank_0(sharded_outcomes)["steps"] == _rank_0(outcomes)["steps"]
    _assert_close_states(_weights(sharded_out), _weights(out), tol=1e-5)


def test_two_stages_of_whole_blocks_equal_one_process(dataset, two_rank_runs, tmp_path):
    from training import load_model

    staged_out, outcomes = two_rank_runs["stages"]
    staged = _rank_0(outcomes)
    alone = _train(_config(dataset, tmp_path / "one", *STAGED_SGD, layout="one process"))
    assert staged["steps"] == alone["steps"]
    np.testing.assert_allclose(_step_losses(staged_out), _step_losses(tmp_path / "one"), rtol=1e-5)
    _assert_close_states(_weights(staged_out), _weights(tmp_path / "one"), tol=1e-5)
    loaded = load_model(str(staged_out / "model"))
    rows = dataset.raw["val"].iloc[staged["reference"]["rows"]]
    np.testing.assert_allclose(loaded.predict(rows), np.array(staged["reference"]["predictions"]), rtol=1e-5,
                               atol=1e-6)


def test_distillation_trains_it_like_any_model(tmp_path):
    from tabular_data import write_dataset

    from training import load_model

    ds = write_dataset(str(tmp_path / "ds"), LAYOUT, teacher={})
    result = _train(_config(ds, tmp_path, "train.distill.alpha=0.5", layout="one process"))
    assert result["metrics"][-1]["train_loss"] < result["metrics"][0]["train_loss"]
    assert load_model(str(tmp_path / "model")).meta["config"]["train"]["distill"]["alpha"] == 0.5


@pytest.mark.parametrize("overrides,message", [
    (["model.d_model=10", "model.heads=4"], "model.d_model must be a multiple of model.heads=4"),
    (["model.layers=0"], "model.layers must be in [1, 1024]"),
    (["model.name=transformer"], "model.name must be 'mlp', 'ft_transformer', 'resnet' or 'module:factory'"),
    (["train.pipeline.stages=2", "model.layers=1", "launch.backend=torch"], "model.layers=1 is fewer than the 2"),
], ids=["d_model-heads", "layers", "name", "fewer-blocks-than-stages"])
def test_bad_settings_are_refused_naming_the_key(dataset, tmp_path, overrides, message):
    with pytest.raises(ConfigError) as info:
        _config(dataset, tmp_path, *overrides)
    assert info.value.exit_code == EXIT_USAGE
    assert message in str(info.value)
