"""Code as a notebook cell defines it, for tests/training/test_user_code.py and the session's
2-rank torch run (conftest.py): the model, loss, metrics and finalize are local to a function, so
nothing can import them by name and cloudpickle ships them by value, as it does a notebook's."""

import torch
from torch import nn


def notebook_code():
    """The FocalNet of plugin_models, written again as a notebook cell would: a model class and
    separate loss, metrics and finalize functions, none importable by name (they are local)."""
    from training.models import TabularMLP, mlp_arguments

    class Net(nn.Module):
        def __init__(self, feature_spec, label_spec, width: int = 8):
            super().__init__()
            self.net = TabularMLP(**mlp_arguments(feature_spec, label_spec, [width]))

        def forward(self, batch):
            return self.net(batch)

    def focal(outputs, batch, gamma: float = 2.0):
        logp = torch.log_softmax(outputs.float(), dim=-1).gather(1, batch["label"].long().unsqueeze(1)).squeeze(1)
        return (-((1 - logp.exp()) ** gamma) * logp).mean()

    def metrics(outputs, batch):
        label = batch["label"].long()
        p_true = torch.softmax(outputs.float(), dim=-1).gather(1, label.unsqueeze(1))
        return {"correct": (outputs.argmax(dim=1) == label).sum(), "rows": torch.tensor(label.numel()),
                "p_true": p_true.sum()}

    def finalize(sums):
        return {"my_accuracy": sums["correct"] / sums["rows"], "mean_p_true": sums["p_true"] / sums["rows"]}

    return {"model": Net, "loss": focal, "metrics": metrics, "finalize": finalize}
