"""The models shardtrain knows, one ``ModelSpec`` each (``training.model_specs.base``), and the
one way to find a model's spec: by ``model.name`` (``model_spec``) or by a built network
(``spec_of``).

``MODELS`` registers each built-in model by name the way ``model.name`` names a plug-in: as
``module:attribute`` of something called like a plug-in factory (a spec is one), imported through
``common.plugins``. Any other ``model.name`` is a plug-in's ``package.module:factory``: its
``PluginSpec`` imports it on the ranks only. Adding a built-in model is its network
(``training.models``), one spec module here and one line in ``MODELS``; nothing outside the specs
asks which model it has.

Torch-free: the driver's config check reads the specs (``training.config``, the pipeline
strategy's checks, ``training.model_shape``).
"""

from __future__ import annotations

import functools

from common.config import to_dict
from common.plugins import load_callable
from training.model_specs.base import ModelSpec, PluginSpec

# model.name -> "module:attribute" of its spec.
MODELS = {
    "mlp": "training.model_specs.mlp:SPEC",
    "ft_transformer": "training.model_specs.ft_transformer:SPEC",
    "resnet": "training.model_specs.resnet:SPEC",
}


@functools.cache
def built_in_specs() -> dict[str, ModelSpec]:
    """``MODELS``' specs by name, in its order."""
    return {name: load_callable(target, "model.name") for name, target in MODELS.items()}


def model_spec(name: str, code=None) -> ModelSpec:
    """The spec of ``model.name`` ``name``: a built-in's, else a plug-in's; ``code``: the
    ``training.user_code.UserCode`` given to train(), whose model is the plug-in's factory."""
    if code is not None and code.get("model") is not None:
        return PluginSpec(name, factory=code.get("model"))
    return built_in_specs().get(name) or PluginSpec(name)


def spec_of(model) -> ModelSpec:
    """The spec of a built network: the built-in spec whose network it is, else a plug-in's (which
    reads what the network offers from the network itself)."""
    network = f"{type(model).__module__}:{type(model).__qualname__}"
    return next((spec for spec in built_in_specs().values() if spec.network == network), PluginSpec())


def build_model(model_cfg, feature_spec: dict, label_spec, code=None):
    """The network ``model_cfg`` (the config's model section) names, or the model given to train()
    in ``code``, for a dataset's feature spec and ``LabelSpec`` (on a rank: imports torch)."""
    return model_spec(model_cfg.name, code).build(model_cfg, feature_spec, label_spec)


def identity(model_cfg) -> dict:
    """The model keys a checkpoint records and must match to resume: those every model has (that
    no built-in spec owns: name, kwargs, task, num_classes, features) and its spec's own. So a key
    another model owns never keeps a checkpoint from resuming."""
    owned = {key for spec in built_in_specs().values() for key in spec.keys}
    mine = model_spec(model_cfg.name).identity_keys()
    return {key: value for key, value in to_dict(model_cfg).items() if key in mine or key not in owned}


def offering(capability: str) -> list[str]:
    """The built-in models whose networks have ``capability``, by name, in ``MODELS``' order."""
    return [name for name, spec in built_in_specs().items() if capability in spec.capabilities]


__all__ = ["MODELS", "build_model", "built_in_specs", "identity", "model_spec", "offering", "spec_of"]
