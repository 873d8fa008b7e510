"""What the ranks of tests/training/test_pipeline.py run, and the one-process runs they are held to.

``steps_on_stages`` trains the built-in MLP for a few optimizer steps with the pipeline strategy
on a real rank group; ``steps_in_one_process`` trains the same seeded model on the same rows with
the one-process strategy. Replica ``d`` of a data-parallel x pipeline layout reads batch ``d`` of
every step; one process reads all replicas' rows at once, which is the same mean loss.
"""

from __future__ import annotations

import torch

from common.dataset import LabelSpec
from training.tasks import Objective
from training.models import FTTransformer, TabularMLP
from training.precision import Precision
from training.strategies.base import initialise_optimizer_state
from training.strategies.pipeline import PipelineConfig

LABEL = LabelSpec(name="label", task="classification", num_classes=3)


def model(kind: str = "mlp") -> torch.nn.Module:
    """The built-in ``kind`` (``mlp``, ``ft_transformer``), seeded, with 4 blocks to cut."""
    torch.manual_seed(0)
    inputs = dict(num_numeric=4, vocab_sizes=[9, 5], array_names=["image"], array_widths=[6], out_dim=3)
    if kind == "ft_transformer":
        return FTTransformer(**inputs, layers=4, d_model=8, heads=2)
    return TabularMLP(**inputs, hidden=[16, 12, 12, 8], embedding_dim=3)


def batch(step: int, accum: int, replica: int, rows: int) -> dict:
    generator = torch.Generator().manual_seed(1000 * step + 10 * accum + replica)
    return {"numeric": torch.randn(rows, 4, generator=generator),
            "categorical": torch.stack([torch.randint(0, 9, (rows,), generator=generator),
                                        torch.randint(0, 5, (rows,), generator=generator)], dim=1),
            "image": torch.randn(rows, 2, 3, generator=generator),
            "label": torch.randint(0, 3, (rows,), generator=generator)}


def _optimizer(net):
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05)
    initialise_optimizer_state(optimizer)  # as every multi-rank strategy starts
    return optimizer


def steps_on_stages(group, pipeline: dict, steps: int, accum: int, rows: int, clip_norm=None,
                    precision: str = "fp32", poison_step: int | None = None, kind: str = "mlp") -> dict:
    """Per-step losses on this rank, the gathered state dicts on rank 0, and the steps the
    optimizer really took (fp16 skips). ``poison_step``: stage 0's gradients get an inf then."""
    from training.strategies.pipeline import PipelineParallel

    strategy = PipelineParallel(group, Precision(precision, "cpu"), PipelineConfig(**pipeline))
    net = model(kind)
    step_model = strategy.wrap(net)
    optimizer = _optimizer(net)
    strategy.broadcast_initial_state(net, optimizer)
    objective = Objective(LABEL)
    if poison_step is not None and strategy.holds_first:
        first = strategy.modules[0]
        linear = next(m for m in first.modules() if isinstance(m, torch.nn.Linear))
        linear.weight.register_hook(lambda g: g + float("inf") if _now["step"] == poison_step else g)
    losses = []
    for step in range(steps):
        _now["step"] = step
        micro = [batch(step, a, strategy.dp_rank, rows) for a in range(accum)]
        losses.append(float(strategy.train_step(step_model, micro, optimizer, objective, clip_norm)))
    return {"losses": losses, "model": strategy.model_state_dict(net),
            "optimizer": strategy.optimizer_state_dict(net, optimizer),
            # Adam's step counts of this rank's own parameters.
            "optimizer_steps": sorted({float(optimizer.state[p]["step"]) for m in strategy.modules
                                       for p in m.parameters()}),
            "scale": strategy.precision.state_dict().get("scale"), "dp_rank": strategy.dp_rank,
            "bounds": strategy.bounds, "owned": strategy.owned_names}


_now = {"step": -1}


def steps_in_one_process(steps: int, accum: int, rows: int, replicas: int = 1, clip_norm=None,
                         precision: str = "fp32", kind: str = "mlp") -> dict:
    from training.strategies.single import SingleProcess
    from training.distributed import LocalGroup

    strategy = SingleProcess(LocalGroup(), Precision(precision, "cpu"))
    net = model(kind)
    optimizer = _optimizer(net)
    objective = Objective(LABEL)
    losses = []
    for step in range(steps):
        micro = [_concat([batch(step, a, r, rows) for r in range(replicas)]) for a in range(accum)]
        losses.append(float(strategy.train_step(net, micro, optimizer, objective, clip_norm)))
    return {"losses": losses, "model": net.state_dict(), "optimizer": optimizer.state_dict()}


def _concat(batches: list[dict]) -> dict:
    return {key: torch.cat([b[key] for b in batches]) for key in batches[0]}



def train_rank(group, plan) -> dict:
    """One rank of a whole run through the rank loop (``training.loop.run_rank``), as a launcher
    would start it: rank 0 records, checkpoints and publishes."""
    from training.loop import run_rank

    return run_rank(plan, group)


def bubble_with_a_slow_first_stage(group, seconds: float, steps: int) -> dict:
    """``steps`` 1F1B steps on 2 stages whose first sleeps ``seconds`` in every micro-batch's
    forward; the strategy's epoch figures (the bubble fraction per stage) and the seconds slept."""
    import time

    from training.strategies.pipeline import PipelineParallel

    strategy = PipelineParallel(group, Precision("fp32", "cpu"), PipelineConfig(stages=2, microbatches=4))
    net = model()
    step_model = strategy.wrap(net)
    optimizer = _optimizer(net)
    slept = []
    if strategy.holds_first:
        def slow(module, inputs):
            time.sleep(seconds)
            slept.append(seconds)
        strategy.modules[0].register_forward_pre_hook(slow)
    for step in range(steps):
        strategy.train_step(step_model, [batch(step, 0, 0, 8)], optimizer, Objective(LABEL), None)
    return {"figures": strategy.epoch_metrics(), "slept": sum(slept), "stage": strategy.pp_rank}


def pid_recording_mlp(feature_spec: dict, label_spec: dict, pid_dir: str, hidden: list, **kwargs):
    """``model.name=pipeline_ranks:pid_recording_mlp``: the built-in MLP (so it cuts into stages),
    built by a rank that first records its pid as ``<pid_dir>/rank<RANK>-<pid>``: a failure test
    signals exactly its own launch's rank processes, and sees a relaunch as a second pid."""
    import os

    from training.models import mlp_arguments

    os.makedirs(pid_dir, exist_ok=True)
    with open(os.path.join(pid_dir, f"rank{os.environ.get('RANK', '0')}-{os.getpid()}"), "w"):
        pass
    return TabularMLP(**mlp_arguments(feature_spec, label_spec, hidden, **kwargs))
