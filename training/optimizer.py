"""The optimizer a run's model trains with (``train.optimizer``) and its learning-rate schedule
(``train.warmup_steps``, ``train.schedule``). The strategy may wrap the optimizer
(``Strategy.optimizer``: Horovod's DistributedOptimizer, DiLoCo's inner/outer pair)."""

from __future__ import annotations

import math

import torch

from training.config import TrainLoopConfig


def make_optimizer(model, t: TrainLoopConfig, lr: float) -> torch.optim.Optimizer:
    if t.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=t.momentum, weight_decay=t.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=t.weight_decay)


def set_lr(optimizer, base_lr: float, step: int, total_steps: int, t: TrainLoopConfig) -> None:
    """The learning rate of optimizer step ``step``: linear warmup, then constant or cosine down to
    a tenth of ``base_lr``. A pure function of the step: nothing to checkpoint, identical after a resume."""
    warmup = t.warmup_steps
    if warmup and step < warmup:
        lr = base_lr * (step + 1) / warmup
    elif t.schedule == "cosine":
        progress = (step - warmup) / max(1, total_steps - warmup)
        lr = base_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
    else:
        lr = base_lr
    for group in optimizer.param_groups:
        group["lr"] = lr


__all__ = ["make_optimizer", "set_lr"]
