"""Text features in training (issue 44): token batches padded to their longest row (rounded up to
data.batching.pad_multiple) with a mask, the same number of them on every rank; the built-in
models' parameter arithmetic with text; a trained model's ``predict`` on raw strings computing
exactly what it trained on; pipeline stages refuse variable-length inputs."""

from __future__ import annotations

import numpy as np
import pytest

from common.dataset import read_manifest
from common.errors import ConfigError
from tabular_data import TEXT_MAX_TOKENS, write_dataset
from train_configs import train_config
from training.columns import columns_for
from training.config import ModelConfig
from training.data import RankLoader, read_first_rows
from training.split_layout import SplitLayout

UNEVEN = {"train": [[170, 33], [60], [0], [129]], "val": [[61], [20]]}


@pytest.fixture(scope="module")
def text_dataset(tmp_path_factory):
    ds = write_dataset(str(tmp_path_factory.mktemp("text") / "ds"), UNEVEN, text=True)
    return ds, read_manifest(ds.uri)


def _stored_ids(manifest, split: str) -> dict[int, list[int]]:
    import pyarrow.parquet as pq

    out = {}
    for entry in manifest.files(split):
        table = pq.read_table(manifest.root.join(entry.path).path, columns=["review", "_row"])
        out.update(zip(table.column("_row").to_pylist(), table.column("review").to_pylist()))
    return out


@pytest.mark.parametrize("world, batch, pad_multiple", [(1, 32, 1), (2, 16, 4), (3, 20, 8)])
def test_token_batches_are_padded_to_their_longest_row_with_a_mask_and_equal_on_every_rank(
        text_dataset, world, batch, pad_multiple):
    _, manifest = text_dataset
    layout, stored = SplitLayout.from_manifest(manifest, "train"), _stored_ids(manifest, "train")
    columns = columns_for(manifest, pad_multiple=pad_multiple)
    counts = set()
    for rank in range(world):
        loader = RankLoader(layout, columns, rank, world, batch, seed=5, shuffle_buffer_rows=64, reader="arrow")
        batches = list(loader.epoch(1))
        counts.add(len(batches))
        for b in batches:
            ids, mask = b["review"].numpy(), b["review#mask"].numpy()
            longest = int(mask.sum(axis=1).max())
            assert ids.shape == mask.shape and ids.shape[1] == max(-(-max(longest, 1) // pad_multiple) * pad_multiple,
                                                                   pad_multiple)
            assert ids.dtype == np.int64 and (ids[~mask] == 0).all()  # [PAD] is id 0
            for row, r_ids, r_mask in zip(b["_row"].tolist(), ids, mask):
                assert r_ids[r_mask].tolist() == stored[row]  # the row's stored ids, in order, then padding
                assert r_mask.tolist() == sorted(r_mask.tolist(), reverse=True)
    assert len(counts) == 1  # the same number of batches on every rank
    assert max(len(v) for v in stored.values()) == TEXT_MAX_TOKENS and min(len(v) for v in stored.values()) == 0


def test_a_resumed_epoch_gives_the_same_token_batches(text_dataset):
    _, manifest = text_dataset
    layout, columns = SplitLayout.from_manifest(manifest, "train"), columns_for(manifest, pad_multiple=4)

    def epoch(skip):
        loader = RankLoader(layout, columns, 0, 2, 16, seed=9, shuffle_buffer_rows=48, reader="arrow")
        return list(loader.epoch(2, skip_batches=skip))

    whole, resumed = epoch(0), epoch(3)
    assert len(resumed) == len(whole) - 3
    for a, b in zip(whole[3:], resumed):
        assert a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


@pytest.mark.parametrize("model", [
    {"name": "mlp", "hidden": [7, 5]},
    {"name": "mlp", "hidden": [4], "embedding_dim": 3},
    {"name": "ft_transformer", "layers": 1, "d_model": 8, "heads": 2},
])
def test_the_parameter_count_with_text_is_the_built_models_own(text_dataset, model):
    from training.model_shape import parameter_count
    from training.model_specs import build_model

    _, manifest = text_dataset
    cfg = ModelConfig(**model)
    built = build_model(cfg, manifest.features.by_kind(), manifest.label)
    assert parameter_count(cfg, manifest.features.by_kind(), manifest.label.to_record()) == \
        sum(p.numel() for p in built.parameters())
    # and the network takes the probe batch (the largest token id in its last row)
    probe = {k: __import__("torch").from_numpy(v) for k, v in manifest.features.probe(3).items()}
    assert built(probe).shape[0] == 3


@pytest.mark.parametrize("name", ["ft_transformer"])  # the MLP's pooling: the parameter and probe test above
def test_predict_on_raw_strings_computes_what_training_tokenized(text_dataset, tmp_path, name):
    from training import train
    from training.api import load_model

    ds, manifest = text_dataset
    model = ["model.hidden=[8]"] if name == "mlp" else ["model.layers=1", "model.d_model=8", "model.heads=2"]
    train(train_config(ds, str(tmp_path / "m"), f"model.name={name}", *model, "train.epochs=1",
                       "train.batch_size=32", "data.reader=arrow", "train.precision=fp32"))
    for program in (False, True):
        loaded = load_model(str(tmp_path / "m"), program=program)
        raw = ds.raw["val"]
        served = loaded.features.transform(raw)
        trained = read_first_rows(SplitLayout.from_manifest(manifest, "val"), columns_for(manifest), len(raw))
        for key in ("review", "review#mask"):
            assert np.array_equal(served[key], trained[key]), key
        assert np.allclose(loaded.predict(raw), loaded.predict_arrays(trained), atol=1e-6)


def test_pipeline_stages_refuse_a_dataset_with_text_naming_the_key(text_dataset, tmp_path):
    from training.plan import build_plan

    ds, manifest = text_dataset
    cfg = train_config(ds, str(tmp_path / "m"), "model.name=ft_transformer", "model.layers=2", "model.d_model=8",
                       "model.heads=2", "train.pipeline.stages=2", "launch.num_proc=2", "launch.backend=torch",
                       ranks=None)
    with pytest.raises(ConfigError, match=r"train.pipeline.stages=2 cannot take the variable-length features "
                                          r"\['review'\]") as err:
        build_plan(cfg, manifest)
    assert err.value.exit_code == 2
