"""A model whose training state cannot fit the memory a rank gets is refused on the driver, before
any rank starts (training.model_shape): the parameter arithmetic is checked against the built
models themselves, and the refusal against a real in-process run."""

from __future__ import annotations

import os

import pytest

from common.errors import ConfigError
from tabular_data import write_dataset
from train_configs import train_config
from training import train
from training.config import ModelConfig, load_train_config
from training.model_shape import LARGEST_HOST_BYTES, parameter_count, rank_memory


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("model-memory")
    return {task: write_dataset(str(root / task), {"train": [[64]], "val": [[32]]}, task=task, array_shape=(3, 2))
            for task in ("classification", "regression")}


@pytest.mark.parametrize("task", ["classification", "regression"])
@pytest.mark.parametrize("model", [
    {"name": "mlp", "hidden": [7, 5]},
    {"name": "mlp", "hidden": [9], "embedding_dim": 3},
    {"name": "ft_transformer", "layers": 2, "d_model": 8, "heads": 2},
    {"name": "ft_transformer", "layers": 1, "d_model": 6, "heads": 3, "kwargs": {"ffn_width": 5}},
])
def test_the_parameter_count_is_the_built_models_own(datasets, task, model):
    from common.dataset import read_manifest
    from training.model_specs import build_model

    manifest = read_manifest(datasets[task].uri)
    cfg = ModelConfig(**model)
    built = build_model(cfg, manifest.features.by_kind(), manifest.label)
    assert parameter_count(cfg, manifest.features.by_kind(), manifest.label.to_record()) == \
        sum(p.numel() for p in built.parameters())


# Two image columns beside the tabular ones (the images kind's manifest records, as a shard job fits them).
IMAGES = [{"name": "photo", "channels": 3, "size": [12, 10], "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3]},
          {"name": "scan", "channels": 1, "size": [8, 8], "mean": [0.5], "std": [0.25]}]


@pytest.mark.parametrize("model, images", [
    ({"name": "mlp", "hidden": [7, 5]}, IMAGES),
    ({"name": "mlp", "hidden": [4], "kwargs": {"image_width": 3}}, IMAGES),
    ({"name": "ft_transformer", "layers": 2, "d_model": 8, "heads": 2}, IMAGES),
    ({"name": "resnet", "depth": 18, "width": 4}, IMAGES[:1]),
    ({"name": "resnet", "depth": 34, "width": 2}, IMAGES[:1]),
    ({"name": "resnet"}, IMAGES[:1]),  # ResNet-18 itself: 11,176,512 parameters before its head
])
def test_the_parameter_count_with_image_columns_is_the_built_models_own(datasets, model, images):
    """Each image column adds its stem (training.image_stems) to the count, exactly, and ResNet's
    count is its own; the network takes the uint8 images, and its pipeline stages chained compute
    what it does, cut where its spec says."""
    import torch

    from common.dataset import read_manifest
    from training.model_specs import build_model, model_spec

    manifest = read_manifest(datasets["classification"].uri)
    features = {**manifest.features.by_kind(), "images": images}
    cfg = ModelConfig(**model)
    built = build_model(cfg, features, manifest.label)
    assert parameter_count(cfg, features, manifest.label.to_record()) == sum(p.numel() for p in built.parameters())
    if model == {"name": "resnet"}:
        assert parameter_count(cfg, features, manifest.label.to_record()) == 11_176_512 + 512 * 2 + 2
    assert model_spec(cfg.name).block_names(cfg) == built.pipeline_block_names()
    inputs = built.pipeline_example(3)
    shapes = [(3, 12, 10), (1, 8, 8)][:len(images)]
    assert [tuple(t.shape[1:]) for t in inputs[-len(images):]] == shapes
    assert all(t.dtype == torch.uint8 for t in inputs[-len(images):])
    batch = dict(zip(built.pipeline_inputs(), inputs))
    out = inputs
    for block in range(built.pipeline_blocks()):
        out = (built.pipeline_stage(block, block + 1)(*out),)
    assert torch.equal(out[0], built(batch)) and out[0].shape == (3, 2)
    # The images are normalised inside, by the manifest's statistics: a column at its mean is zero there.
    at_mean = torch.full((1, 3, 12, 10), 0, dtype=torch.uint8)
    for channel, mean in enumerate(IMAGES[0]["mean"]):
        at_mean[:, channel] = round(mean * 255)
    normalise = {"mlp": lambda: built.image_stems[0].normalise, "resnet": lambda: built.normalise,
                 "ft_transformer": lambda: built.tokenizer.image_stems[0].normalise}[cfg.name]()
    assert normalise(at_mean, torch.float32).abs().max() < 0.02


def test_resnet_refuses_a_dataset_it_cannot_take_naming_the_field(datasets, tmp_path):
    """Tabular features (its spec takes images only), and more or fewer than one image column: exit 2
    before anything launches, naming model.name and the features."""
    from common.dataset import read_manifest
    from common.errors import DatasetError
    from training.model_specs import model_spec
    from training.plan import build_plan

    cfg = train_config(datasets["classification"].uri, str(tmp_path / "model"), "model.name=resnet")
    with pytest.raises(DatasetError, match=r"field 'features' holds \{'numeric': \['x1', 'x2'\].* which "
                                           r"model.name='resnet' cannot take \(it takes images features\)"):
        build_plan(cfg, read_manifest(datasets["classification"].uri))
    with pytest.raises(DatasetError, match=r"ds: field 'features.images' holds \['photo', 'scan'\], but "
                                           "model.name=resnet takes exactly one image column"):
        model_spec("resnet").check_features(cfg.model, {"images": IMAGES}, "ds")
    assert DatasetError.exit_code == 2


@pytest.mark.parametrize("model", [
    {"name": "mlp", "hidden": [7, 5]},
    {"name": "mlp", "hidden": [9, 4, 3], "dropout": 0.2},
    {"name": "ft_transformer", "layers": 3, "d_model": 8, "heads": 2},
])
def test_the_pipeline_blocks_and_capabilities_a_spec_declares_are_the_built_models_own(datasets, model):
    from common.dataset import read_manifest
    from training.model_specs import build_model, model_spec, spec_of
    from training.model_specs.base import METHODS, PluginSpec

    manifest = read_manifest(datasets["classification"].uri)
    cfg = ModelConfig(**model)
    spec, built = model_spec(cfg.name), build_model(cfg, manifest.features.by_kind(), manifest.label)
    assert spec.block_names(cfg) == built.pipeline_block_names()
    # What the strategies ask the spec is what the network has (a plug-in's spec looks at it).
    assert spec_of(built) is spec
    assert spec.capabilities == {capability for capability in METHODS if PluginSpec().offers(built, capability)}


@pytest.mark.parametrize("override, keys", [
    (["model.hidden=[1048576,1048576]"], r"model\.hidden=\[1048576, 1048576\]"),
    (["model.name=ft_transformer", "model.d_model=1048576"], r"model\.d_model=1048576, model\.layers=4"),
])
def test_a_model_too_large_for_any_rank_is_refused_before_training(datasets, tmp_path, override, keys):
    out = tmp_path / "model"
    cfg = train_config(datasets["classification"].uri, str(out), "train.batch_size=16", *override)
    with pytest.raises(ConfigError, match=rf"^{keys} makes a .* parameters: its weights, gradients and adamw state "
                                          r"alone need [\d,.]+ TiB per rank, more than the .* a rank gets") as err:
        train(cfg)
    assert err.value.exit_code == 2 and "\n" not in str(err.value)
    assert not out.exists() and not (tmp_path / "model.run").exists()  # refused before anything was written


def test_the_memory_a_rank_gets():
    launch = load_train_config(None, ["data.path=/d", "launch.num_proc=4"]).launch
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert rank_memory(launch, "local[4]", {})[0] == host // 4  # local ranks share this host
    settings = {"spark.executor.pyspark.memory": "6g", "spark.executor.cores": "4", "spark.task.cpus": "2"}
    assert rank_memory(launch, "yarn", settings) == (3 << 30, "spark.executor.pyspark.memory=6g shared by "
                                                                        "2 task(s)")
    # A cluster that caps no Python worker: no machine has more, so only the impossible is refused.
    assert rank_memory(launch, "yarn", {})[0] == LARGEST_HOST_BYTES


def test_a_strided_convolution_of_a_1x1_input_has_finite_bf16_gradients():
    """ResNet's last stage on small images convolves 1 x 1 inputs at stride 2; torch 2.13's CPU bf16
    weight gradient of that came out NaN in about a quarter of tries. The stems' Conv2d runs it at
    stride 1: the same output, finite gradients."""
    import torch

    from training.image_stems import Conv2d

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # nn.Conv2d: NaN in 3 of 50 tries on 1 thread, 19 of 50 on 2
    try:
        for _ in range(25):
            conv = Conv2d(16, 32, 3, stride=2, padding=1, bias=False)
            x = torch.randn(16, 16, 1, 1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = conv(x)
            out.float().sum().backward()
            assert torch.isfinite(conv.weight.grad).all()
            assert torch.equal(conv(x), torch.nn.functional.conv2d(x, conv.weight, None, 2, 1))
    finally:
        torch.set_num_threads(threads)
