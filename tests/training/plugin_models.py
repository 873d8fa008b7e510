"""Plug-in models for tests (``model.name: plugin_models:<factory>``); importable on ranks because
the tests put this directory on PYTHONPATH for them."""

import os

import torch
from torch import nn

from training.models import TabularMLP, mlp_arguments


class Failing(nn.Module):
    """An MLP that raises in forward on one rank after some calls: a rank's own bug."""

    def __init__(self, feature_spec, label_spec, fail_rank: int, fail_after: int):
        super().__init__()
        self.net = TabularMLP(**mlp_arguments(feature_spec, label_spec, [8]))
        self.fail_rank, self.fail_after, self.calls = fail_rank, fail_after, 0

    def forward(self, batch):
        self.calls += 1
        if int(os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0"))) == self.fail_rank and self.calls > self.fail_after:
            raise ValueError(f"plugin model exploded on purpose after {self.fail_after} calls")
        return self.net(batch)


def failing(feature_spec, label_spec, fail_rank=1, fail_after=3):
    return Failing(feature_spec, label_spec, fail_rank, fail_after)


class Poisoned(nn.Module):
    """Outputs NaN from a given forward call on: a diverged model."""

    def __init__(self, feature_spec, label_spec, nan_after: int):
        super().__init__()
        self.net = TabularMLP(**mlp_arguments(feature_spec, label_spec, [8]))
        self.nan_after, self.calls = nan_after, 0

    def forward(self, batch):
        self.calls += 1
        out = self.net(batch)
        return out * float("nan") if self.training and self.calls > self.nan_after else out


def poisoned(feature_spec, label_spec, nan_after=5):
    return Poisoned(feature_spec, label_spec, nan_after)


def tiny(feature_spec, label_spec, width=4):
    """A well-behaved plug-in: receives the specs, sizes itself from them."""
    return TabularMLP(**mlp_arguments(feature_spec, label_spec, [width]))
