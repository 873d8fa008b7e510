"""The non-finite guard: a NaN/inf loss, or non-finite weights before a checkpoint, stops every
rank together with one error naming the first bad step and rank (``NonFiniteLossError``, exit 1).

It notices a bad loss without a CPU-GPU sync per step; its ``check`` is a collective the loop
calls at the same steps on every rank (every ``train.log_every_steps``, each epoch's end, and
before each checkpoint is produced).
"""

from __future__ import annotations

import math

import torch

from common.errors import NonFiniteLossError


class NonFiniteGuard:
    """Notices a NaN/inf loss without a CPU-GPU sync per step; ``check`` (a collective, called at
    the same steps on every rank) stops all ranks together, naming the first bad step and rank.
    Given the model, ``check`` also refuses non-finite weights (checked before every checkpoint:
    an update can poison the weights at a step whose loss was still finite).

    fp16 tolerates ``tolerate`` consecutive non-finite losses: the GradScaler skips those steps
    and lowers the scale. More than that means the model itself diverged.
    """

    def __init__(self, tolerate: int):
        self.tolerate = tolerate
        self.run = None
        self.first_bad = None

    def observe(self, loss: torch.Tensor, step: int) -> None:
        bad = ~torch.isfinite(loss.detach())
        if self.run is None:
            self.run = torch.zeros((), dtype=torch.int64, device=loss.device)
            self.first_bad = torch.full((), -1, dtype=torch.int64, device=loss.device)
        self.run = torch.where(bad, self.run + 1, torch.zeros_like(self.run))
        tripped = (self.run > self.tolerate) & (self.first_bad < 0)
        self.first_bad = torch.where(tripped, torch.full_like(self.first_bad, step), self.first_bad)

    def check(self, group, model: torch.nn.Module | None = None, step: int = 0) -> None:
        first = -1 if self.first_bad is None else int(self.first_bad)
        # Smallest (step, rank) over ranks, each encoded in one float64 so a single Min allreduce finds both.
        codes = torch.tensor([first * group.size + group.rank if first >= 0 else math.inf,
                              step * group.size + group.rank if model is not None and not _all_finite(model)
                              else math.inf], dtype=torch.float64)
        loss_code, weights_code = (float(v) for v in group.allreduce_min(codes))
        if math.isfinite(loss_code):
            bad_step, rank = divmod(int(loss_code), group.size)
            extra = (f" ({self.tolerate + 1} consecutive non-finite losses: the fp16 loss scale could not recover)"
                     if self.tolerate else "")
            raise NonFiniteLossError(
                f"loss became non-finite (NaN or inf) at optimizer step {bad_step} on rank {rank}{extra}; "
                "lower train.lr, set train.clip_norm, or try train.precision=bf16/fp32")
        if math.isfinite(weights_code):
            bad_step, rank = divmod(int(weights_code), group.size)
            raise NonFiniteLossError(
                f"model weights became non-finite (NaN or inf) by optimizer step {bad_step} on rank {rank}, before "
                "the loss showed it; its checkpoint was not written. Lower train.lr, set train.clip_norm, "
                "or try train.precision=bf16/fp32")


def _all_finite(model: torch.nn.Module) -> bool:
    # Under FSDP each rank checks its own shard (DTensor.to_local); the check is a collective anyway.
    tensors = [getattr(t, "to_local", lambda t=t: t)() for t in model.state_dict().values() if t.is_floating_point()]
    # One reduction and one read (a CPU-GPU sync point), only at checkpoint steps.
    return not tensors or bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


__all__ = ["NonFiniteGuard"]
