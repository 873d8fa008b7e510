"""``load_model`` checks model.json against the network it loads (common/model_artifact.py; the
built-in network comes from training/export.py): a real model, trained in-process once per
module, whose model.json is edited the way a deliberate edit would be (the marker's
model_json_sha256 rewritten to match, so the digest check passes): every edit that makes
model.json disagree with the network is refused with one line naming the field, for the built-in
MLP and the TorchScript program alike; a model.json that is not a JSON object, not JSON or not
UTF-8 is refused naming the file."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil

import pytest

from common.errors import DatasetError
from tabular_data import write_dataset
from train_configs import train_config
from training import load_model, train

SHAPE = (4,)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("model-checks")
    ds = write_dataset(str(root / "ds"), {"train": [[200]], "val": [[60]]}, array_shape=SHAPE)
    cfg = train_config(ds, f"{root}/model", "train.epochs=1", "train.batch_size=32", "model.hidden=[8]",
                       "data.shuffle_buffer_rows=100")
    return train(cfg).model_uri


@pytest.fixture
def model_copy(model, tmp_path) -> str:
    return shutil.copytree(model.removeprefix("file://"), str(tmp_path / "model"))


def _rewrite_meta(model_dir: str, data: bytes) -> None:
    """Write model.json's bytes and re-record their sha256 in the marker, as a consistent edit would."""
    with open(os.path.join(model_dir, "model.json"), "wb") as fh:
        fh.write(data)
    marker_path = os.path.join(model_dir, "_COMMITTED")
    marker = json.load(open(marker_path))
    marker["model_json_sha256"] = hashlib.sha256(data).hexdigest()
    with open(marker_path, "w") as fh:
        json.dump(marker, fh)


def _edited(model_dir: str, edit) -> dict:
    meta = json.load(open(os.path.join(model_dir, "model.json")))
    edited = copy.deepcopy(meta)
    edit(edited)
    assert edited != meta
    _rewrite_meta(model_dir, json.dumps(edited, indent=2, sort_keys=True).encode())
    return edited


def _set(path: str, value):
    def edit(meta):
        *parents, last = path.split(".")
        node = meta
        for key in parents:
            node = node[key]
        node[last] = value
    return edit


def _of_kind(meta, kind):
    return [f for f in meta["features"] if f["kind"] == kind]


def _drop_numeric(meta):
    meta["features"].remove(_of_kind(meta, "numeric")[-1])


def _grow_vocab(meta):
    _of_kind(meta, "categorical")[0]["vocab"] += [f"extra-{i}" for i in range(40)]


def _reshape_array(meta):
    _of_kind(meta, "arrays")[0]["shape"] = [5]


EDITS = [
    ("num_classes 1", _set("label.num_classes", 1), "field 'label.num_classes' is 1"),
    ("num_classes 3", _set("label.num_classes", 3), "field 'label.num_classes' is 3, but the network outputs shape [2, 2]"),
    ("task regression", _set("label.task", "regression"), "field 'label.task' is 'regression', but the network outputs "
                                                          "shape [2, 2]"),
    ("task unknown", _set("label.task", "ranking"), "field 'label.task' is 'ranking'"),
    ("a numeric feature fewer", _drop_numeric, "field 'features' (1 numeric, 1 categorical, arrays image [4]) does not "
                                               "match the inputs the network takes"),
    ("a larger vocabulary", _grow_vocab, "field 'features' (2 numeric, 1 categorical, arrays image [4]) does not match"),
    ("another array shape", _reshape_array, "field 'features' (2 numeric, 1 categorical, arrays image [5]) does not "
                                            "match"),
    ("features not a spec", _set("features", [1, 2]), "field 'features' is not a feature spec"),
    ("category limit not a size", _set("row_rules.max_category_bytes", "1024"),
     "field 'row_rules.max_category_bytes' is '1024'; expected an integer in [1, 1048576]"),
    ("category limit not in an object", _set("row_rules", 1024), "field 'row_rules' is 1024; expected an object"),
]


def test_the_untouched_model_loads_and_its_shapes_agree(model):
    for program in (False, True):
        loaded = load_model(model, program=program)
        assert loaded.task == "classification" and loaded.meta["label"]["num_classes"] == 2


@pytest.mark.parametrize("program", [False, True], ids=["mlp", "program"])
@pytest.mark.parametrize("name, edit, message", EDITS, ids=[e[0] for e in EDITS])
def test_a_consistently_edited_model_json_that_disagrees_with_the_network_is_refused(model_copy, name, edit, message,
                                                                                   program):
    _edited(model_copy, edit)
    # The edit passes the digest check (the marker was rewritten to match): what refuses it is the shape check.
    marker = json.load(open(os.path.join(model_copy, "_COMMITTED")))
    assert marker["model_json_sha256"] == hashlib.sha256(open(os.path.join(model_copy, "model.json"), "rb").read()).hexdigest()
    with pytest.raises(DatasetError) as err:
        load_model(model_copy, program=program)
    text = str(err.value)
    assert text.startswith(f"{model_copy}/model.json: ") and message in text, text
    assert "\n" not in text and err.value.exit_code == 2


@pytest.mark.parametrize("data, message", [
    (b"[1, 2, 3]", "holds a JSON list, not the object a model.json is"),
    (b"{\"format\": ", "not valid JSON"),
    (b"{\"format\": \"caf\xe9\"}", "not valid JSON ('utf-8' codec can't decode"),
], ids=["a list", "not json", "not utf-8"])
def test_a_model_json_that_is_not_a_json_object_is_refused_naming_it(model_copy, data, message):
    _rewrite_meta(model_copy, data)
    with pytest.raises(DatasetError) as err:
        load_model(model_copy)
    text = str(err.value)
    assert text.startswith(f"{model_copy}/model.json: ") and message in text, text
    assert "\n" not in text and err.value.exit_code == 2
