"""A multilabel model as published and served: the network's logits through a sigmoid each, so
every class has its own probability (``training.tasks.multilabel``). A module of its own, not a
mode of ``training.export.ServingModel``: that class's code is what every classification and
regression program published so far holds, and must not change. ``net`` is the network, as
``ServingModel``'s is (``LoadedModel.predict_arrays`` takes its logits at a temperature).

Imports torch (only ``Multilabel.serving_module`` imports this, when a model is published or loaded).
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn


class MultilabelServing(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.sigmoid(self.net(batch).float())


__all__ = ["MultilabelServing"]
