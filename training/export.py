"""Publishing a trained model, and loading it back with the built-in architecture.

``publish_model`` writes, atomically (common.publish.publish: staging, rename, marker last), the
layout ``common.model_artifact`` reads:

* ``model.safetensors``: the weights (no pickle);
* ``model.torchscript.pt``, by ``output.torchscript`` (where ``torch.jit.script`` compiles the
  model, by default): a TorchScript program for serving (``ServingModel``: the network plus its
  output transform); it takes the preprocessed tensors (``FeatureSpec.transform`` output) and
  returns class probabilities or regression values;
* ``model.json``: how to rebuild and use it: resolved config, feature spec (vocabularies,
  normalization statistics), label spec, per-epoch metrics, baseline, the dataset manifest's
  fingerprint, the shard job's ``row_rules`` (``max_category_bytes``: serving refuses a longer
  category, as the shard job did), library versions, and the sha256 and size of each file above
  (``files``).

The ``_COMMITTED`` marker records ``kind: shardtrain.model`` (so ``overwrite`` replaces only a
model), model.json's own sha256, and the id of the training run that published it (model.json
has it as ``run_id`` too). A run finds its own model there (``published_by``: the same run id,
resolved config and dataset) where its ranks were relaunched or its processes restarted after the
publish, or its finished command was run again, and finishes without training or publishing again.

``load_model(uri, program=False)`` (``training.load_model``, the public entry point) is
``common.model_artifact.read_model`` with the one thing only training knows: how to rebuild the
network from model.json (its model spec's ``restore``: a built-in's arguments, a plug-in's
factory and kwargs) and the verified weights. Verification, the
TorchScript path, the probe of the network against model.json and ``LoadedModel`` are
common.model_artifact's; this module must not read or check a published model by itself.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import platform
from typing import Dict

import numpy as np
import torch
from torch import nn

from common.commit_marker import KIND_MODEL, is_committed
from common.config import config_fingerprint
from common.dataset import LabelSpec
from common.features import FeatureSpec
from common.errors import ConfigError, DatasetError, first_line
from common.model_artifact import (CODE, META, MODEL_FORMAT, MODEL_FORMAT_VERSION, PROGRAM, WEIGHTS, LoadedModel,
                                   read_meta, read_model, verified_bytes)
from common.publish import publish, read_marker
from common.storage import Location, resolve, storage_errors
from training.tasks import task_for

log = logging.getLogger("shardtrain.train")


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


def serving_model(net: nn.Module, label_spec: LabelSpec) -> nn.Module:
    """``net`` as served: its output made what the label's task serves (``training.tasks``; a
    ``ServingModel`` for classification and regression)."""
    task = task_for(label_spec)
    own = task.serving_module(net, label_spec)
    return own if own is not None else ServingModel(net, **task.serving_arguments(label_spec))


def publish_model(uri: str, mode: str, net: nn.Module, meta: dict, torchscript: str = "auto",
                  code: bytes | None = None) -> str:
    """Write the model directory at ``uri`` atomically; ``meta`` becomes model.json (plus versions),
    its ``label`` a ``LabelSpec``'s record, its ``run_id`` (with ``config`` and ``dataset``: the
    publishing run's ``RankPlan.provenance()``) also the commit marker's. ``torchscript``
    (``output.torchscript``): whether a TorchScript program goes with the weights. ``code``: the
    model given to train() in code, pickled (``training.user_code``), kept as ``model.code.pkl``."""
    run_id = meta["run_id"]
    net = net.to("cpu").eval()
    serving = serving_model(net, LabelSpec.from_record(meta["label"]))
    weights = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    from safetensors.torch import save as save_safetensors

    blobs = {WEIGHTS: save_safetensors(weights)}
    program = None if torchscript == "never" else _program(serving, required=torchscript == "always")
    if program is not None:
        blobs[PROGRAM] = program
    if code is not None:
        blobs[CODE] = code
    files = {name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)} for name, data in blobs.items()}
    record = {"format": MODEL_FORMAT, "format_version": MODEL_FORMAT_VERSION, **meta, "versions": versions(),
              "files": files}
    text = json.dumps(record, indent=2, sort_keys=True)
    marker = {"kind": KIND_MODEL, "format": MODEL_FORMAT, "run_id": run_id,
              "model_json_sha256": hashlib.sha256(text.encode()).hexdigest()}
    side_files = _feature_files(meta)
    with publish(uri, mode=mode, marker=marker) as staging:
        for name, data in [*blobs.items(), *side_files.items()]:
            with storage_errors(f"writing {name}", staging.uri), staging.open(name, "wb") as fh:
                fh.write(data)
        staging.write_text(META, text)
    return uri


def _feature_files(meta: dict) -> dict[str, bytes]:
    """The feature records' side files (a text feature's tokenizer.json, ``common.features.base.FILES``),
    read from the dataset the run trained on and checked against their recorded sha256: the model
    carries them at the same paths, so it serves raw values as the dataset was encoded."""
    from common.file_digest import verify_digest

    entries = [entry for record in meta.get("features") or [] for entry in record.get("files") or []]
    if not entries:
        return {}
    root = resolve(meta["dataset"]["uri"])
    out = {}
    for entry in entries:
        verify_digest(root.join(entry["path"]), entry["sha256"])
        with storage_errors("reading a feature's file", root.uri), root.open(entry["path"], "rb") as fh:
            out[entry["path"]] = fh.read()
    return out


def published_by(uri: str, provenance: dict) -> dict | None:
    """model.json of the committed model at ``uri`` where the very run ``provenance`` describes
    (``RankPlan.provenance()``) published it: the same run id, resolved config and dataset. Only
    then is the run finished already and trains no more, whatever ``output.mode`` says. None
    otherwise: the run is a new one, and ``output.mode`` decides, also where a launch reused the
    run id (torchrun's ``--rdzv-id``) with another config or dataset."""
    loc = resolve(uri)
    with storage_errors("checking what the model path holds", loc.uri):
        if not is_committed(loc):
            return None
        marker = read_marker(loc)
    if marker.get("kind") != KIND_MODEL or marker.get("run_id") != provenance["run_id"]:
        return None
    meta = read_meta(loc)
    other = _another_run(meta, provenance)
    if other:
        log.warning("model at %s was published under this run id (%s) by a run with %s: this is a new run, and "
                    "output.mode applies", loc.uri, provenance["run_id"], other)
        return None
    return meta


def _another_run(meta: dict, provenance: dict) -> str | None:
    """How the run that published ``meta`` differs from the one ``provenance`` describes, in words;
    None where it does not. Nothing in the resolved config may differ: a restarted process and a
    retried command both run the very same command."""
    there, now = config_fingerprint(meta.get("config")), config_fingerprint(provenance["config"])
    if there != now:
        return f"another config (fingerprint {there} there, {now} now)"
    if meta.get("dataset") != provenance["dataset"]:
        return f"another dataset ({meta.get('dataset')} there, {provenance['dataset']} now)"
    return None


def _program(serving: nn.Module, required: bool) -> bytes | None:
    """The TorchScript program of ``serving``; where ``torch.jit.script`` cannot take it, a
    ConfigError (``required``) or None, said in the log. Never a trace: a trace records the one path
    its example took (a branch on a value, a loop over a batch's length), and would serve other
    inputs silently wrong."""
    try:
        scripted = torch.jit.script(serving)
    except Exception as exc:  # noqa: BLE001 - any network may be unscriptable (Python features TorchScript lacks)
        if required:
            raise ConfigError(f"output.torchscript=always, but torch.jit.script cannot compile the model "
                              f"({type(exc).__name__}: {first_line(exc)}); set output.torchscript=auto or never: "
                              "load_model and score rebuild the model from its weights") from None
        log.warning("the model is published without a TorchScript program: torch.jit.script cannot compile it "
                    "(%s: %s); load_model, score and MLflow rebuild it from its weights", type(exc).__name__,
                    first_line(exc))
        return None
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    return buffer.getvalue()


def check_scriptable(net: nn.Module, label_spec: LabelSpec) -> None:
    """Refuse, before any step (``output.torchscript: always``), a network the publish could not
    script: a ConfigError naming the key, the same on every rank."""
    _program(serving_model(net, label_spec), required=True)


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


def load_model(uri: str, program: bool = False, registry_uri: str | None = None, trust_code: bool = False) -> LoadedModel:
    """Load a published model, verifying each file it reads against the recorded sha256
    (``common.model_artifact.read_model``).

    ``program=False`` (default): the network rebuilt from model.json and safetensors, by its model
    spec: a built-in (MLP, FT-Transformer) from its arguments, a plug-in by calling its factory
    (``package.module:factory``, importable here) with the kwargs it was trained with. ``program=True``:
    the TorchScript program, where the model was published with one (``output.torchscript``). The
    choice is the caller's alone; no field of model.json can switch it.

    A model trained from code given to ``train(model=...)`` is rebuilt by running that code, which
    it holds (``model.code.pkl``, verified by its sha256): only with ``trust_code=True``, which logs
    the code's digest; without, a ConfigError (exit 2) names ``trust_code``.

    ``uri`` may name a registered version, ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``
    (in ``registry_uri``, or MLflow's default registry): it is downloaded and verified the same way.
    """
    return read_model(uri, program, functools.partial(_rebuilt_network, trust_code=trust_code), registry_uri)


def _rebuilt_network(loc: Location, meta: dict, trust_code: bool = False) -> nn.Module:
    """The network of model.json's model name and arguments (``ModelSpec.restore``), with its
    verified safetensors weights, as served."""
    name = (meta.get("model") or {}).get("name")
    arguments = (meta.get("model") or {}).get("arguments")
    from training.model_specs import built_in_specs, model_spec

    if not isinstance(arguments, dict):
        if name not in built_in_specs():
            raise DatasetError(f"{loc.uri}: plug-in model {name!r} was published before plug-ins were rebuilt from "
                               "their factory (model.json records no 'model.arguments'); load its TorchScript program "
                               "with load_model(uri, program=True), or re-train")
        raise DatasetError(f"{loc.uri}/{META}: field 'model.arguments' is {arguments!r}, but the built-in model needs "
                           "its arguments; the file was edited or damaged: re-train, or load the program with "
                           "load_model(uri, program=True)")
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    data = verified_bytes(loc, meta, WEIGHTS)
    label = LabelSpec.from_record(meta["label"])
    spec = model_spec(name, _stored_code(loc, meta, trust_code))
    try:
        net = spec.restore(arguments, FeatureSpec(meta["features"]).by_kind(), label.to_record())
    except ConfigError as exc:
        raise ConfigError(f"{loc.uri}: cannot rebuild the model: {exc}") from None
    try:
        net.load_state_dict(load_safetensors(data))
    except (SafetensorError, RuntimeError, TypeError, ValueError) as exc:
        raise DatasetError(f"{loc.uri}/{WEIGHTS}: cannot be loaded as the weights of model {name!r} "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); re-train or "
                           "re-publish the model") from None
    return serving_model(net, label)


def _stored_code(loc: Location, meta: dict, trust_code: bool):
    """The code given to train() that the model holds (a ``training.user_code.UserCode``), where it
    holds one and the caller trusts it; None where it holds none."""
    record = (meta.get("model") or {}).get("code")
    if not record or CODE not in (meta.get("files") or {}):
        return None
    objects = ", ".join(f"{role} {name}" for role, name in record.get("objects", {}).items())
    digest = meta["files"][CODE]["sha256"]
    if not trust_code:
        raise ConfigError(f"{loc.uri}: the model was trained from code given to train() ({objects}), which it holds "
                          f"in {CODE} (sha256 {digest}); rebuilding it runs that code. If you trust whoever trained "
                          "it, pass load_model(uri, trust_code=True) (shardtrain score: model_code: trust)")
    from training.user_code import UserCode

    code = UserCode(verified_bytes(loc, meta, CODE), record.get("objects", {}))
    log.warning("running the code stored with the model %s (%s; sha256 %s), as trust_code asked", loc.uri, objects,
                digest)
    return code


__all__ = ["LoadedModel", "ServingModel", "load_model", "publish_model", "published_by", "serving_model"]
