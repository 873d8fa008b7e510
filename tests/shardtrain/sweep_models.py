"""Plug-in models for the sweep tests (``model.name: sweep_models:<factory>``), importable by name
because the tests put tests/training (plugin_models) and this directory on the path."""

from plugin_models import Gated


def gated_when(feature_spec, label_spec, gate=0, after=1):
    """plugin_models.Gated (an [8] MLP that waits at its ``after``-th training call at the gate
    $SHARDTRAIN_TEST_GATE names) when ``gate`` is 1, else the same network without the wait: a
    sweep's search space over ``model.kwargs.gate`` picks the one trial a test holds."""
    model = Gated(feature_spec, label_spec, after)
    if not gate:
        model.gate = None
    return model
