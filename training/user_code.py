"""Your own model, loss and metrics in the managed loop: what ``train(cfg, model=..., loss=...,
metrics=..., finalize=...)`` ships to the ranks (``UserCode``), and the contract that code meets.

The contract, version 1 (the batch of today's ``module:factory`` plug-ins):

* **model**: a class or function called as ``model(feature_spec, label_spec, **model.kwargs)``
  (``feature_spec``: the features by kind, ``label_spec``: the label record; plain dicts) that
  returns a ``torch.nn.Module``. Its ``forward(batch)`` receives a dict of tensors: each feature
  kind's entries (``numeric`` float32 [B, k], ``categorical`` int64 [B, k], each array feature
  under its own name as float32 [B, *shape]) and returns the outputs: a tensor ([B, classes]
  logits, or [B] values), or an object whose ``.logits`` is that tensor (as Hugging Face models
  return). ``model.name: "package.module:factory"`` names the same thing by import path.
* **loss** (optional): ``loss(outputs, batch) -> scalar tensor``, the training loss of one
  micro-batch, in place of the task's (``batch["label"]`` holds the label). Without it, the
  task's loss of the logits.
* **metrics** (optional): ``metrics(outputs, batch) -> {name: tensor}``, sums over the batch's
  rows (a count, a sum of errors, a histogram for a binned AUC); the loop adds them over every val
  row of every rank (one allreduce), so they are exact at any world size. **finalize**
  (optional): ``finalize(sums) -> {name: float}``, the epoch's metrics from the totals (float64
  tensors); without it the totals themselves are reported. Each lands in the epoch's record as
  ``val_<name>``.
* A network may carry them itself, Lightning-style: methods ``loss(outputs, batch)``,
  ``metrics(outputs, batch)`` and ``finalize(sums)`` on the model are used where ``train`` was not
  given them.

Before the first step every rank runs the model (in eval mode, without gradients, its random
state put back), the loss and the metrics on a two-row probe batch, wherever code given to
``train`` or a network's own loss or metrics is in play: code that raises there is a
ConfigError (exit 2) carrying the user's traceback, before any rank trains. An out-of-memory
error stays what it is (exit 1, which schedulers retry).

Objects given to ``train`` are pickled with cloudpickle on the driver, once, into bytes the rank
plan carries; classes and functions defined in a notebook (``__main__``) travel by value, those
of an importable module by reference (the ranks import it). torchrun has no driver to ship from:
it takes ``model.name: module:factory`` only. A model trained from a notebook's code is published
with its weights and, where ``torch.jit.script`` compiles it, its TorchScript program; its code is
not stored with the model.
"""

from __future__ import annotations

import functools
import hashlib
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from common.errors import ConfigError, first_line

CONTRACT_VERSION = 1
ROLES = ("model", "loss", "metrics", "finalize")


def qualified_name(obj: Any) -> str:
    """``module:qualname`` of a class or function (what model.name records for a model given in code)."""
    return f"{getattr(obj, '__module__', None) or '__main__'}:{getattr(obj, '__qualname__', type(obj).__name__)}"


@dataclass(frozen=True)
class UserCode:
    """The user's objects, pickled once on the driver (``payload``); ``names`` says what each is."""

    payload: bytes
    names: dict = field(default_factory=dict)  # role -> module:qualname
    # Line number -> (file, source line) of the given objects, read on the driver: cloudpickle
    # names every shipped code object's file "<dynamic-code>", so a rank's traceback shows no source.
    lines: dict = field(default_factory=dict)

    @classmethod
    def of(cls, **given) -> "UserCode | None":
        """The objects given to ``train`` (None where none were), each checked to be callable."""
        objects = {role: given.get(role) for role in ROLES if given.get(role) is not None}
        if not objects:
            return None
        for role, obj in objects.items():
            if not callable(obj):
                raise ConfigError(f"train({role}=...) must be a class or function, got {type(obj).__name__}")
        if "finalize" in objects and "metrics" not in objects:
            raise ConfigError("train(finalize=...) needs train(metrics=...): it finalizes the metrics' sums")
        import cloudpickle

        return cls(cloudpickle.dumps(objects), {role: qualified_name(obj) for role, obj in objects.items()},
                   _source_lines(objects.values()))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.payload).hexdigest()

    def get(self, role: str) -> Callable | None:
        return _unpickled(self.payload).get(role)

    def record(self) -> dict:
        """What model.json and the run record say of it."""
        return {"contract": CONTRACT_VERSION, "objects": dict(self.names), "sha256": self.sha256}


def _source_lines(objects) -> dict:
    """Each object's source lines by line number, where its source can be read (a notebook cell's
    too: IPython keeps cells in linecache)."""
    import inspect

    found = {}
    for obj in objects:
        try:
            lines, start = inspect.getsourcelines(obj)
            filename = inspect.getsourcefile(obj) or "<unknown>"
        except (OSError, TypeError):
            continue
        for offset, text in enumerate(lines):
            found.setdefault(start + offset, (filename, text.strip()))
    return found


def formatted_traceback(exc: BaseException, lines: dict) -> str:
    """``exc``'s traceback, with the user's own source lines where cloudpickle's shipped code has none."""
    out = ["Traceback (most recent call last):"]
    for frame in traceback.extract_tb(exc.__traceback__):
        filename, text = frame.filename, frame.line
        if filename == "<dynamic-code>" and frame.lineno in lines:
            filename, text = lines[frame.lineno]
        out.append(f'  File "{filename}", line {frame.lineno}, in {frame.name}')
        if text:
            out.append(f"    {text}")
    out.append(f"{type(exc).__name__}: {exc}")
    return "\n".join(out)


@functools.lru_cache(maxsize=4)
def _unpickled(payload: bytes) -> dict:
    import cloudpickle

    return cloudpickle.loads(payload)


@dataclass(frozen=True)
class UserObjective:
    """The loss, metrics and finalize a run uses beyond its task's: given to ``train`` or carried by
    the network (``of``); each None where neither has it."""

    loss: Callable | None = None
    metrics: Callable | None = None
    finalize: Callable | None = None

    @classmethod
    def of(cls, code: UserCode | None, model) -> "UserObjective":
        def pick(role: str):
            given = code.get(role) if code is not None else None
            own = getattr(model, role, None)
            return given if given is not None else (own if callable(own) else None)

        return cls(loss=pick("loss"), metrics=pick("metrics"), finalize=pick("finalize"))


def logits_of(outputs):
    """The tensor in a network's outputs: the outputs themselves, or their ``.logits``."""
    logits = getattr(outputs, "logits", None)
    return outputs if logits is None else logits


def probe(model, objective: UserObjective, batch: dict, where: str, lines: dict | None = None) -> list[str]:
    """Run ``model``, the loss and the metrics on ``batch`` (a probe), as a step and a validation
    pass would; return the metrics' names, in order. Code that raises is a ConfigError naming
    ``where`` with the user's traceback (``lines``: ``UserCode.lines``, the source cloudpickle
    drops); an out-of-memory error is raised as it is."""
    import torch

    training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            try:
                outputs = model(batch)
                if objective.loss is not None:
                    value = objective.loss(outputs, batch)
                    if not isinstance(value, torch.Tensor) or value.numel() != 1:
                        raise TypeError(f"the loss returned {type(value).__name__}"
                                        f"{list(value.shape) if isinstance(value, torch.Tensor) else ''}, "
                                        "not a scalar tensor")
                names = []
                if objective.metrics is not None:
                    sums = objective.metrics(outputs, batch)
                    if not isinstance(sums, dict) or not all(isinstance(v, torch.Tensor) for v in sums.values()):
                        raise TypeError("metrics(outputs, batch) must return a dict of tensors (sums over the "
                                        f"batch's rows), got {type(sums).__name__}")
                    names = list(sums)
                    if objective.finalize is not None:
                        finalized = objective.finalize({k: v.double().sum() for k, v in sums.items()})
                        if not isinstance(finalized, dict):
                            raise TypeError(f"finalize(sums) must return a dict, got {type(finalized).__name__}")
                return names
            except (torch.cuda.OutOfMemoryError, MemoryError):
                raise
            except Exception as exc:  # noqa: BLE001 - the user's own code: any error is theirs to see
                raise ConfigError(f"{where} raised on a probe batch before training ({type(exc).__name__}: "
                                  f"{first_line(exc)}):\n{formatted_traceback(exc, lines or {})}") from None
    finally:
        model.train(training)


__all__ = ["CONTRACT_VERSION", "UserCode", "UserObjective", "logits_of", "probe", "qualified_name"]
