"""The trained model in storage, and loading it back for predictions.

``publish_model`` writes, atomically (common.storage.publish: staging, rename, marker last):

* ``model.safetensors``: the weights (no pickle);
* ``model.torchscript.pt``: a TorchScript program for serving; it takes the preprocessed tensors
  (``FeatureSpec.transform`` output) and returns class probabilities or regression values;
* ``model.json``: how to rebuild and use it: resolved config, feature spec (vocabularies,
  normalization statistics), label spec, per-epoch metrics, baseline, the dataset manifest's
  fingerprint and library versions.

``load_model(uri)`` never unpickles arbitrary objects: the built-in MLP is rebuilt from
model.json and safetensors; a plug-in model is loaded as TorchScript (code + tensors only).
``.predict(frame)`` applies the training preprocessing to raw feature columns.
"""

from __future__ import annotations

import io
import json
import platform
from typing import Dict

import numpy as np
import torch
from torch import nn

from common.errors import DatasetError
from common.dataset import FeatureSpec
from common.storage import publish, require_committed

MODEL_FORMAT = "shardtrain.model"
MODEL_FORMAT_VERSION = 1
WEIGHTS, PROGRAM, META = "model.safetensors", "model.torchscript.pt", "model.json"


class ServingModel(nn.Module):
    """The trained network plus its output transform: probabilities, or de-standardized values."""

    def __init__(self, net: nn.Module, regression: bool, target_mean: float = 0.0, target_std: float = 1.0):
        super().__init__()
        self.net = net
        self.regression = regression
        self.target_mean, self.target_std = float(target_mean), float(target_std)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.net(batch)
        if self.regression:
            return out * self.target_std + self.target_mean
        return torch.softmax(out.float(), dim=-1)


def target_scaling(label_spec: dict) -> tuple[float, float]:
    """Regression targets are trained standardized (mean 0, std 1) for a well-scaled loss."""
    if label_spec.get("task") == "classification":
        return 0.0, 1.0
    std = float(label_spec.get("train_std") or 1.0)
    return float(label_spec.get("train_mean") or 0.0), std if std > 0 else 1.0


def serving_model(net: nn.Module, label_spec: dict) -> ServingModel:
    mean, std = target_scaling(label_spec)
    return ServingModel(net, label_spec.get("task") != "classification", mean, std)


def publish_model(uri: str, mode: str, net: nn.Module, meta: dict, example_batch: dict) -> str:
    """Write the model directory at ``uri`` atomically; ``meta`` becomes model.json (plus versions)."""
    net = net.to("cpu").eval()
    serving = serving_model(net, meta["label"])
    weights = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    program = _program(serving, {k: v.to("cpu") for k, v in example_batch.items()})
    from safetensors.torch import save as save_safetensors

    record = {"format": MODEL_FORMAT, "format_version": MODEL_FORMAT_VERSION, **meta, "versions": versions()}
    with publish(uri, mode=mode, marker={"format": MODEL_FORMAT}) as staging:
        with staging.open(WEIGHTS, "wb") as fh:
            fh.write(save_safetensors(weights))
        with staging.open(PROGRAM, "wb") as fh:
            fh.write(program)
        staging.write_text(META, json.dumps(record, indent=2, sort_keys=True))
    return uri


def _program(serving: ServingModel, example: dict) -> bytes:
    try:
        scripted = torch.jit.script(serving)
    except Exception:  # noqa: BLE001 - a plug-in model may not be scriptable; tracing is the fallback
        scripted = torch.jit.trace(serving, (example,), strict=False)
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    return buffer.getvalue()


def versions() -> dict:
    import pyarrow

    from common import __version__

    found = {"shardtrain": __version__, "python": platform.python_version(), "torch": torch.__version__,
             "numpy": np.__version__, "pyarrow": pyarrow.__version__}
    for name in ("horovod", "petastorm", "pyspark", "safetensors"):
        try:
            found[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a version we cannot read is simply not recorded
            pass
    return found


class LoadedModel:
    """A published model: ``predict(frame)`` on raw feature columns, ``meta`` is model.json."""

    def __init__(self, module: nn.Module, meta: dict):
        self.module = module.eval()
        self.meta = meta
        self.features = FeatureSpec(meta["features"])

    @property
    def task(self) -> str:
        return self.meta["label"]["task"]

    @property
    def metrics(self) -> list[dict]:
        return self.meta.get("metrics", [])

    def predict(self, frame) -> np.ndarray:
        """pandas DataFrame or Arrow table of raw feature columns -> probabilities [n, classes]
        (classification) or values [n] (regression)."""
        arrays = self.features.transform(frame)
        return self.predict_arrays(arrays)

    def predict_arrays(self, arrays: dict) -> np.ndarray:
        """Already-preprocessed arrays (as stored in the dataset / produced by FeatureSpec.transform)."""
        batch = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in arrays.items()}
        with torch.no_grad():
            return self.module(batch).float().numpy()


def load_model(uri: str, program: bool | None = None) -> LoadedModel:
    """Load a published model. ``program``: force (True) or avoid (False) the TorchScript program;
    by default the built-in MLP is rebuilt from safetensors and plug-ins use TorchScript."""
    try:
        loc = require_committed(uri, "model")
    except Exception as exc:  # StorageError: keep its message, but as the dataset-contract exit status 2
        raise DatasetError(str(exc)) from None
    meta = json.loads(loc.read_text(META))
    if meta.get("format") != MODEL_FORMAT or meta.get("format_version") != MODEL_FORMAT_VERSION:
        raise DatasetError(f"{loc.uri}/{META}: format {meta.get('format')!r} version {meta.get('format_version')!r} "
                           f"is not a model this shardtrain reads ({MODEL_FORMAT} v{MODEL_FORMAT_VERSION})")
    arguments = meta["model"].get("arguments")
    if program or (program is None and arguments is None):
        with loc.open(PROGRAM, "rb") as fh:
            module = torch.jit.load(io.BytesIO(fh.read()), map_location="cpu")
        return LoadedModel(module, meta)
    from safetensors.torch import load as load_safetensors

    from training.models import TabularMLP

    net = TabularMLP(**arguments)
    with loc.open(WEIGHTS, "rb") as fh:
        net.load_state_dict(load_safetensors(fh.read()))
    return LoadedModel(serving_model(net, meta["label"]), meta)


__all__ = ["LoadedModel", "ServingModel", "load_model", "publish_model", "serving_model", "target_scaling"]
