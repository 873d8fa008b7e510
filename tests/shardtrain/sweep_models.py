"""Plug-in models for the sweep tests (``model.name: sweep_models:<factory>``), importable by name
because the tests put tests/training (plugin_models) and this directory on the path."""

import os

from plugin_models import Gated, _wait_at_gate, tiny


def gated_when(feature_spec, label_spec, gate=0, after=1):
    """plugin_models.Gated (an [8] MLP that waits at its ``after``-th training call at the gate
    $SHARDTRAIN_TEST_GATE names) when ``gate`` is 1, else the same network without the wait: a
    sweep's search space over ``model.kwargs.gate`` picks the one trial a test holds."""
    model = Gated(feature_spec, label_spec, after)
    if not gate:
        model.gate = None
    return model


def held_or_stopped(feature_spec, label_spec, role="", gates=""):
    """The same [8] MLP, held on a rank (RANK set: a torch.distributed rank, not the driver) by role:
    ``hold`` waits at the gate ``<gates>/hold`` while the model is built (start-up, where the rank's
    heartbeat is progress enough, so its launch is not called stalled), ``stop`` waits at
    ``<gates>/stop`` in its first training call (inside an epoch: a test SIGSTOPs it there)."""
    model = Gated(feature_spec, label_spec, after=1)
    model.gate = None
    if gates and os.environ.get("RANK") is not None:
        if role == "hold":
            _wait_at_gate(os.path.join(gates, "hold"))
        elif role == "stop":
            model.gate = os.path.join(gates, "stop")
    return model


def writes_scratch(feature_spec, label_spec, scratch=""):
    """plugin_models.tiny ([8]), built by a run that first writes a byte to ``scratch``: a test makes
    that path a link to /dev/full, a disk with no space left (the write fails with the kernel's own
    ENOSPC), then frees the space by removing the link (the write makes a plain file)."""
    with open(scratch, "wb", buffering=0) as fh:
        fh.write(b"\0")
    return tiny(feature_spec, label_spec, width=8)
