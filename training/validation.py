"""One validation pass (``evaluate``): the loss and the task's metrics over every row of the val
split, beside the task's trivial baseline on the same rows. The metrics and their names are the
task's (``training.tasks``); this module only runs the pass and reduces its sums.

Evaluation is the one place ranks may run different numbers of batches (each rank its own range
of rows, the last batch partial): it reduces its sums once, at the end, on every rank. Rank-side
only; it does not import ``training.loop``, which hands it the rank's ``RankRun``.
"""

from __future__ import annotations

from typing import Callable

import torch

from training.tasks import task_for
from training.user_code import logits_of


def evaluate(run, loader, on_batch: Callable[[int | None], None] | None = None) -> dict:
    """Validation metrics over every row of the split (``run``: the loop's ``RankRun``; ``loader``:
    its val ``RankLoader``); one allreduce of sums at the end. ``on_batch(n)``: n batches done so
    far (0 at the start), then ``None`` once the pass is over: the supervisor's measure of progress
    here, as the step is in training. The user's loss and metrics (``run.user``,
    ``training.user_code``) where given: the loss in place of the task's, the metrics' sums beside
    the task's, finalized once reduced."""
    model, group, label_spec = run.model, run.group, run.plan.label_spec
    task, user = task_for(label_spec), run.user
    on_batch = on_batch or (lambda batches: None)
    on_batch(0)
    done = 0
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=run.device)  # loss, rows
    metric_sums = torch.zeros(task.metric_sums(label_spec), dtype=torch.float64, device=run.device)
    user_sums = torch.zeros(len(run.user_metric_names), dtype=torch.float64, device=run.device)
    with torch.no_grad():
        for batch in loader.every_row():
            batch = run.on_device(batch)
            label = batch["label"]
            with run.precision.autocast():
                output = run.strategy.evaluate_forward(model, batch)
            if output is not None:  # None: a pipeline's earlier stages; the last stage counts this batch
                rows = label.shape[0]
                logits = logits_of(output)
                loss = user.loss(output, batch) if user.loss is not None else task.loss(logits, label, label_spec)
                sums[0] += loss.double() * rows
                task.add_metric_sums(metric_sums, logits, label, label_spec)
                if user.metrics is not None:
                    user_sums += _user_sums(user.metrics(output, batch), run.user_metric_names, user_sums)
                sums[1] += rows
            done += 1
            on_batch(done)
    model.train()
    total = [float(v) for v in group.allreduce_sum(torch.cat([sums, metric_sums, user_sums]).cpu())]
    on_batch(None)
    loss, rows = total[:2]
    task_end = 2 + metric_sums.numel()
    return {"val_loss": loss / rows, **task.metric_values(total[2:task_end], rows, label_spec),
            **_user_values(user, run.user_metric_names, total[task_end:]), "val_rows": int(rows)}


def _user_sums(found: dict, names: list[str], like: torch.Tensor) -> torch.Tensor:
    """One batch's user metric sums in ``names``' order (the probe's); other names are an error
    naming them, since the ranks reduce one fixed vector."""
    if list(found) != names:
        raise ValueError(f"metrics(outputs, batch) returned the names {list(found)} on a val batch but {names} on "
                         "the probe batch before training; return the same names, in the same order, every time")
    return torch.stack([value.detach().to(like.device, torch.float64).sum() for value in found.values()])


def _user_values(user, names: list[str], totals: list[float]) -> dict:
    """The user's metrics as the epoch's record holds them: ``val_<name>``."""
    if user.metrics is None:
        return {}
    sums = {name: torch.tensor(value, dtype=torch.float64) for name, value in zip(names, totals)}
    values = user.finalize(sums) if user.finalize is not None else sums
    return {f"val_{name}": float(value) for name, value in values.items()}


__all__ = ["evaluate"]
