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


def evaluate(run, loader, on_batch: Callable[[int | None], None] | None = None) -> dict:
    """Validation metrics over every row of the split (``run``: the loop's ``RankRun``; ``loader``:
    its val ``RankLoader``); one allreduce of sums at the end. ``on_batch(n)``: n batches done so
    far (0 at the start), then ``None`` once the pass is over: the supervisor's measure of progress
    here, as the step is in training."""
    model, group, label_spec = run.model, run.group, run.plan.label_spec
    task = task_for(label_spec)
    on_batch = on_batch or (lambda batches: None)
    on_batch(0)
    done = 0
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=run.device)  # loss, rows
    metric_sums = torch.zeros(task.metric_sums(label_spec), dtype=torch.float64, device=run.device)
    with torch.no_grad():
        for batch in loader.every_row():
            batch = run.on_device(batch)
            label = batch["label"]
            with run.precision.autocast():
                output = run.strategy.evaluate_forward(model, batch)
            if output is not None:  # None: a pipeline's earlier stages; the last stage counts this batch
                rows = label.shape[0]
                sums[0] += task.loss(output, label, label_spec).double() * rows
                task.add_metric_sums(metric_sums, output, label, label_spec)
                sums[1] += rows
            done += 1
            on_batch(done)
    model.train()
    total = [float(v) for v in group.allreduce_sum(torch.cat([sums, metric_sums]).cpu())]
    on_batch(None)
    loss, rows = total[:2]
    return {"val_loss": loss / rows, **task.metric_values(total[2:], rows, label_spec), "val_rows": int(rows)}


__all__ = ["evaluate"]
