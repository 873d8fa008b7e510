"""What a model is to shardtrain: ``ModelSpec``, the class of every built-in model's spec, and
``PluginSpec``, a plug-in model's (``model.name: "package.module:factory"``).

A spec owns its network's builder (``network``: "module:Class", imported when a rank builds one),
the ``model.*`` keys it owns (its constructor's keyword arguments, what model.json keeps and what a
checkpoint's identity records), the arithmetic the driver checks before launch (parameters,
pipeline blocks, the keys that size it, how many stages it can take), and its declared
capabilities: which of the network's optional methods it has (cut into pipeline stages, its blocks'
names, example inputs to time them on, FSDP units; ``training.models`` documents them) and which
feature kinds it takes. A spec is called as a plug-in factory is, ``spec(feature_spec,
label_spec, **keys) -> torch.nn.Module``, and registered the same way (``training.model_specs``).

Strategies ask a network's spec (``training.model_specs.spec_of``) what it offers; only
``PluginSpec`` looks at the network itself, since a plug-in declares nothing. Torch-free at import:
the driver's config check reads the specs; torch comes with the network, on the ranks.
"""

from __future__ import annotations

from typing import Callable

from common.errors import ConfigError
from common.plugins import load_callable

# What a network may offer beyond ``forward(batch)``: each capability and the methods it means.
PIPELINE = "pipeline"  # cut into consecutive stages (training.strategies.pipeline)
BLOCK_NAMES = "pipeline_block_names"  # each block's module name (an explicit train.pipeline.split)
EXAMPLE = "pipeline_example"  # made-up first-stage inputs (train.pipeline.split: auto times blocks on them)
FSDP_UNITS = "fsdp_units"  # the modules FSDP2 shards one by one (else each Linear and Embedding)
METHODS = {PIPELINE: ("pipeline_inputs", "pipeline_blocks", "pipeline_stage"), BLOCK_NAMES: ("pipeline_block_names",),
           EXAMPLE: ("pipeline_example",), FSDP_UNITS: ("fsdp_units",)}


class ModelSpec:
    """A built-in model. Subclasses declare the attributes and give the driver's arithmetic."""

    network = ""  # "module:Class" of its torch.nn.Module
    # The model.* keys it owns, in its constructor's order, each with the type model.json keeps it
    # as (None: as it is).
    keys: dict[str, Callable | None] = {}
    capabilities: frozenset[str] = frozenset()  # of PIPELINE, BLOCK_NAMES, EXAMPLE, FSDP_UNITS
    feature_kinds: tuple[str, ...] | None = None  # the feature kinds it takes (None: any)

    # --- the driver, before anything launches ------------------------------------------------------

    def own_arguments(self, model_cfg) -> dict:
        """Its keys' values in ``model_cfg`` (the config's model section), as plain values."""
        own = {}
        for key, plain in self.keys.items():
            value = getattr(model_cfg, key)
            own[key] = value if plain is None else plain(value)
        return own

    def keyword_arguments(self, model_cfg) -> dict:
        """What its constructor takes besides the dataset's: its keys, then ``model.kwargs``' overrides."""
        return {**self.own_arguments(model_cfg), **model_cfg.kwargs}

    def identity_keys(self) -> tuple[str, ...]:
        """The keys of its own that a checkpoint's identity records (besides those every model has)."""
        return tuple(self.keys)

    def parameters(self, model_cfg, data) -> int | None:
        """Its parameter count for ``model_cfg`` and a dataset's counts ``data``
        (``training.model_shape``), by its constructor's arithmetic; None: known once built."""
        return None

    def block_names(self, model_cfg) -> list[str] | None:
        """Its pipeline blocks' module names, in order (what an explicit ``train.pipeline.split``
        lists: its network's ``pipeline_block_names()``); None: known once built."""
        return None

    def check_features(self, model_cfg, feature_spec: dict, where: str) -> None:
        """Refuse (exit 2, naming the field) a dataset whose features it cannot take beyond their
        kinds (``feature_kinds``, which the plan checks first): how many of a kind, say."""

    def size_keys(self, model_cfg) -> str:
        """The keys that size it, as a refusal names them (a spec that counts its ``parameters``)."""
        raise NotImplementedError

    def check_stages(self, model_cfg, parts: int) -> None:
        """Refuse (exit 2, naming the key) ``parts`` pipeline stages it cannot be cut into."""
        if PIPELINE not in self.capabilities:
            raise ConfigError(f"model.name={model_cfg.name} cannot be cut into pipeline stages; set "
                              "train.pipeline.stages=1")

    # --- a rank: the network --------------------------------------------------------------------------

    def __call__(self, feature_spec: dict, label_spec: dict, **keys):
        """Its network for a dataset's plain feature and label specs, as a plug-in factory is called:
        ``keys`` are its own keys and overrides."""
        return self.rebuild({**self.data_arguments(feature_spec, label_spec), **keys})

    def rebuild(self, arguments: dict):
        """Its network from its constructor's arguments (``arguments``, as model.json keeps them)."""
        return load_callable(self.network, "model.name")(**arguments)

    def restore(self, arguments: dict, feature_spec: dict, label_spec: dict):
        """A published model's network, untrained, from model.json's ``model.arguments`` (what
        ``arguments`` gave) and its plain feature (by kind) and label specs."""
        return self.rebuild(arguments)

    def build(self, model_cfg, feature_spec: dict, label_spec):
        """The network of ``model_cfg`` for the dataset (``label_spec``: a ``LabelSpec``)."""
        return self(feature_spec, label_spec.to_record(), **self.keyword_arguments(model_cfg))

    def arguments(self, model_cfg, feature_spec: dict, label_spec: dict) -> dict | None:
        """Its constructor's arguments as plain values (model.json keeps them, so it rebuilds)."""
        return {**self.data_arguments(feature_spec, label_spec), **self.keyword_arguments(model_cfg)}

    @staticmethod
    def data_arguments(feature_spec: dict, label_spec: dict) -> dict:
        """Its constructor's arguments that come from the dataset (every built-in network's alike)."""
        from training.models import data_arguments

        return data_arguments(feature_spec, label_spec)

    def offers(self, model, capability: str) -> bool:
        """Whether its network ``model`` has ``capability`` (one of ``METHODS``)."""
        return capability in self.capabilities

    def fsdp_units(self, model) -> list | None:
        """The modules FSDP2 shards one by one, where the network names them; None: FSDP's default."""
        return model.fsdp_units() if self.offers(model, FSDP_UNITS) else None

    def pipeline_block_names(self, model) -> list[str] | None:
        """The built network's blocks' module names, where it names them."""
        return model.pipeline_block_names() if self.offers(model, BLOCK_NAMES) else None


class PluginSpec(ModelSpec):
    """A plug-in model: ``name`` is its factory, ``package.module:factory``, imported on the ranks
    only and called as ``factory(feature_spec, label_spec, **model.kwargs)``. It declares nothing:
    its size is known once built, and what it offers is what its network has."""

    def __init__(self, name: str | None = None, factory: Callable | None = None):
        self.name = name
        self.factory = factory  # given in code (train(model=...)); else imported by name

    def identity_keys(self) -> tuple[str, ...]:
        # A plug-in's checkpoints have recorded these since before model specs (the identity then
        # left out only the FT-Transformer's keys, and these were the MLP's): kept so they resume.
        return "hidden", "dropout", "embedding_dim"

    def check_stages(self, model_cfg, parts: int) -> None:
        """Known once a rank builds it (training.strategies.pipeline refuses it there)."""

    def build(self, model_cfg, feature_spec: dict, label_spec):
        return self.restore(self.arguments(model_cfg, feature_spec, label_spec), feature_spec, label_spec.to_record())

    def arguments(self, model_cfg, feature_spec: dict, label_spec: dict) -> dict | None:
        # Its factory is model.name, an import path: with these it is called again to rebuild it.
        return {"kwargs": dict(model_cfg.kwargs)}

    def restore(self, arguments: dict, feature_spec: dict, label_spec: dict):
        """The factory called again as training called it. Importing it runs the package's code, as
        training did: a package the user installed, never code that travels with the model."""
        from torch import nn

        factory = self.factory or load_callable(self.name, "model.name")
        model = factory(feature_spec, label_spec, **arguments["kwargs"])
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.name {self.name!r} returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def offers(self, model, capability: str) -> bool:
        return all(hasattr(model, method) for method in METHODS[capability])


__all__ = ["BLOCK_NAMES", "EXAMPLE", "FSDP_UNITS", "METHODS", "PIPELINE", "ModelSpec", "PluginSpec"]
