"""FSDP2 (``train.parallel=fsdp``, torch backend): parameters, gradients and optimizer state
sharded across ranks, for models larger than one device.

Each Linear and Embedding is its own unit (gathered only while it computes), or the units a model
names (its spec's ``fsdp_units``: the FT-Transformer's blocks), then the root.
Parameters become DTensors in place; the plain module stays the module to call. Checkpoints and
exports hold full, gathered state dicts in the plain module's format (complete on rank 0, which
writes), so a run saved under FSDP resumes under DDP or Horovod and exports the same model.

torch is imported by the methods a rank runs (the driver imports this module for the declarations).
"""

from __future__ import annotations

import contextlib
import time

from training.model_specs import spec_of
from training.strategies.base import Strategy, initialise_optimizer_state


class FullyShardedDataParallel(Strategy):
    name, key, ranks = "fsdp", "train.parallel", ("torch",)

    @classmethod
    def model_shards(cls, cfg) -> int:
        return cfg.launch.num_proc  # every rank holds a shard of every unit

    def __init__(self, group, precision, config=None):
        super().__init__(group, precision, config)
        self._last_reduce_started: float | None = None  # set by the timed reduce-scatter

    def wrap(self, model):
        import torch
        from torch.distributed.fsdp import fully_shard

        policy = self.precision.sharded_policy()  # the precision decides, FSDP only applies it
        # A model that names its units (the FT-Transformer: one per block) gets those; else each
        # Linear and Embedding is one.
        units = spec_of(model).fsdp_units(model)
        if units is None:
            units = [module for module in model.modules()
                     if module is not model and isinstance(module, (torch.nn.Linear, torch.nn.Embedding))]
        for module in units:
            fully_shard(module, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        timed = _timed_reduce_scatter(self)
        if timed is not None:
            for module in [*units, model]:
                module.set_custom_reduce_scatter(timed)
        return model

    def accumulate(self, step_model, sync: bool):
        return super().accumulate(step_model, sync) if sync else _no_gradient_sync(step_model)

    def allreduce_wait(self, synchronize_started: float) -> float:
        """As DDP's (``training.strategies.ddp``), from the start of the step's last gradient
        reduce-scatter (0 on a torch without FSDP2's custom reduce-scatter hook)."""
        started, self._last_reduce_started = self._last_reduce_started, None
        return max(0.0, synchronize_started - started) if started is not None else 0.0

    def broadcast_initial_state(self, model, optimizer) -> None:
        # Every rank built the same seeded model and loaded the same checkpoint: nothing to send.
        if not optimizer.state_dict()["state"]:
            initialise_optimizer_state(optimizer)

    def model_state_dict(self, model) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state_dict(self, model, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return _by_index(full) if full else full

    def load_state_dicts(self, model, optimizer, model_state: dict, optimizer_state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=options)
        names = [name for name, _ in model.named_parameters()]
        set_optimizer_state_dict(model, optimizer, _by_name(optimizer_state, names), options=options)

    def unsharded(self, model, build):
        """Every rank takes part in the gather; rank 0, which exports, gets a module built by
        ``build`` holding the weights."""
        state = self.model_state_dict(model)
        if self.group.rank != 0:
            return None
        plain = build()
        plain.load_state_dict(state)
        return plain


def _timed_reduce_scatter(strategy: FullyShardedDataParallel):
    """FSDP2's own reduce-scatter, noting when each starts, or None where this torch has no
    ``set_custom_reduce_scatter`` to install it with."""
    import torch

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError:  # the class lives in a private torch module: without it the wait reads 0
        return None
    if not hasattr(torch.distributed.fsdp.FSDPModule, "set_custom_reduce_scatter"):
        return None

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, *args, **kwargs):
            strategy._last_reduce_started = time.perf_counter()
            return super().__call__(*args, **kwargs)

    return TimedReduceScatter()


def _by_index(full: dict) -> dict:
    """torch.distributed's full optimizer state dict (keyed by parameter name) in the format of
    ``optimizer.state_dict()`` (keyed by position), the format DDP and Horovod checkpoints hold."""
    names = [name for group in full["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in full["state"].items()},
            "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in full["param_groups"]]}


def _by_name(state: dict, names: list[str]) -> dict:
    """The inverse of ``_by_index``: positions are those of ``model.named_parameters()``."""
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]}


@contextlib.contextmanager
def _no_gradient_sync(model):
    # FSDP2's no_sync: keep unsharded gradients and skip the reduce-scatter until the last micro-batch.
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


__all__ = ["FullyShardedDataParallel"]
