"""Mixed precision as one small object (after Lightning Fabric's precision plugins).

``fp32``: nothing. ``bf16``: autocast only; bf16 has fp32's exponent range, so it needs no loss
scaling and refuses a scaler. ``fp16``: autocast plus a GradScaler, stepped in the order Horovod
needs: the allreduce must finish before the gradients are unscaled and clipped, and the step must
not start a second allreduce::

    precision.backward(loss)              # scaler.scale(loss).backward()
    optimizer.synchronize()               # Horovod: wait for the averaged gradients
    precision.unscale_(optimizer)         # so clip_norm applies to true gradients
    clip_grad_norm_(...)
    with optimizer.skip_synchronize():
        precision.step(optimizer)         # skipped by the scaler when gradients overflowed
    precision.update()

``sharded_policy`` is the same decision in the form FSDP2 takes, so a sharded model's precision
is decided here too. Works on CUDA and CPU (torch 2.13 has CPU fp16 autocast and a CPU GradScaler). Model weights stay
fp32, so checkpoints and exports are precision-independent; the scaler state is checkpointed.
"""

from __future__ import annotations

import contextlib


class Precision:
    def __init__(self, kind: str, device_type: str, scaler=None):
        import torch

        if kind not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {kind!r}")
        if kind != "fp16" and scaler is not None:
            raise ValueError(f"precision {kind} takes no GradScaler: only fp16 needs loss scaling")
        self.kind, self.device_type = kind, device_type
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[kind]
        if kind == "fp16" and scaler is None:
            scaler = torch.amp.GradScaler(device_type)
        self.scaler = scaler

    def autocast(self):
        """The forward (and loss) context."""
        if self.kind == "fp32":
            return contextlib.nullcontext()
        import torch

        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss):
        """The loss backward starts from (scaled for fp16); for a step whose backward another
        library runs (a pipeline schedule)."""
        return self.scaler.scale(loss) if self.scaler else loss

    def backward(self, loss) -> None:
        self.scale(loss).backward()

    def unscale_(self, optimizer) -> None:
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def agree_on_overflow(self, optimizer, all_reduce_max) -> None:
        """After ``unscale_``: make every rank see an overflow any rank saw, so all skip the step
        (and lower the scale) together. Needed where ranks hold different gradients (pipeline
        stages); data-parallel replicas hold the same ones and agree by themselves.
        ``all_reduce_max(tensor)``: in place, over every rank."""
        if not self.scaler:
            return
        # GradScaler keeps no public handle on what unscale_ found; FSDP's ShardedGradScaler
        # reduces this same per-optimizer record across ranks.
        for found in self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            all_reduce_max(found)

    def step(self, optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)
        else:
            optimizer.step()

    def update(self) -> None:
        if self.scaler:
            self.scaler.update()

    def sharded_policy(self):
        """This precision as FSDP2's ``MixedPrecisionPolicy``: bf16 computes in bf16 and reduces
        gradients in fp32; fp32 and fp16 (autocast and the scaler do that work) keep the defaults."""
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.kind == "bf16":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)


__all__ = ["Precision"]
