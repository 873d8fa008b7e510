"""Plug-in models for tests (``model.name: plugin_models:<factory>``); importable on ranks because
the tests put this directory on PYTHONPATH for them."""

import os
import time

from typing import Dict

import torch
from torch import nn

from training.models import TabularMLP, mlp_arguments


class Wrap(nn.Module):
    """A bare network over the numeric features, as the loop's batches hold them (unit tests)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, batch):
        return self.net(batch["numeric"])


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


class Tripwire(nn.Module):
    """An MLP that outputs NaN on one rank from one training forward call on, when the rank's
    environment says so (TRIPWIRE_NAN_RANK, TRIPWIRE_NAN_CALL, set through launch.env). The trigger is not
    in the model config, so a run with it and a run without it are the same run to a checkpoint."""

    def __init__(self, feature_spec, label_spec, width: int):
        super().__init__()
        self.net = TabularMLP(**mlp_arguments(feature_spec, label_spec, [width]))
        self.nan_rank = int(os.environ.get("TRIPWIRE_NAN_RANK", "-1"))
        self.nan_call = int(os.environ.get("TRIPWIRE_NAN_CALL", "0"))
        self.calls = 0

    def forward(self, batch):
        out = self.net(batch)
        if not self.training:
            return out
        self.calls += 1
        if int(os.environ.get("HOROVOD_RANK", "0")) == self.nan_rank and self.calls >= self.nan_call:
            return out * float("nan")
        return out


def tripwire(feature_spec, label_spec, width=32):
    return Tripwire(feature_spec, label_spec, width)


class PoisonedWeights(nn.Module):
    """From one training call on, the loss stays finite but its gradient is NaN, so the update
    poisons the weights one step before the loss shows it: sqrt(0 * w) is 0, its gradient 0 * inf."""

    def __init__(self, feature_spec, label_spec, after: int):
        super().__init__()
        self.net = TabularMLP(**mlp_arguments(feature_spec, label_spec, [8]))
        self.trap = nn.Parameter(torch.ones(1))
        self.after, self.calls = after, 0

    def forward(self, batch):
        out = self.net(batch)
        if self.training:
            self.calls += 1
            if self.calls > self.after:
                return out + torch.sqrt(self.trap * 0.0).sum()
        return out


def poisoned_weights(feature_spec, label_spec, after=5):
    return PoisonedWeights(feature_spec, label_spec, after)


class Spiky(nn.Module):
    """An MLP whose training loss is inf for any batch holding `_row` ``row``: one fp16 overflow
    per epoch, at the same step in every run with the same seed, so the loss scale moves."""

    def __init__(self, feature_spec, label_spec, row: int):
        super().__init__()
        self.net = TabularMLP(**mlp_arguments(feature_spec, label_spec, [16]))
        self.row = row

    def forward(self, batch):
        out = self.net(batch)
        if self.training and bool((batch["_row"] == self.row).any()):
            return out * float("inf")
        return out


def spiky(feature_spec, label_spec, row=0):
    return Spiky(feature_spec, label_spec, row)


class SlowValidation(nn.Module):
    """An MLP whose validation forward on one rank takes ``seconds`` per batch, after writing that
    rank's pid to ``flag`` (once): a window in which a test can stop the rank mid-validation."""

    def __init__(self, feature_spec, label_spec, rank: int, seconds: float, flag: str):
        super().__init__()
        self.net = TabularMLP(**mlp_arguments(feature_spec, label_spec, [8]))
        self.rank, self.seconds, self.flag = rank, seconds, flag

    def forward(self, batch):
        if not self.training and int(os.environ.get("HOROVOD_RANK", "0")) == self.rank:
            if not os.path.exists(self.flag):
                with open(self.flag, "w") as fh:
                    fh.write(str(os.getpid()))
            time.sleep(self.seconds)
        return self.net(batch)


def slow_validation(feature_spec, label_spec, rank=1, seconds=1.0, flag=""):
    return SlowValidation(feature_spec, label_spec, rank, seconds, flag)


class Gated(nn.Module):
    """An MLP that, at its ``after``-th training call, writes ``<gate>.waiting`` (this process's
    pid) and waits until ``<gate>.go`` exists, ``<gate>`` being $SHARDTRAIN_TEST_GATE (unset: no
    gate; the gate is not in the config, so a gated and an ungated run are the same run to
    shardtrain): a test holds a real run at a known step while it does something beside it
    (rewrites the dataset, starts a second job), then lets it go on."""

    def __init__(self, feature_spec, label_spec, after: int):
        super().__init__()
        self.net = TabularMLP(**mlp_arguments(feature_spec, label_spec, [8]))
        self.gate, self.after, self.calls = os.environ.get("SHARDTRAIN_TEST_GATE"), after, 0

    def forward(self, batch):
        if self.training:
            self.calls += 1
            if self.calls == self.after and self.gate:
                _wait_at_gate(self.gate)
        return self.net(batch)


def _wait_at_gate(gate: str, limit_s: float = 300.0) -> None:
    with open(gate + ".waiting.tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(gate + ".waiting.tmp", gate + ".waiting")
    deadline = time.monotonic() + limit_s  # a test that never opens the gate fails, not hangs
    while not os.path.exists(gate + ".go"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate}.go never appeared")
        time.sleep(0.02)


def gated(feature_spec, label_spec, after=40):
    return Gated(feature_spec, label_spec, after)


class StopsItself(nn.Module):
    """An MLP whose rank passes ``common.faults``' point ``rank<N>:step-<k>`` at the start of each
    training step: with ``SHARDTRAIN_FAULT=rank1:step-13:stop`` and ``SHARDTRAIN_FAULT_ONCE`` rank 1
    stops itself there once (its pid in the once-file; a rank that rejoins, or a relaunch, trains on).
    A test then kills the stopped rank at a known point of the run (stopped_rank.py), however loaded
    the machine, instead of racing the run from outside."""

    def __init__(self, feature_spec, label_spec, hidden=(16,)):
        super().__init__()
        self.net = TabularMLP(**mlp_arguments(feature_spec, label_spec, list(hidden)))
        self.calls = 0

    def forward(self, batch):
        if self.training:
            from common.faults import fault_point

            self.calls += 1
            fault_point(f"rank{os.environ.get('HOROVOD_RANK', os.environ.get('RANK', '0'))}", f"step-{self.calls}")
        return self.net(batch)


def stops_itself(feature_spec, label_spec, hidden=(16,)):
    return StopsItself(feature_spec, label_spec, hidden)


class Unscriptable(nn.Module):
    """A plug-in ``torch.jit.script`` cannot compile (a try statement: TorchScript has none, and
    many real models, Hugging Face's among them, use what it lacks), the tiny MLP inside."""

    def __init__(self, feature_spec, label_spec, width: int):
        super().__init__()
        self.net = TabularMLP(**mlp_arguments(feature_spec, label_spec, [width]))

    def forward(self, batch):
        try:
            return self.net(batch)
        except KeyError as exc:
            raise ValueError(f"the batch lacks {exc}") from None


def unscriptable(feature_spec, label_spec, width=4):
    return Unscriptable(feature_spec, label_spec, width)


def focal_loss(logits, label, gamma: float = 2.0):
    """Focal loss (Lin et al., 2017): cross-entropy down-weighted on the rows already right."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(1, label.long().unsqueeze(1)).squeeze(1)
    return (-((1 - logp.exp()) ** gamma) * logp).mean()


class FocalNet(nn.Module):
    """Lightning-style, one object: forward, its own loss (focal), metrics (sums) and finalize."""

    def __init__(self, feature_spec, label_spec, width: int = 8):
        super().__init__()
        self.net = TabularMLP(**mlp_arguments(feature_spec, label_spec, [width]))

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:  # typed: it scripts
        return self.net(batch)

    def loss(self, outputs, batch):
        return focal_loss(outputs, batch["label"])

    def metrics(self, outputs, batch):
        label = batch["label"].long()
        p_true = torch.softmax(outputs.float(), dim=-1).gather(1, label.unsqueeze(1))
        return {"correct": (outputs.argmax(dim=1) == label).sum(), "rows": torch.tensor(label.numel()),
                "p_true": p_true.sum()}

    def finalize(self, sums):
        return {"my_accuracy": sums["correct"] / sums["rows"], "mean_p_true": sums["p_true"] / sums["rows"]}


def focal_net(feature_spec, label_spec, width=8):
    return FocalNet(feature_spec, label_spec, width)
