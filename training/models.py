"""Model construction from the manifest's feature and label spec.

Every model takes the batch dict the loader yields (``numeric`` float32 [B, n], ``categorical``
int64 [B, k], one float32 [B, *shape] per array feature) and returns logits [B, num_classes]
(classification) or values [B] (regression). A plug-in ``"package.module:factory"`` is called
as ``factory(feature_spec, label_spec, **kwargs)`` with the manifest's plain dicts (the label's
``LabelSpec.to_record()``: the manifest's own record) and must
return such a ``torch.nn.Module`` (TorchScript-able, for the exported serving program).

A model that can train in pipeline stages (``train.pipeline``, ``training.strategies.pipeline``)
says how to cut it: ``pipeline_inputs()`` (the batch keys its first stage takes, positionally),
``pipeline_blocks()`` (how many consecutive blocks a stage boundary may fall between) and
``pipeline_stage(start, stop)``: a module holding blocks ``start..stop-1`` under this model's own
parameter names (so a stage's state dict is a piece of the model's), whose forward takes the
previous stage's output (the first: the inputs) and returns the next one's input (the last: the
model's output). Chained, the stages compute exactly what ``forward`` does. Built by hand from the
model's own modules, never traced.

Imported on ranks only (it imports torch).
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from common.errors import ConfigError
from common.plugins import load_callable
from common.dataset import RESERVED_INDICES, LabelSpec
from training.config import ModelConfig



class TabularMLP(nn.Module):
    """Embeddings for categoricals, numeric features as they are, array features flattened."""

    def __init__(self, num_numeric: int, vocab_sizes: list[int], array_names: list[str], array_widths: list[int],
                 out_dim: int, hidden: list[int], dropout: float = 0.0, embedding_dim: int | None = None,
                 regression: bool = False):
        super().__init__()
        self.array_names = list(array_names)
        self.regression = regression
        dims = [embedding_dim or min(16, (size + 1) // 2) for size in vocab_sizes]
        self.embeddings = nn.ModuleList(nn.Embedding(size, dim) for size, dim in zip(vocab_sizes, dims))
        width = num_numeric + sum(dims) + sum(array_widths)
        layers: list[nn.Module] = []
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = size
        layers.append(nn.Linear(width, out_dim))
        self.body = nn.Sequential(*layers)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [batch["numeric"]]
        categorical = batch["categorical"]
        for j, embedding in enumerate(self.embeddings):
            parts.append(embedding(categorical[:, j]))
        for name in self.array_names:
            value = batch[name]
            parts.append(value.reshape(value.shape[0], -1))
        out = self.body(torch.cat(parts, dim=1))
        if self.regression:
            return out.squeeze(1)
        return out

    # --- pipeline stages (see the module docstring) -------------------------------------------------

    def pipeline_inputs(self) -> list[str]:
        return ["numeric", "categorical", *self.array_names]

    def pipeline_blocks(self) -> int:
        """One block per Linear with the activation and dropout after it: the input embeddings
        and concatenation go with the first, the regression squeeze with the last."""
        return len(self._block_starts())

    def pipeline_stage(self, start: int, stop: int) -> nn.Module:
        return _MLPStage(self, start, stop)

    def _block_starts(self) -> list[int]:
        return [i for i, layer in enumerate(self.body) if isinstance(layer, nn.Linear)]


class _MLPStage(nn.Module):
    """Blocks ``start..stop-1`` of a ``TabularMLP``: its own modules (shared, not copied) under its
    own names (``embeddings.0.weight``, ``body.2.weight``)."""

    def __init__(self, mlp: TabularMLP, start: int, stop: int):
        super().__init__()
        starts = mlp._block_starts() + [len(mlp.body)]
        self.first, self.last = start == 0, stop == len(starts) - 1
        self.array_names, self.regression = list(mlp.array_names), mlp.regression
        if self.first:
            self.embeddings = mlp.embeddings
        # A ModuleDict keyed by the Sequential's own indices keeps the names body.<i>.*.
        self.body = nn.ModuleDict({str(i): mlp.body[i] for i in range(starts[start], starts[stop])})

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.first:
            # TabularMLP.forward's input part, on the batch's tensors in pipeline_inputs() order.
            numeric, categorical, *arrays = inputs
            parts = [numeric] + [embedding(categorical[:, j]) for j, embedding in enumerate(self.embeddings)]
            parts += [value.reshape(value.shape[0], -1) for value in arrays]
            out = torch.cat(parts, dim=1)
        else:
            (out,) = inputs
        for layer in self.body.values():
            out = layer(out)
        return out.squeeze(1) if self.last and self.regression else out


def mlp_arguments(feature_spec: dict, label_spec: dict, hidden: list[int], dropout: float = 0.0,
                  embedding_dim: int | None = None, **overrides) -> dict:
    """The MLP's constructor arguments, as plain values (stored in model.json, so it rebuilds)."""
    arrays = feature_spec.get("arrays", [])
    regression = label_spec.get("task") != "classification"
    args = dict(
        num_numeric=len(feature_spec.get("numeric", [])),
        vocab_sizes=[int(c.get("num_embeddings", len(c["vocab"]) + RESERVED_INDICES)) for c in feature_spec.get("categorical", [])],
        array_names=[a["name"] for a in arrays],
        array_widths=[int(torch.tensor(a["shape"]).prod()) for a in arrays],
        out_dim=1 if regression else int(label_spec["num_classes"]),
        hidden=list(hidden), dropout=float(dropout), embedding_dim=embedding_dim, regression=regression)
    args.update(overrides)
    return args


def build_model(model_cfg: ModelConfig, feature_spec: dict, label_spec: LabelSpec) -> nn.Module:
    name = model_cfg.name
    if name == "mlp":
        return TabularMLP(**mlp_arguments(feature_spec, label_spec.to_record(), model_cfg.hidden, model_cfg.dropout,
                                          model_cfg.embedding_dim, **model_cfg.kwargs))
    factory = load_callable(name, "model.name")
    model = factory(feature_spec, label_spec.to_record(), **model_cfg.kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


__all__ = ["TabularMLP", "build_model", "mlp_arguments"]
