"""The train/run config trees: defaults load, bad values name the key, run wires data.path."""

import os

import pytest

from common.errors import ConfigError
from shardtrain.run import load_run_config
from training.config import load_train_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_shipped_configs_load():
    cfg = load_train_config(os.path.join(ROOT, "conf/train.yaml"))
    assert cfg.train.precision == "bf16" and cfg.launch.num_proc == 2
    run = load_run_config(os.path.join(ROOT, "conf/run.yaml"))
    assert run.train.data.path == run.shard.output.path  # defaults to the shard output
    # Relative paths are made absolute when loaded: executors and ranks work in other directories.
    assert run.train.checkpoint_path == os.path.abspath("artifacts/model.run/checkpoints")


@pytest.mark.parametrize("override, key", [
    ("train.precision=fp8", "train.precision"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.grad_accum=0", "train.grad_accum"),
    ("train.clip_norm=-1", "train.clip_norm"),
    ("model.name=nomodule", "model.name"),
    ("launch.num_proc=0", "launch.num_proc"),
    ("checkpoint.keep=0", "checkpoint.keep"),
    ("checkpoint.resume=maybe", "checkpoint.resume"),
    ("train.lr_scale=sqrt", "train.lr_scale"),
    ("train.epoch=3", "train.epochs"),  # unknown key: suggests the closest
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_train_config(None, ["data.path=/d", override])


def test_data_path_is_required_and_in_process_is_one_rank():
    with pytest.raises(ConfigError, match="data.path"):
        load_train_config(None, [])
    with pytest.raises(ConfigError, match="launch.num_proc"):
        load_train_config(None, ["data.path=/d", "launch.mode=in_process", "launch.num_proc=2"])


def test_model_kwargs_pass_through():
    cfg = load_train_config(None, ["data.path=/d", "model.name=pkg.mod:make", "model.kwargs.width=7"])
    assert cfg.model.kwargs == {"width": 7}


@pytest.mark.parametrize("override, key", [
    ("train.lr=.inf", "train.lr"),
    ("train.lr=.nan", "train.lr"),  # NaN passes `lr > 0`'s negation too: it must be refused by name
    ("train.weight_decay=.inf", "train.weight_decay"),
    ("train.momentum=.nan", "train.momentum"),
    ("train.clip_norm=.inf", "train.clip_norm"),
    ("model.dropout=.nan", "model.dropout"),
    ("train.distill={alpha: .nan}", "train.distill.alpha"),
    ("train.distill={temperature: .inf}", "train.distill.temperature"),
])
def test_float_values_must_be_finite(override, key):
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')} must be a finite number"):
        load_train_config(None, ["data.path=/d", override])


@pytest.mark.parametrize("override, key", [
    ("model.hidden=[10000000000]", "model.hidden"),  # a 40 GB weight per input column
    ("model.embedding_dim=10000000000", "model.embedding_dim"),
    ("train.batch_size=10000000000", "train.batch_size"),
    ("data.shuffle_buffer_rows=10000000000", "data.shuffle_buffer_rows"),
    ("data.reader_workers=100000", "data.reader_workers"),
    ("data.prefetch_row_groups=100000000", "data.prefetch_row_groups"),
    ("launch.num_proc=1000000", "launch.num_proc"),
])
def test_counts_that_size_allocations_have_a_fixed_limit(override, key):
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')} must be .*at most|{key.replace('.', '[.]')} "
                                          r"must be in \[1, "):
        load_train_config(None, ["data.path=/d", override])


def test_the_config_check_imports_neither_torch_nor_horovod():
    # The driver checks every strategy and launcher before anything launches, importing their
    # modules for their config sections and refusals; a rank imports torch when it builds one.
    import subprocess
    import sys

    code = ("import sys\n"
            "from training.config import load_train_config\n"
            "from training.launchers import LAUNCHERS, launcher_named\n"
            "from training.strategies import strategy_classes\n"
            "load_train_config(None, ['data.path=/d', 'launch.backend=torch', 'launch.num_proc=2',\n"
            "                         'train.pipeline.stages=2', 'train.pipeline.microbatches=2'])\n"
            "strategy_classes(), [launcher_named(name) for name in LAUNCHERS]\n"
            "print(sorted(m for m in ('torch', 'horovod') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("overrides, identity", [
    ([], '{"dropout": 0.0, "embedding_dim": null, "features": null, "hidden": [128, 64], "kwargs": {}, "name": "mlp", '
         '"num_classes": null, "task": null}'),
    (["model.name=ft_transformer", "model.kwargs.ffn_width=5"],
     '{"d_model": 32, "dropout": 0.0, "features": null, "heads": 4, "kwargs": {"ffn_width": 5}, "layers": 4, '
     '"name": "ft_transformer", "num_classes": null, "task": null}'),
    (["model.name=pkg.mod:make", "model.task=regression"],
     '{"dropout": 0.0, "embedding_dim": null, "features": null, "hidden": [128, 64], "kwargs": {}, '
     '"name": "pkg.mod:make", "num_classes": null, "task": "regression"}'),
], ids=["mlp", "ft_transformer", "plug-in"])
def test_a_models_identity_is_byte_for_byte_what_its_checkpoints_recorded(overrides, identity):
    # The run identity's "model" (training.loop) that a checkpoint must match to resume, as main at
    # 55cf1b8 recorded it: its spec's keys and those every model has, never another model's.
    import json

    cfg = load_train_config(None, ["data.path=/d", *overrides])
    assert json.dumps(cfg.model.identity(), sort_keys=True) == identity
